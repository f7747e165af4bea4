"""The Hugging Face Trainer route (src/deepcompile/integrations/hf.py): a tiny Llama trained
by the real `transformers.Trainer` machinery over 2 gloo ranks with `DeepCompileTrainer`
(ZeRO-3, gradient accumulation, clipping, weight decay, a linear schedule with warm-up) has the
micro-step losses, the final weights and the evaluation loss of the plain Trainer in one
process on the same global batches; its checkpoints resume to the same losses; `save_model`
writes a directory `from_pretrained` loads."""

from __future__ import annotations

import os

import pytest
import torch

import _models
from _dist import run_distributed
from _train import FULL

pytest.importorskip("accelerate")

MODEL = "llama"   # its data
# the tiny Llama's decoder layers: one in the default run (an engine compiled in 70% of the time
# of two), two in the full suite ([Note: the core matrix] in tests/_train.py)
LAYERS = 2 if FULL else 1
SAMPLES = 32
STEPS = 4
GAS = 2
WORLD = 2


class _Samples(torch.utils.data.Dataset):
    def __init__(self, offset: int = 0):
        rows = [_models.global_batch(MODEL, i + offset)["input_ids"]
                for i in range(SAMPLES // _models.GLOBAL_BATCH)]
        self.ids = torch.cat(rows)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _model():
    torch.manual_seed(_models.SEED)
    return _models._llama(tie=False, layers=LAYERS).float().train()


def _args(out: str, per_device: int, **extra):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=out, per_device_train_batch_size=per_device, per_device_eval_batch_size=per_device,
        gradient_accumulation_steps=GAS, max_steps=STEPS, learning_rate=1e-2,
        lr_scheduler_type="linear", warmup_steps=1, weight_decay=0.1, max_grad_norm=0.5,
        logging_steps=1, save_strategy="steps", save_steps=2, report_to="none", use_cpu=True,
        seed=1234, dataloader_num_workers=0, disable_tqdm=True, optim="adamw_torch", **extra)


def _recording(base):
    class Recording(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.recorded = []

        def _get_train_sampler(self, train_dataset=None):   # the same global batches everywhere
            return torch.utils.data.SequentialSampler(train_dataset or self.train_dataset)

        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            self.recorded.append(float(loss))
            return loss
    return Recording


def _reference(out: str) -> dict:
    from transformers import Trainer

    torch.manual_seed(0)
    trainer = _recording(Trainer)(model=_model(),
                                  args=_args(out, 4),
                                  train_dataset=_Samples(), eval_dataset=_Samples(100))
    trainer.train()
    return {"losses": trainer.recorded, "eval_loss": trainer.evaluate()["eval_loss"],
            "params": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
            "grad_norms": [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]}


def _train_job(rank, world, out, resume):
    import deepcompile
    from deepcompile.integrations.hf import DeepCompileTrainer

    torch._dynamo.reset()
    trainer = _recording(DeepCompileTrainer)(
        model=_model(), args=_args(out, 4 // world),
        train_dataset=_Samples(), eval_dataset=_Samples(100),
        deepcompile_config=deepcompile.Config(compiler="fx", zero_stage=3))
    trainer.train(resume_from_checkpoint=resume)
    result = {"losses": trainer.recorded, "global_step": trainer.state.global_step,
              "final": trainer.engine.full_state_dict(),
              "grad_norms": [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]}
    if resume is None:
        result["eval_loss"] = trainer.evaluate()["eval_loss"]
        trainer.save_model(os.path.join(out, "final"))
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = _reference(str(tmp / "ref"))
    finally:
        torch.set_num_threads(threads)
    ours = run_distributed(_train_job, WORLD, str(tmp / "ours"), None, timeout=900)
    return tmp, ref, ours


def _dev(a: dict, b: dict) -> float:
    assert set(a) >= set(b)
    return max((a[k] - b[k]).abs().max().item() for k in b)


def test_trainer_matches_the_plain_trainer_in_one_process(runs):
    _, ref, ours = runs
    assert len(ref["losses"]) == STEPS * GAS
    mean = [sum(v) / len(v) for v in zip(*(r["losses"] for r in ours))]
    loss_dev = max(abs(a - b) for a, b in zip(mean, ref["losses"]))
    param_dev = _dev(ours[0]["final"], ref["params"])
    print(f"\n[hf trainer] loss dev {loss_dev:.3g}, param dev {param_dev:.3g}, eval loss "
          f"{ours[0]['eval_loss']:.6f} vs {ref['eval_loss']:.6f}")
    assert len(mean) == STEPS * GAS and loss_dev <= 1e-5, (mean, ref["losses"])
    assert param_dev <= 1e-4
    assert all(r["global_step"] == STEPS for r in ours)
    assert all(torch.equal(r["final"][k], ours[0]["final"][k]) for r in ours for k in r["final"])
    assert abs(ours[0]["eval_loss"] - ref["eval_loss"]) <= 1e-5
    # the logged norm (before clipping; engine.grad_norm()) is the plain Trainer's, on every rank
    norms = ours[0]["grad_norms"]
    assert len(norms) == STEPS and all(r["grad_norms"] == norms for r in ours)
    assert max(abs(a - b) / b for a, b in zip(norms, ref["grad_norms"])) <= 1e-4, \
        (norms, ref["grad_norms"])
    assert min(ref["grad_norms"]) > 0.5   # max_grad_norm: the clip clipped


def test_trainer_checkpoints_resume_and_save_model(runs):
    from transformers import AutoModelForCausalLM

    tmp, _, ours = runs
    ckpt = tmp / "ours" / "checkpoint-2"
    for name in ("model.safetensors", "config.json", "scheduler.pt", "trainer_state.json",
                 "rng_state_0.pth", "rng_state_1.pth", "deepcompile"):
        assert (ckpt / name).exists(), name
    resumed = run_distributed(_train_job, WORLD, str(tmp / "ours"), str(ckpt), timeout=900)
    whole = [r["losses"] for r in ours]
    for r, w in zip(resumed, whole):
        assert r["global_step"] == STEPS
        assert len(r["losses"]) == (STEPS - 2) * GAS
        dev = max(abs(a - b) for a, b in zip(r["losses"], w[2 * GAS:]))
        print(f"\n[hf trainer resume] loss dev {dev:.3g}")
        assert dev <= 1e-6, (r["losses"], w[2 * GAS:])
        assert _dev(r["final"], ours[0]["final"]) <= 1e-6
    loaded = AutoModelForCausalLM.from_pretrained(tmp / "ours" / "final")
    assert _dev({n: p.detach() for n, p in loaded.named_parameters()}, ours[0]["final"]) == 0.0
