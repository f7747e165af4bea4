"""Config files (JSON, YAML, TOML) and DeepSpeed configs (Config.from_file,
Config.from_deepspeed; src/deepcompile/_config_io.py). In-process, no ranks."""

from __future__ import annotations

import json
import logging
import sys

import pytest
import torch

from deepcompile import Config

KEYS = {"zero_stage": 2, "compiler": "fx", "gradient_accumulation_steps": 4,
        "max_grad_norm": 1.0, "param_dtype": "bf16", "passes": ["bucket_reduce"]}
EXPECTED = Config(zero_stage=2, compiler="fx", gradient_accumulation_steps=4, max_grad_norm=1.0,
                  param_dtype=torch.bfloat16, passes=("bucket_reduce",))


def test_json_yaml_and_toml_files_give_the_same_config(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps(KEYS))
    (tmp_path / "c.yaml").write_text("zero_stage: 2\ncompiler: fx\ngradient_accumulation_steps: 4\n"
                                     "max_grad_norm: 1.0\nparam_dtype: bf16\npasses: [bucket_reduce]\n")
    (tmp_path / "c.toml").write_text('[deepcompile]\nzero_stage = 2\ncompiler = "fx"\n'
                                     'gradient_accumulation_steps = 4\nmax_grad_norm = 1.0\n'
                                     'param_dtype = "bf16"\npasses = ["bucket_reduce"]\n')
    for name in ("c.json", "c.yaml", "c.toml"):
        assert Config.from_file(tmp_path / name) == EXPECTED, name
    assert Config.from_file(tmp_path / "c.json", zero_stage=3).zero_stage == 3   # override


@pytest.mark.parametrize("name, text, match", [
    ("c.json", "{bad", "not valid JSON"),
    ("c.yaml", "a: [1,", "not valid YAML"),
    ("c.toml", "a = ", "not valid TOML"),
    ("c.ini", "[x]", "unknown file type '.ini'"),
    ("c.json", "[1, 2]", "must hold a mapping"),
    ("c.json", '{"zero_stage": 5}', "Config.zero_stage: 5"),
    ("c.json", '{"learning_rate": 1}', "unknown key 'learning_rate'"),
])
def test_bad_files_raise_clear_errors(tmp_path, name, text, match):
    (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match=match):
        Config.from_file(tmp_path / name)
    with pytest.raises(ValueError, match="cannot read"):
        Config.from_file(tmp_path / "missing.json")


def test_yaml_without_pyyaml_names_the_extra(tmp_path, monkeypatch):
    (tmp_path / "c.yaml").write_text("zero_stage: 2\n")
    monkeypatch.setitem(sys.modules, "yaml", None)
    with pytest.raises(ImportError, match=r"PyYAML: pip install -c constraints.txt -e '.\[yaml\]'"):
        Config.from_file(tmp_path / "c.yaml")


DS = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 4,
    "gradient_clipping": 1.0,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                          "stage3_param_persistence_threshold": 0,
                          "offload_optimizer": {"device": "cpu", "pin_memory": True}},
    "compile": {"deepcompile": True},
    "steps_per_print": 10,
}


def test_deepspeed_config_maps(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="deepcompile"):
        cfg = Config.from_deepspeed(DS, compiler="fx")
    assert cfg == Config(zero_stage=3, compiler="fx", gradient_accumulation_steps=4,
                         max_grad_norm=1.0, param_dtype=torch.bfloat16,
                         passes=("offload_optimizer",))
    warned = caplog.text
    for key in ("zero_optimization.overlap_comm", "train_micro_batch_size_per_gpu",
                "steps_per_print", "zero_optimization.stage3_param_persistence_threshold"):
        assert key in warned, key
    # a DeepSpeed JSON file given to from_file is recognised
    (tmp_path / "ds.json").write_text(json.dumps(DS))
    assert Config.from_file(tmp_path / "ds.json", compiler="fx") == cfg
    assert Config.from_deepspeed(tmp_path / "ds.json", compiler="fx") == cfg


def test_deepspeed_fp16_maps_to_loss_scaling():
    cfg = Config.from_deepspeed({"fp16": {"enabled": True, "loss_scale": 0,
                                          "initial_scale_power": 12, "loss_scale_window": 500},
                                 "zero_optimization": {"stage": 1},
                                 "communication_data_type": "fp32"})
    assert cfg.param_dtype is torch.float16 and cfg.reduce_dtype is torch.float32
    assert cfg.loss_scaling == "dynamic" and cfg.initial_loss_scale == 4096.0
    assert cfg.loss_scale_window == 500 and cfg.zero_stage == 1
    static = Config.from_deepspeed({"fp16": {"enabled": True, "loss_scale": 128}})
    assert static.loss_scaling == "static" and static.loss_scale == 128.0
    assert Config(param_dtype="bf16").loss_scaling is None
    assert Config(param_dtype="fp16").loss_scaling == "dynamic"


def test_deepspeed_auto_values_need_overrides():
    ds = {"gradient_accumulation_steps": "auto", "zero_optimization": {"stage": 2}}
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps is 'auto'.*"
                                         r"gradient_accumulation_steps=\.\.\."):
        Config.from_deepspeed(ds)
    assert Config.from_deepspeed(ds, gradient_accumulation_steps=8).gradient_accumulation_steps == 8


@pytest.mark.parametrize("ds, match", [
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}, "optimizer: deepcompile builds"),
    ({"scheduler": {"type": "WarmupLR"}}, "scheduler: use a torch.optim.lr_scheduler"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}},
     "offload_param: parameter offload is not supported"),
    ({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}, "device 'nvme'"),
    ({"zero_optimization": {"stage": 0}}, "stage: 0 is not supported"),
    ({"compile": {"deepcompile": False}}, "compile.deepcompile: is false"),
    ({"activation_checkpointing": {"partition_activations": True}}, "gradient_checkpointing_enable"),
    ({"zero_optimization": {"stage": 3, "mics_shard_size": 0}},
     "zero_optimization.mics_shard_size: 0 is not allowed"),
    ({"tensor_parallel": {"autotp_size": 2}}, "tensor_parallel: unknown or not supported"),
    ({"fp16": {"enabled": True, "auto_cast": True}}, "fp16.auto_cast"),
    ({"data_types": {"grad_accum_dtype": "bf16"}}, "grad_accum_dtype"),
])
def test_deepspeed_keys_without_counterpart_raise(ds, match):
    with pytest.raises(ValueError, match=match):
        Config.from_deepspeed(ds)
