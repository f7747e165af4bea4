"""`deepcompile.verify` and `deepcompile verify FILE`: check a model of your own against eager.

The model trains with the engine on local ranks (gloo on the CPU, or NCCL on one GPU per rank),
then as one plain eager PyTorch process on the same global batches, and the two are compared
after every optimizer step: the loss, every parameter by name. Per step the report shows the
loss difference, the largest parameter difference and its parameter, the parameters autograd
gave no gradient, the graph breaks Dynamo took, the modules that ran eagerly (outside every
compiled graph) and the collectives of each micro-step and of the optimizer step.

[Note: what verify compares] The reference is what data-parallel training over the same ranks
computes, taken in one process (`workloads.train_reference`, [Note: the reference of data
parallelism]): every rank's slice of the global batch is
forwarded apart (a BatchNorm normalizes each slice by its own statistics, as on each rank) and
each slice's loss is divided by ranks x micro-steps before its backward; its optimizer is the
user's, stepping with the implementation the engine's flat step uses (`FlatState.implementation`:
torch's fused kernel where the user left it open, which eager PyTorch on the CPU does not take).
What then remains are roundings: compiled kernels against eager ones, a sum of the ranks'
gradients against autograd's accumulation, a clipping norm summed shard by shard. So the
default tolerance is tight (`RTOL`, relative, fp32): a step mismatches when its loss differs by
more than RTOL x |eager loss|, or some parameter by more than RTOL x the largest magnitude of
that parameter's eager values. Verify runs in fp32 (Config's param_dtype, reduce_dtype and
loss_scale are left out: what it checks -- sharding, compilation, the passes -- is the same at
every dtype, and 16-bit rounding would hide it). docs/guide/verify.md is the user's guide.

Both launchers run the same rank code, `run_jobs(rank, world, jobs, out_dir, device)`, inside
an initialized process group: `verify()` spawns ranks with `spawn.launch`; the test suite forks
them (tests/_dist.py) and runs several models in one launch. Rank 0 writes what the comparison
needs under `out_dir/<job index>`; `compare(job, folder, ranks, device)` reads it in the
parent.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import shutil
import sys
import tempfile
import traceback
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..config import Config
from . import spawn
from .workloads import call, split_batch, to_device, train_reference

RTOL = 1e-5              # the default tolerance, relative (see [Note: what verify compares])
DEFAULT_STEPS = 4         # the default config reaches its steady phase in the 4th step
COMM_KINDS = (("all_gather", "AG"), ("reduce_scatter", "RS"), ("all_reduce", "AR"))


class VerifyError(ValueError):
    """What verify was given cannot be run (a missing function, a batch the ranks cannot share)."""


# ----------------------------------------------------------------------------------------------
# what to run

def default_loss(output: Any, batch: Any = None) -> torch.Tensor:
    """The loss of a model's output: the output itself when it is a scalar tensor, else its
    `.loss` (Hugging Face models given labels) or its "loss" entry."""
    if isinstance(output, torch.Tensor) and output.dim() == 0:
        return output
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise VerifyError(
            f"the model returned {type(output).__name__}, not a scalar loss nor an output with "
            "a .loss (a Hugging Face model needs labels in the batch): give loss_fn(output, "
            "batch) that returns the scalar loss")
    return loss


def default_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


@dataclasses.dataclass(frozen=True)
class Job:
    """One model to verify; pickled to every rank. Either the callables themselves (importable
    by name: module-level functions or functools.partial of them) or `path`, a Python file that
    defines them (build_model, make_batch, optionally loss_fn and optimizer), loaded in every
    process."""
    name: str
    config: Config
    steps: int = DEFAULT_STEPS
    seed: int = 0
    build_model: Callable[[], nn.Module] | None = None
    make_batch: Callable[[int], Any] | None = None
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    optimizer: Callable | None = None
    path: str | None = None

    def parts(self) -> tuple[Callable, Callable, Callable, Callable]:
        """(build_model, make_batch, loss_fn, optimizer), from `path` where given."""
        if self.path is None:
            return (self.build_model, self.make_batch, self.loss_fn or default_loss,
                    self.optimizer or default_optimizer)
        m = load_file(self.path)
        return (m.build_model, m.make_batch, getattr(m, "loss_fn", None) or default_loss,
                getattr(m, "optimizer", None) or default_optimizer)


def load_file(path: str):
    """The module a verify file defines (its directory importable, as when run as a script)."""
    path = os.path.abspath(path)
    name = "_deepcompile_verify_" + "".join(c if c.isalnum() else "_" for c in path)
    if name in sys.modules:
        return sys.modules[name]
    if not os.path.isfile(path):
        raise VerifyError(f"no such file: {path}")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    folder = os.path.dirname(path)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    missing = [n for n in ("build_model", "make_batch") if not callable(getattr(module, n, None))]
    if missing:
        raise VerifyError(f"{path} defines no {' and no '.join(missing)}: a verify file "
                          "defines build_model() (a fresh model) and make_batch(step) (the "
                          "global batch of a micro-step); loss_fn(output, batch), "
                          "optimizer(params) and CONFIG are optional")
    return module


def verify_config(config: Config | dict | None, device: str, notes: list[str]) -> Config:
    """The config the engine runs under: the user's (or one quick to verify: fx on the CPU,
    one warm-up step, the passes kept without timing them), in fp32."""
    if config is None:
        return Config(compiler="fx" if device == "cpu" else "inductor", warmup_steps=1,
                      measure_steps=0)
    config = Config.coerce(config)
    fp32 = {"param_dtype": None, "reduce_dtype": None, "loss_scale": None}
    dropped = {k: getattr(config, k) for k in fp32 if getattr(config, k) is not None}
    if dropped:
        notes.append("verify runs in fp32: left out " + ", ".join(
            f"Config.{k}={str(v).removeprefix('torch.')}" for k, v in dropped.items()))
        config = dataclasses.replace(config, **fp32)
    return config


def _seeded_batch(make_batch: Callable, seed: int, micro: int) -> Any:
    """make_batch(micro) with torch's RNG seeded from (seed, micro): random data is the same in
    every process."""
    torch.manual_seed(seed * 1_000_003 + micro + 1)
    return make_batch(micro)


def _build(build_model: Callable, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = build_model()
    if not isinstance(model, nn.Module):
        raise VerifyError(f"build_model() returned {type(model).__name__}, not an nn.Module")
    return model


def _dropout(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if m.training and isinstance(
        m, nn.modules.dropout._DropoutNd) and m.p > 0]


# ----------------------------------------------------------------------------------------------
# the ranks

def run_jobs(rank: int, world: int, jobs: Sequence[Job], out_dir: str, device: str) -> None:
    """Train every job with the engine on this rank (inside a process group); rank 0 writes
    `<out_dir>/<job index>/`: summary.pt and step<i>.pt (engine.full_state_dict() after step i);
    a rank that fails writes error<rank>.txt and goes on with the next job."""
    import torch.distributed as dist

    for j, job in enumerate(jobs):
        folder = os.path.join(out_dir, str(j))
        if rank == 0:
            os.makedirs(folder, exist_ok=True)
        dist.barrier()
        try:
            _run_job(rank, world, job, folder, device)
        except Exception:  # noqa: BLE001 -- reported by compare(); the next job goes on
            with open(os.path.join(folder, f"error{rank}.txt"), "w") as f:
                f.write(traceback.format_exc())
        torch._dynamo.reset()
        dist.monitored_barrier(timeout=timedelta(seconds=600))


def _comm_counts(engine) -> dict[str, int]:
    stats = engine.comm_stats()
    return {k: int(stats.get(k, {}).get("count", 0)) for k, _ in COMM_KINDS}


def _minus(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: a[k] - b.get(k, 0) for k in a}


def _run_job(rank: int, world: int, job: Job, folder: str, device: str) -> None:
    import deepcompile

    from .. import _compat
    from ..runtime.eager import EagerCalls

    build_model, make_batch, loss_fn, optimizer = job.parts()
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else \
        torch.device("cpu")
    model = _build(build_model, job.seed).to(dev)
    eager_calls = EagerCalls(model)   # before initialize: Dynamo traces its hooks as no-ops
    engine = deepcompile.initialize(model, optimizer=optimizer, config=job.config)
    gas = job.config.gradient_accumulation_steps
    rows = []
    breaks = _compat.graph_breaks()
    for step in range(job.steps):
        phase = engine.phase   # the phase this step runs in
        micro_comm, losses = [], []
        for m in range(gas):
            batch = _seeded_batch(make_batch, job.seed, step * gas + m)
            part = to_device(split_batch(batch, world)[rank], dev)
            c0 = _comm_counts(engine)
            loss = loss_fn(call(engine, part), part)
            engine.backward(loss)
            micro_comm.append(_minus(_comm_counts(engine), c0))
            losses.append(loss.detach().float())
        c0 = _comm_counts(engine)
        engine.step()
        step_comm = _minus(_comm_counts(engine), c0)
        # every rank's losses, averaged in Python in rank order: as the reference averages
        # its slices' losses
        mine = torch.stack(losses)
        every = mine.new_empty(world * gas)
        _compat.all_gather_flat(every, mine, None)
        every = every.view(world, gas).cpu().tolist()
        now = _compat.graph_breaks()
        rows.append({"losses": [sum(r[m] for r in every) / world for m in range(gas)],
                     "micro_comm": micro_comm,
                     "step_comm": step_comm, "phase": phase,
                     "graph_breaks": {k: v - breaks.get(k, 0) for k, v in now.items()
                                      if v > breaks.get(k, 0)},
                     "eager_modules": eager_calls.take()})
        breaks = now
        state = engine.full_state_dict()
        if rank == 0:
            torch.save(state, os.path.join(folder, f"step{step}.pt"))
    if rank == 0:
        torch.save({"rows": rows, "implementation": engine._flat.implementation(),
                    "dropout": _dropout(model),
                    "report": str(engine.report())}, os.path.join(folder, "summary.pt"))
    del engine


def _spawned_rank(local_rank: int, world: int, jobs: Sequence[Job], out_dir: str,
                  device: str) -> None:
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    else:
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
    try:
        run_jobs(local_rank, world, jobs, out_dir, device)
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# the comparison

@dataclasses.dataclass
class StepResult:
    step: int                         # 1-based
    phase: str                        # the engine's phase during the step
    loss: float                       # the engine's (mean over ranks and micro-steps)
    eager_loss: float
    loss_diff: float                  # |loss - eager_loss|
    param_diff: float                 # the largest |Δ| of a parameter's elements ...
    param_rel: float                  # ... relative to that parameter's largest |eager value|
    worst_param: str                  # the parameter with the largest relative difference
    no_grad: list[str]                # trainable parameters eager autograd gave no gradient
    graph_breaks: dict[str, int]      # new graph breaks in this step, by reason
    eager_modules: dict[str, int]     # modules that ran eagerly in this step: calls (rank 0)
    micro_comm: list[dict[str, int]]  # collectives per micro-step (forward and backward)
    step_comm: dict[str, int]         # collectives of the optimizer step
    ok: bool


@dataclasses.dataclass
class VerifyResult:
    """What `deepcompile.verify` found; `ok` is False on a mismatch beyond the tolerance or an
    error. str() is the report; `engine_report` is rank 0's `str(engine.report())` at the end
    (what the compiler did: graphs, passes and why)."""
    name: str
    ranks: int
    device: str
    config: Config
    rtol: float
    steps: list[StepResult] = dataclasses.field(default_factory=list)
    missing: list[str] = dataclasses.field(default_factory=list)   # not in full_state_dict
    notes: list[str] = dataclasses.field(default_factory=list)
    implementation: dict = dataclasses.field(default_factory=dict)
    error: str | None = None
    engine_report: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None and not self.missing and bool(self.steps) and \
            all(s.ok for s in self.steps)

    def __str__(self) -> str:
        return format_result(self)


def compare(job: Job, folder: str, ranks: int, device: str, rtol: float = RTOL,
            notes: Sequence[str] = ()) -> VerifyResult:
    """Train `job`'s reference in this process and compare it with what the ranks wrote in
    `folder` (`<out_dir>/<the job's index>` of `run_jobs`)."""
    res = VerifyResult(job.name, ranks, device, job.config, rtol, notes=list(notes))
    errors = sorted(f for f in os.listdir(folder) if f.startswith("error")) \
        if os.path.isdir(folder) else []
    if errors:   # every failing rank's traceback (the first failure may be any rank's)
        texts = []
        for name in errors:
            with open(os.path.join(folder, name)) as f:
                texts.append(f"rank {name[5:-4]}: {f.read().strip()}")
        res.error = "\n".join(texts)
        return res
    summary_path = os.path.join(folder, "summary.pt")
    if not os.path.exists(summary_path):
        res.error = "the ranks wrote no results (see their output above)"
        return res
    summary = torch.load(summary_path, weights_only=False)
    rows = summary["rows"]
    res.implementation = summary["implementation"]
    res.engine_report = summary["report"]
    if summary["dropout"]:
        res.notes.append(f"dropout is active ({', '.join(summary['dropout'][:3])}"
                         f"{', ...' if len(summary['dropout']) > 3 else ''}): its random masks "
                         "differ between the runs; build the model with dropout 0 to verify it")

    build_model, make_batch, loss_fn, optimizer = job.parts()
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    model = _build(build_model, job.seed).to(dev)
    opt = optimizer([p for p in model.parameters() if p.requires_grad])
    if res.implementation:   # the flat step's implementation ([Note: what verify compares])
        from ..runtime.flat import same_optimizer

        opt = same_optimizer(opt, opt.param_groups, **res.implementation)
    gas = job.config.gradient_accumulation_steps
    params: list[tuple[float, float, str]] = []

    def after_step(step: int, ref: nn.Module) -> None:
        state = torch.load(os.path.join(folder, f"step{step}.pt"), weights_only=True)
        worst = (0.0, 0.0, "")
        for name, p in ref.named_parameters(remove_duplicate=False):
            got = state.get(name)
            if got is None or got.shape != p.shape:
                if name not in res.missing:
                    res.missing.append(name)
                continue
            want = p.detach().float().cpu()
            diff = (got.float() - want).abs().max().item()
            scale = want.abs().max().item()
            rel = diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)
            if not math.isfinite(diff):
                rel = math.inf
            if rel > worst[1] or not worst[2]:
                worst = (diff, rel, name)
        params.append(worst)

    eager = train_reference(model, opt, lambda m: _seeded_batch(make_batch, job.seed, m),
                            steps=len(rows), gas=gas, loss_of=loss_fn, slices=ranks,
                            max_grad_norm=job.config.max_grad_norm, after_step=after_step)
    losses = eager.losses
    for i, (row, eager_loss, no_grad, (pdiff, prel, pname)) in enumerate(
            zip(rows, losses, eager.no_grad, params)):
        loss = sum(row["losses"]) / len(row["losses"])
        ldiff = abs(loss - eager_loss)
        loss_rel = ldiff / abs(eager_loss) if eager_loss else (0.0 if ldiff == 0 else math.inf)
        ok = math.isfinite(loss) and loss_rel <= rtol and prel <= rtol
        res.steps.append(StepResult(
            step=i + 1, phase=row["phase"], loss=loss, eager_loss=eager_loss, loss_diff=ldiff,
            param_diff=pdiff, param_rel=prel, worst_param=pname, no_grad=no_grad,
            graph_breaks=row["graph_breaks"], eager_modules=row["eager_modules"],
            micro_comm=row["micro_comm"], step_comm=row["step_comm"], ok=ok))
    return res


# ----------------------------------------------------------------------------------------------
# the report

def _comm(c: dict[str, int]) -> str:
    return " ".join(f"{short} {c.get(k, 0)}" for k, short in COMM_KINDS)


def _names(names: Sequence[str], limit: int = 3) -> str:
    if not names:
        return "-"
    return ", ".join(names[:limit]) + (f" (+{len(names) - limit})" if len(names) > limit else "")


def format_result(res: VerifyResult) -> str:
    cfg = res.config
    impl = res.implementation
    impl = "" if not impl else "fused" if impl.get("fused") else "foreach" \
        if impl.get("foreach") else "single-tensor"
    lines = [f"deepcompile verify: {res.name} on {res.ranks} {res.device} rank(s), ZeRO-"
             f"{cfg.zero_stage}, compiler={cfg.compiler}, passes="
             f"{cfg.passes if cfg.auto_passes else ','.join(cfg.passes) or 'none'}, "
             f"{cfg.gradient_accumulation_steps} micro-step(s) per step"
             + (f", clipping at {cfg.max_grad_norm:g}" if cfg.max_grad_norm else "")
             + (f"; the optimizer steps {impl} (the eager run's too)" if impl else "")]
    lines += [f"note: {n}" for n in res.notes]
    if res.error is not None:
        lines.append(f"ERROR: the run on the ranks failed:\n{res.error}")
        return "\n".join(lines)
    rows = []
    for s in res.steps:   # one micro-step's collectives, or each's where they differ
        micro = {_comm(c) for c in s.micro_comm}
        text = micro.pop() if len(micro) == 1 else " / ".join(_comm(c) for c in s.micro_comm)
        rows.append((s, f"{text} | {_comm(s.step_comm)}"))
    width = max([len("collectives per micro-step | step")] + [len(t) for _, t in rows])
    lines.append(f"{'step':>4} {'phase':<8} {'loss':>11} {'|Δloss|':>9} {'max |Δparam|':>12} "
                 f"{'(relative)':>10} {'no grad':>7} {'breaks':>6} {'eager':>5}  "
                 f"{'collectives per micro-step | step':<{width}}  parameter")
    for s, text in rows:
        lines.append(
            f"{s.step:>4} {s.phase:<8} {s.loss:>11.6g} {s.loss_diff:>9.2e} {s.param_diff:>12.2e} "
            f"{s.param_rel:>10.2e} {len(s.no_grad):>7} {sum(s.graph_breaks.values()):>6} "
            f"{len(s.eager_modules):>5}  {text:<{width}}  {s.worst_param}"
            + ("  MISMATCH" if not s.ok else ""))
    no_grad = sorted({n for s in res.steps for n in s.no_grad})
    always = [n for n in no_grad if all(n in s.no_grad for s in res.steps)]
    some = [n for n in no_grad if n not in always]
    if no_grad:
        lines.append("parameters without a gradient (eager autograd): " + "; ".join(
            ([f"never: {_names(always, 8)}"] if always else [])
            + ([f"in some steps: {_names(some, 8)}"] if some else [])))
    breaks: dict[str, int] = {}
    for s in res.steps:
        for k, v in s.graph_breaks.items():
            breaks[k] = breaks.get(k, 0) + v
    for reason, n in sorted(breaks.items(), key=lambda kv: -kv[1]):
        text = [t.strip() for t in reason.splitlines() if t.strip()]
        why = next((t.removeprefix("Explanation:").strip() for t in text[1:]
                    if t.startswith("Explanation:")), "")
        lines.append(f"graph break x{n}: {text[0] if text else reason}"
                     + (f" ({why})" if why else ""))
    eager = sorted({n for s in res.steps for n in s.eager_modules})
    if eager:
        lines.append(f"modules that ran eagerly (outside every compiled graph): {_names(eager, 8)}")
    if res.missing:
        lines.append(f"MISMATCH: engine.full_state_dict() lacks {_names(res.missing, 8)}")
    if res.steps and res.steps[-1].phase != "steady":
        lines.append(f"note: the engine was in its {res.steps[-1].phase} phase at the last "
                     f"step: what it plans later is not verified (more steps, or lower "
                     "Config.warmup_steps / measure_steps)")
    bad = [s for s in res.steps if not s.ok]
    if res.ok:
        lines.append(f"OK: every step within the tolerance (relative {res.rtol:g} of the eager "
                     "loss, and of each parameter's largest eager value)")
    elif bad:
        s = bad[0]
        lines.append(f"MISMATCH from step {s.step}: |Δloss| {s.loss_diff:.3g} "
                     f"(relative {s.loss_diff / abs(s.eager_loss) if s.eager_loss else math.inf:.3g}), "
                     f"parameter {s.worst_param} off by {s.param_diff:.3g} (relative "
                     f"{s.param_rel:.3g}); tolerance: relative {res.rtol:g}")
    elif not res.steps:
        lines.append("MISMATCH: no step to compare")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# the entry points

def resolve_device(device: str, ranks: int, steps: int, rtol: float) -> str:
    """"cpu" or "cuda" for `device` ("auto": CUDA with one GPU per rank if there are enough);
    the other arguments checked."""
    if steps < 1 or ranks < 1 or not rtol >= 0:
        raise VerifyError(f"steps ({steps}) and ranks ({ranks}) must be >= 1 and rtol ({rtol}) "
                          ">= 0")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= ranks \
            else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise VerifyError("device='cuda' but CUDA is not available")
        if torch.cuda.device_count() < ranks:
            raise VerifyError(f"{ranks} ranks on {torch.cuda.device_count()} CUDA device(s): "
                              "one GPU per rank")
    elif device != "cpu":
        raise VerifyError(f"device {device!r}: allowed 'auto', 'cpu', 'cuda'")
    return device


def run(jobs: Sequence[Job], ranks: int, device: str, rtol: float = RTOL,
        timeout_s: float = 30 * 60, notes: Sequence[str] = ()) -> list[VerifyResult]:
    """Spawn the ranks once for every job, then compare each job in this process."""
    import pickle

    try:
        pickle.dumps(list(jobs))
    except Exception as e:  # noqa: BLE001 -- lambdas, notebook functions, closures
        raise VerifyError(
            f"verify sends build_model, make_batch, loss_fn and optimizer to spawned ranks, "
            f"which import them by name: {e}. Define them at module level in a file (in a "
            "script, call verify under `if __name__ == \"__main__\":`), or write them to a file "
            "and run `deepcompile verify FILE`") from None
    out_dir = tempfile.mkdtemp(prefix="deepcompile-verify-")
    try:
        failed = None
        try:
            spawn.launch(_spawned_rank, ranks, list(jobs), out_dir, device, timeout_s=timeout_s,
                         cpu=device == "cpu")
        except spawn.LaunchError as e:
            failed = str(e)
        results = []
        for j, job in enumerate(jobs):
            res = compare(job, os.path.join(out_dir, str(j)), ranks, device, rtol, notes)
            if failed is not None and res.error is None and not res.steps:
                res.error = failed
            results.append(res)
        return results
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def verify(build_model: Callable[[], nn.Module], make_batch: Callable[[int], Any],
           config: Config | dict | None = None, *, loss_fn: Callable | None = None,
           optimizer: Callable | None = None, steps: int = DEFAULT_STEPS, ranks: int = 2,
           rtol: float = RTOL, device: str = "auto", seed: int = 0,
           quiet: bool = False) -> VerifyResult:
    """Train your model with deepcompile on `ranks` local processes and with plain eager
    PyTorch in one, on the same data, and compare them after every optimizer step.

    build_model(): a fresh model (called with torch seeded by `seed`, so every process builds
        the same weights), in fp32 on the CPU (verify moves it to each rank's GPU on CUDA).
    make_batch(step): the global batch of micro-step `step` (0, 1, ...), called with torch's
        RNG seeded from (seed, step): a tensor, or a dict / list / tuple of them (the model is
        called with `**batch`, `*batch` or `batch`); every tensor is cut along dim 0 into one
        equal slice per rank.
    config: a `deepcompile.Config` (or dict) to verify; None: ZeRO-3, fx on the CPU (Inductor
        on GPUs), one warm-up step, passes "auto" kept without timing them. Run in fp32.
    loss_fn(output, batch): the scalar loss; default: the output itself if it is one, else
        `output.loss` (Hugging Face models given labels).
    optimizer(params): default `torch.optim.AdamW(params, lr=1e-3)`.
    steps: optimizer steps; ranks: local processes (gloo on the CPU, or NCCL with one GPU each
        when `device` is "cuda", or "auto" and there are enough GPUs).
    rtol: the tolerance, relative to the eager loss and to each parameter's largest eager value.

    The callables are sent to spawned processes by name: define them at module level (and call
    verify under `if __name__ == "__main__":`). Returns a `VerifyResult` (`.ok`; str() is the
    report, printed unless `quiet`). `deepcompile verify FILE` runs the same from a file.
    """
    device = resolve_device(device, ranks, steps, rtol)
    notes: list[str] = []
    cfg = verify_config(config, device, notes)
    name = getattr(build_model, "__qualname__", None) or getattr(
        getattr(build_model, "func", None), "__qualname__", "model")
    job = Job(name=name, config=cfg, steps=steps, seed=seed, build_model=build_model,
              make_batch=make_batch, loss_fn=loss_fn, optimizer=optimizer)
    res = run([job], ranks, device, rtol, notes=notes)[0]
    if not quiet:
        print(res, flush=True)
    return res


def verify_file(path: str, *, steps: int = DEFAULT_STEPS, ranks: int = 2, rtol: float = RTOL,
                device: str = "auto", seed: int = 0,
                overrides: dict[str, Any] | None = None) -> VerifyResult:
    """`deepcompile verify FILE`: the file's build_model, make_batch and optional loss_fn,
    optimizer and CONFIG, with the Config keys in `overrides` replacing the file's."""
    module = load_file(path)
    device = resolve_device(device, ranks, steps, rtol)
    notes: list[str] = []
    cfg = verify_config(getattr(module, "CONFIG", None), device, notes)
    if overrides:
        cfg = dataclasses.replace(cfg, **overrides)
    job = Job(name=os.path.basename(path), config=cfg, steps=steps, seed=seed,
              path=os.path.abspath(path))
    return run([job], ranks, device, rtol, notes=notes)[0]
