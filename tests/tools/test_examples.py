"""The examples in examples/ run in their smallest setting: 2 CPU ranks launched by torchrun.
train_llama.py: an uninterrupted run of 30 steps, and one stopped after 3 of its steps and
resumed from its checkpoint for 3 more, log the same losses, and no gloo thread of the run is
alive when a rank's interpreter finalizes; the uninterrupted run also logs its metrics to
TensorBoard and draws its pictures. In the default run ([Note: the core matrix] in
tests/_train.py) train_llama.py runs once, stopped after its first 3 steps (`FIRST`).
hf_trainer.py trains, checkpoints and saves a model (in the full suite)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from deepcompile.tools.spawn import free_port

from _train import FULL

ROOT = Path(__file__).resolve().parents[2]


def _torchrun(script: str, *args: str, timeout: float = 600, exit_probe: Path | None = None) -> str:
    """`exit_probe`: each rank writes the gloo threads alive as it finalizes to
    `<exit_probe>.<rank>` (tests/tools/_exit_probe.py)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"),
               TORCHINDUCTOR_CACHE_DIR=str(ROOT / "build" / "inductor-cache"),
               TORCHINDUCTOR_COMPILE_THREADS="1")
    probe = []
    if exit_probe is not None:
        env["EXIT_PROBE"] = str(exit_probe)
        probe = [str(Path(__file__).with_name("_exit_probe.py"))]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           *probe, str(ROOT / "examples" / script), *args]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    return r.stdout


def _losses(out: str) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(2))
            for m in re.finditer(r"^step (\d+)/\d+ loss ([\d.]+) ", out, re.M)}


STEPS = 30   # the LR schedule's length, the same in every run
COMMON = ["--model", "tiny", "--compiler", "fx", "--steps", str(STEPS), "--grad-accum", "2",
          "--seq-len", "32", "--warmup", "2"]
# The default run launches train_llama.py once and stops it after the schedule's first FIRST
# steps: the README's quick start under torchrun, a checkpoint, the model written, the gloo
# threads at finalization. The full suite runs all STEPS with the metrics and pictures, then
# stops and resumes another run; a resumed run's losses are the unbroken run's in the default
# run in tests/distributed/test_resume.py.
FIRST = 3


def _installed(*modules: str) -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in modules)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[Path, str]:
    """train_llama.py run for STEPS steps without a stop: a checkpoint at the end, the final
    model written with --save-pretrained, the gloo threads alive as each rank finalizes
    probed; with tensorboard and matplotlib installed, also --tensorboard and --plot-dir (the
    metrics every step, one steady step traced, the report and its pictures). In the default
    run, stopped after FIRST steps, saved then. The directory and rank 0's output."""
    tmp = tmp_path_factory.mktemp("train_llama")
    if not FULL:   # the schedule's first FIRST steps, saved (`FIRST`)
        extra = ["--save-every", str(FIRST), "--stop-after", str(FIRST)]
    elif _installed("tensorboard", "matplotlib"):
        extra = ["--tensorboard", str(tmp / "tb"), "--plot-dir", str(tmp / "plots")]
    else:
        extra = []
    out = _torchrun("train_llama.py", *COMMON, "--ckpt-dir", str(tmp / "a"),
                    "--save-pretrained", str(tmp / "hf"), *extra, exit_probe=tmp / "gloo")
    return tmp, out


def test_train_llama_runs_and_resumes(uninterrupted, tmp_path):
    tmp, whole = uninterrupted
    ran = STEPS if FULL else FIRST
    assert re.search(r"tokens/s [\d,]+ peak memory [\d.]+ GiB RSS", whole), whole
    assert f"done at step {ran}" in whole and (tmp / "hf" / "model.safetensors").exists()
    if sys.platform == "linux":   # no process group outlives the script into finalization:
        # the engine's are freed at exit ([Note: engines freed before finalization]), the
        # default one by destroy_process_group ([Note: the default group kept by an import])
        assert [(tmp / f"gloo.{r}").read_text() for r in (0, 1)] == ["0", "0"]
    assert sorted(_losses(whole)) == list(range(1, ran + 1))
    if not FULL:   # the stopped and resumed runs are the full suite's (`FIRST`)
        assert (tmp / "a" / "deepcompile-checkpoint.json").exists()
        return
    first = _torchrun("train_llama.py", *COMMON, "--ckpt-dir", str(tmp_path / "b"),
                      "--save-every", "3", "--stop-after", "3")
    assert "done at step 3" in first
    resumed = _torchrun("train_llama.py", *COMMON, "--ckpt-dir", str(tmp_path / "b"),
                        "--resume", "--stop-after", "3")
    assert "resumed from" in resumed and "at step 3" in resumed and "done at step 6" in resumed
    a, b, c = _losses(whole), _losses(first), _losses(resumed)
    print(f"\n[examples] uninterrupted {a}\n[examples] stopped {b} resumed {c}")
    assert sorted(a) == list(range(1, STEPS + 1))
    assert sorted(b) == [1, 2, 3] and sorted(c) == [4, 5, 6]
    for step in (1, 2, 3):
        assert b[step] == a[step]
    for step in (4, 5, 6):
        assert abs(c[step] - a[step]) <= 1e-6, (step, c[step], a[step])
    assert a[6] < a[1]


# the full suite's: in the default run tests/distributed/test_hf_trainer.py trains with
# DeepCompileTrainer on 2 ranks (the Trainer's loop, its checkpoints resumed, save_model), and
# train_llama.py above runs an example under torchrun
@pytest.mark.extended
def test_hf_trainer_example(tmp_path):
    pytest.importorskip("accelerate")
    out = _torchrun("hf_trainer.py", "--max-steps", "2", "--save-steps", "1", "--compiler", "fx",
                    "--seq-len", "32", "--output-dir", str(tmp_path))
    assert "done at step 2" in out
    assert (tmp_path / "final" / "model.safetensors").exists()
    assert (tmp_path / "checkpoint-2" / "deepcompile" / "deepcompile-checkpoint.json").exists()


# the full suite's (`FIRST`): engine.metrics() every step and engine.plot() in the default
# run: tests/distributed/test_autoplan.py and test_grad_norm.py
@pytest.mark.extended
def test_train_llama_logs_metrics_and_draws(uninterrupted):
    """--tensorboard: engine.metrics() every step as TensorBoard scalars; --plot-dir: one
    steady step traced, the report and its pictures written."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("matplotlib")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tmp, out = uninterrupted
    assert f"done at step {STEPS}" in out and "passes chosen (auto)" in out
    # where deepcompile's setup is, and when it is done (docs/guide/setup.md)
    assert "setup: step 1: warmup" in out and "setup: step 3: profile" in out, out
    assert re.search(r"^setup done \(\d+ steps\): steady state from step \d+$", out, re.M), out
    acc = EventAccumulator(str(tmp / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for key in ("step_s", "tokens_per_s", "flops_per_s", "exposed_comm_s", "peak_memory_bytes",
                "collectives_per_step", "grad_norm"):
        assert f"deepcompile/{key}" in tags, tags
    assert len(acc.Scalars("deepcompile/step_s")) == STEPS
    assert "deepcompile/exposed_comm_s_measured" in tags   # the traced steady step
    for name in ("memory.png", "timeline.png", "passes.png", "steps.png", "report.json",
                 "trace.json"):
        assert (tmp / "plots" / name).stat().st_size > 0, name
