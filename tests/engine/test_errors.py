"""Errors of deepcompile.initialize and Config validation (in-process; a world-size-1 gloo
group where one is needed, destroyed after each test)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

import deepcompile
from deepcompile import Config

_TORCHRUN_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
SGD = functools.partial(torch.optim.SGD, lr=0.1)


@pytest.fixture
def group(tmp_path):
    assert not dist.is_initialized()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 3), nn.ReLU(), nn.Linear(3, 2))


# --------------------------------------------------------------------------- process group
def test_no_process_group_and_no_torchrun_env(monkeypatch):
    for k in _TORCHRUN_ENV:
        monkeypatch.delenv(k, raising=False)
    assert not dist.is_initialized()
    with pytest.raises((RuntimeError, ValueError), match="MASTER_ADDR") as info:
        deepcompile.initialize(_model(), optimizer=SGD, config={"compiler": "fx"})
    assert "process group" in str(info.value)
    assert not dist.is_initialized()


def test_initialize_uses_existing_group(group):
    engine = deepcompile.initialize(_model(), optimizer=SGD, config={"compiler": "fx"})
    assert isinstance(engine.optimizer, torch.optim.SGD)


def test_warns_when_cuda_is_visible_but_the_model_is_on_the_cpu(group, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.warns(UserWarning, match=r"CUDA is available but the model is on the CPU.*"
                                         r"torch.cuda.set_device"):
        deepcompile.initialize(_model(), optimizer=SGD, config={"compiler": "fx"})


def test_no_cuda_warning_without_cuda(group, monkeypatch):
    import warnings

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        deepcompile.initialize(_model(), optimizer=SGD, config={"compiler": "fx"})


# ------------------------------------------------------------------------------- the model
def test_a_bf16_model_without_param_dtype_warns_of_bf16_masters(group):
    import warnings

    with pytest.warns(UserWarning, match=r"parameters are bfloat16 and Config.param_dtype is "
                      r"None: the optimizer's master weights will be bfloat16.*"
                      r"Config\(param_dtype=torch.bfloat16\)"):
        deepcompile.initialize(_model().to(torch.bfloat16), optimizer=SGD,
                               config={"compiler": "fx"})
    with warnings.catch_warnings():   # named: fp32 masters (the model's weights upcast)
        warnings.simplefilter("error", UserWarning)
        engine = deepcompile.initialize(_model().to(torch.bfloat16), optimizer=SGD,
                                        config={"compiler": "fx", "param_dtype": "bf16"})
    assert {p.dtype for g in engine.optimizer.param_groups for p in g["params"]} == \
        {torch.float32}


def test_meta_device_model(group):
    with torch.device("meta"):
        model = _model()
    with pytest.raises((ValueError, RuntimeError), match="meta"):
        deepcompile.initialize(model, optimizer=SGD, config={"compiler": "fx"})


def test_model_must_be_a_module(group):
    with pytest.raises((TypeError, ValueError)):
        deepcompile.initialize(lambda x: x, optimizer=SGD)


# --------------------------------------------------------------------------- the optimizer
@pytest.mark.parametrize("bad", [42, "adamw", [torch.optim.SGD]])
def test_optimizer_not_callable(group, bad):
    with pytest.raises((TypeError, ValueError), match="optimizer"):
        deepcompile.initialize(_model(), optimizer=bad, config={"compiler": "fx"})


def test_optimizer_instance_rejected(group):
    model = _model()
    with pytest.raises((TypeError, ValueError), match="optimizer"):
        deepcompile.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                               config={"compiler": "fx"})


def test_optimizer_factory_must_return_an_optimizer(group):
    with pytest.raises((TypeError, ValueError), match="Optimizer"):
        deepcompile.initialize(_model(), optimizer=lambda params: list(params),
                               config={"compiler": "fx"})


def test_default_optimizer_is_adamw(group):
    engine = deepcompile.initialize(_model(), config={"compiler": "fx"})
    assert isinstance(engine.optimizer, torch.optim.AdamW)


# ------------------------------------------------------------------------------ the config
@pytest.mark.parametrize("stage", [0, 4, "3", 2.0, True])
def test_zero_stage_other_than_1_2_3(group, stage):
    with pytest.raises(ValueError, match="zero_stage"):
        deepcompile.initialize(_model(), optimizer=SGD, config={"zero_stage": stage})
    with pytest.raises(ValueError, match="zero_stage"):
        Config(zero_stage=stage)


@pytest.mark.parametrize("key, value", [
    ("compiler", "tvm"),
    ("compiler", None),
    ("gradient_accumulation_steps", 0),
    ("gradient_accumulation_steps", -2),
    ("gradient_accumulation_steps", 1.5),
    ("max_grad_norm", -1.0),
    ("max_grad_norm", 0.0),
    ("max_grad_norm", "1.0"),
    ("param_dtype", "float8"),
    ("param_dtype", "bogus"),
    ("param_dtype", torch.int32),
    ("reduce_dtype", "int8"),
    ("passes", ("no-such-pass",)),
    ("passes", "prefetch,no-such-pass"),
    ("passes", "prefetch,prefetch"),
])
def test_invalid_config_value_names_the_key(group, key, value):
    with pytest.raises(ValueError, match=key):
        Config(**{key: value})
    with pytest.raises(ValueError, match=key):
        Config.from_dict({key: value})
    with pytest.raises(ValueError, match=key):
        deepcompile.initialize(_model(), optimizer=SGD, config={key: value})


def test_unknown_config_key_names_the_key(group):
    with pytest.raises(ValueError, match="zero_stag"):
        deepcompile.initialize(_model(), optimizer=SGD, config={"zero_stag": 3})
    with pytest.raises(ValueError, match="learning_rate"):
        Config.from_dict({"compiler": "fx", "learning_rate": 1.0})


def test_config_not_a_mapping(group):
    with pytest.raises(ValueError):
        deepcompile.initialize(_model(), optimizer=SGD, config=[("compiler", "fx")])


@pytest.mark.parametrize("given, expected", [
    ("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16), ("torch.float16", torch.float16),
    ("float32", torch.float32), (torch.bfloat16, torch.bfloat16), (None, None),
])
def test_valid_dtypes_accepted(given, expected):
    cfg = Config(param_dtype=given, reduce_dtype=given)
    assert cfg.param_dtype is expected and cfg.reduce_dtype is expected


def test_config_dict_and_dataclass_equivalent():
    d = {"zero_stage": 3, "compiler": "fx", "gradient_accumulation_steps": 4,
         "max_grad_norm": 1, "param_dtype": "bf16", "reduce_dtype": None, "passes": []}
    cfg = Config.from_dict(d)
    assert cfg == Config(zero_stage=3, compiler="fx", gradient_accumulation_steps=4,
                         max_grad_norm=1.0, param_dtype=torch.bfloat16, passes=())
    assert Config.from_dict(cfg.to_dict()) == cfg
    assert Config() == Config.from_dict({}) == Config.from_dict({"passes": "auto"})
    # the command line's form of a pass list
    assert Config(passes="prefetch, bucket_reduce").passes == ("prefetch", "bucket_reduce")
    assert Config(passes="").passes == () and Config(passes="selective_unshard").passes == \
        ("selective_unshard",)
    assert Config.from_dict(Config().to_dict()) == Config()


# ------------------------------------------------------------------------------ removed keys
def test_eager_modules_was_removed_and_says_what_to_do_instead(group, tmp_path):
    match = r"Config.eager_modules was removed; .*torch.compiler.disable"
    with pytest.raises(ValueError, match=match):
        Config(compiler="fx", eager_modules=("ReLU",))
    with pytest.raises(ValueError, match=match):
        Config.from_dict({"compiler": "fx", "eager_modules": ["ReLU"]})
    with pytest.raises(ValueError, match=match):
        deepcompile.initialize(_model(), optimizer=SGD,
                               config={"compiler": "fx", "eager_modules": ("ReLU",)})
    path = tmp_path / "c.json"
    path.write_text('{"compiler": "fx", "eager_modules": ["ReLU"]}')
    with pytest.raises(ValueError, match=match):
        Config.from_file(path)
    path.write_text('{"compiler": "fx"}')
    with pytest.raises(ValueError, match=match):   # as a keyword override
        Config.from_file(path, eager_modules=())
    with pytest.raises(ValueError, match=match):
        Config.from_deepspeed({"zero_optimization": {"stage": 3}}, eager_modules=())


# ------------------------------------------------------------------------------- the GPU
def test_a_cuda_model_must_be_on_the_current_device(monkeypatch):
    """CUDA events, memory figures and NCCL's object collectives act on the current device:
    a model on cuda:1 with cuda:0 current is refused with the call that fixes it."""
    from deepcompile._assemble import _check_current_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with pytest.raises(ValueError, match=r"cuda:1 but the current CUDA device is cuda:0; "
                                         r"call torch.cuda.set_device\(1\)"):
        _check_current_device(torch.device("cuda", 1))
    _check_current_device(torch.device("cuda", 0))
    _check_current_device(torch.device("cpu"))


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_a_cuda_model_needs_nccl(backend):
    from deepcompile._assemble import _check_backend

    with pytest.raises(ValueError, match="CUDA training needs 'nccl'"):
        _check_backend(torch.device("cuda", 0), backend)
    _check_backend(torch.device("cuda", 0), "nccl")
    _check_backend(torch.device("cuda", 0), "cpu:gloo,cuda:nccl")
