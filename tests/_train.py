"""The one training loop of the test suite, distributed (`run_training`) and reference
(`reference_training`, on the tools' eager loop), plus the comparison helpers the test files
share.

A *scenario* is a plain dict (picklable, hashable through `scenario_key`):

    {"id": "mlp-sgd-gas4-clip",            # name used in test ids and reports
     "model": "mlp",                        # a name from _models.MODEL_NAMES
     "optim": ("sgd", {"lr": 0.1}),         # optimizer class name and kwargs
     "config": {"compiler": "fx", "gradient_accumulation_steps": 4, "max_grad_norm": 0.1},
     "steps": 8,                            # optimizer steps
     "record": ("comm", "memory"),          # optional extra measurements: "comm",
                                            # "memory", "initial_state", "step_every_micro",
                                            # "report" (engine.report().to_dict() at the end),
                                            # "replicas", "unshard", "structures" (the graph
                                            # slots, the pass log, deepcompile's warnings),
                                            # "optim_state", "comm_groups" (per optimizer
                                            # step, comm_stats(by_group=True))
     "profile_seed": 3,                     # optional: profiled times randomized
                                            # (`random_times`)
     "recompile_limit": 2,                  # optional: Dynamo's, for the run
     "env": {"LOCAL_WORLD_SIZE": "2"}}      # optional: environment while the engine is made
                                            # (simulated nodes: runtime/mesh.py)

`run_training(rank, world, scenarios)` runs every scenario in sequence on one rank (one spawned
job, several scenarios: the processes and the process group are set up once) and returns one
result dict per scenario.  `torch._dynamo.reset()` separates scenarios.

[Note: the core matrix] The suite runs in two sizes. The default (CI's, the README's test
command) is the core, sized to finish in under 15 minutes on 2 CPU cores: it runs each
mechanism end to end once, on the cheapest model that exercises it (the MLP, the tanh stack,
graph_break, TinyLM and the other small odd models before the tiny Llama, a tiny Llama of one
decoder layer before two, the tiny Llama before Mixtral), at the fewest ranks it needs (1 where
what it checks is each rank's own work, 2 for the collectives, 4 where a layout needs them),
with fx, and with Inductor once per mechanism that Inductor compiles differently: the
reordered collectives (prefetch), the custom ops (activations, offloading at world size 1), the
in-place writes (selective_unshard, offloaded gradients), the asynchronous refresh
(overlap_refresh), and one plain ZeRO-3 parity job, each on the cheapest model that runs it.
The Hugging Face families train against eager in the core too (the tied tiny Llama and
Mixtral's eager experts in test_models, ResNet with BatchNorm in test_verify, the Trainer and
checkpoint tests). Of a job, the core runs its scenarios on 2 ranks or fewer with fx, the first
one on more ranks, and of an Inductor job only the scenarios made with `core=True`. A scenario
made with `extended=True`, and a test marked `extended`, run in the full suite only: the same
mechanism on a larger model, more ranks or the slower compiler, a second seed of random times,
accumulation 4 beside 1, ZeRO-2 beside ZeRO-1, a pass alone beside all of them, a run without a
pass beside one with it, a variant the engine layer runs at world size 1. Where what still
covers a left-out case is not obvious, the case says which test does. The suite is CPU-bound,
nearly all of it torch's compile of one engine per scenario and rank (a tiny-Llama engine ~10 s
of a core, the MLP's ~1 s): a case costs what it compiles. `DEEPCOMPILE_FULL_TESTS=1` runs
everything. A test left out is skipped, saying so.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import time
from pathlib import Path

import torch

import _models

DEFAULT_STEPS = 8
FULL = os.environ.get("DEEPCOMPILE_FULL_TESTS") == "1"   # [Note: the core matrix]

OPTIMIZERS = {
    "sgd": torch.optim.SGD,
    "adamw": torch.optim.AdamW,
}

COMM_KINDS = ("all_gather", "reduce_scatter", "all_reduce")

# zero stage -> the passes `Config(passes=None)` meant before "auto" was the default
LEGACY_PASSES = {1: ("bucket_reduce",), 2: ("bucket_reduce",), 3: ()}


# ------------------------------------------------------------------------------- scenarios
def scenario(id: str, model: str, optim: str, lr: float, *, gas: int = 1,
             clip: float | None = None, compiler: str = "fx", steps: int = DEFAULT_STEPS,
             record: tuple[str, ...] = (), chunk_bytes: int | None = None,
             profile_seed: int | None = None, extended: bool = False, core: bool = False,
             env: dict | None = None, **config) -> dict:
    """Build a scenario dict (see module docstring). `chunk_bytes`: the flat layout's chunk
    size (runtime/flat.py; tiny models fit one chunk of the default size, and offloading
    moves whole chunks). `extended`: only in the full matrix; `core`: always ([Note: the core
    matrix])."""
    kwargs = {"lr": lr}
    if optim == "sgd":
        kwargs["momentum"] = 0.9
    cfg = {"compiler": compiler, "gradient_accumulation_steps": gas, "max_grad_norm": clip}
    cfg.update(config)
    out = {"id": id, "model": model, "optim": (optim, kwargs), "config": cfg,
           "steps": steps, "record": tuple(record)}
    if chunk_bytes is not None:
        out["chunk_bytes"] = chunk_bytes
    if profile_seed is not None:
        out["profile_seed"] = profile_seed
    if extended:
        out["extended"] = True
    if core:
        out["core"] = True
    if env:
        out["env"] = dict(env)
    return out


def tanh_stack() -> torch.nn.Module:
    """The offload tests' small model: 8 Linear layers (16 chunks of 256 bytes of masters with
    `chunk_bytes(256)`), seeded."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 16), torch.nn.Tanh()]
    for _ in range(6):
        layers += [torch.nn.Linear(16, 16), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(16, 4))


@contextlib.contextmanager
def environment(env: dict | None):
    """`env` set in os.environ inside (what the engine reads when it is made)."""
    import os

    old = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def chunk_bytes(n: int | None):
    """The flat layout's chunk size for engines built inside (runtime/flat.py)."""
    from deepcompile.runtime import flat

    old = flat.CHUNK_BYTES
    if n is not None:
        flat.CHUNK_BYTES = n
    try:
        yield
    finally:
        flat.CHUNK_BYTES = old


def random_times(seed: int, prof) -> None:
    """A profile hook (`SlotRunner.perturb`): every node's measured time scaled by a factor in
    [1/30, 30], drawn from (seed, graph, node), the same on every rank. Where the passes place
    their ops depends on the times; a CPU's are one draw of many (a GPU's, a loaded machine's
    are others): seeds make the placements a suite does not meet by chance."""
    import random

    for n in prof.nodes:
        n.time_s *= 30.0 ** random.Random(f"{seed}/{prof.slot}/{n.name}").uniform(-1.0, 1.0)


def make_optimizer(spec):
    name, kwargs = spec
    return functools.partial(OPTIMIZERS[name], **kwargs)


def scenario_key(sc: dict) -> str:
    """What the reference training depends on."""
    return json.dumps({k: v for k, v in sc.items()
                       if k not in ("record", "profile_seed", "extended", "core", "env")},
                      sort_keys=True, default=str)


def gas_of(sc: dict) -> int:
    return int(sc["config"].get("gradient_accumulation_steps", 1))


def clip_of(sc: dict) -> float | None:
    return sc["config"].get("max_grad_norm")


# ------------------------------------------------------------------------------- reference
@functools.lru_cache(maxsize=None)
def _reference(key: str) -> dict:
    from deepcompile.tools.workloads import train_reference

    sc = json.loads(key)
    name, (opt_name, opt_kwargs) = sc["model"], sc["optim"]
    model = _models.build_model(name)
    opt = OPTIMIZERS[opt_name]([p for p in model.parameters() if p.requires_grad], **opt_kwargs)
    initial = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    ref = train_reference(model, opt, functools.partial(_models.global_batch, name),
                          steps=sc["steps"], gas=gas_of(sc), loss_of=_models.loss_of,
                          max_grad_norm=clip_of(sc))
    final = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    state = {n: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state[p].items()}
             for n, p in model.named_parameters(remove_duplicate=False) if opt.state.get(p)}
    return {"losses": ref.micro_losses, "grad_norms": ref.grad_norms, "initial": initial,
            "params": final, "optim_state": state}


def reference_training(sc: dict) -> dict:
    """Plain eager training of `sc` in this process on the whole global batch (cached; the
    tools' one reference loop, `deepcompile.tools.workloads.train_reference`).

    Returns losses (one per micro-step, on the global batch), the pre-clipping global gradient
    norm of every optimizer step, and the initial and final parameters by fqn (tied weights
    under each of their fqns).  Runs single-threaded, like the ranks.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference(scenario_key(sc))
    finally:
        torch.set_num_threads(threads)


# ----------------------------------------------------------------------------- distributed
def _comm(engine) -> dict:
    # (test_counts asserts separately that all three kinds are always reported)
    stats = engine.comm_stats()
    zero = {"count": 0, "bytes": 0}
    return {k: (int(stats.get(k, zero)["count"]), int(stats.get(k, zero)["bytes"]))
            for k in COMM_KINDS}


def _diff(a: dict, b: dict) -> dict:
    return {k: (a[k][0] - b[k][0], a[k][1] - b[k][1]) for k in COMM_KINDS}


def _group_diff(after: dict, before: dict) -> dict:
    """{group: {kind: (count, bytes)}} of what ran between two `comm_stats(by_group=True)`
    (kinds that ran only)."""
    zero = {"count": 0, "bytes": 0}
    out = {}
    for g, kinds in after.items():
        for k, v in kinds.items():
            b = before.get(g, {}).get(k, zero)
            if v["count"] != b["count"]:
                out.setdefault(g, {})[k] = (v["count"] - b["count"], v["bytes"] - b["bytes"])
    return out


def _memory_snapshot(engine) -> dict:
    module = engine.module
    opt = engine.optimizer
    mparams = list(module.parameters())
    oparams = [p for g in opt.param_groups for p in g["params"]]
    state_numel: dict[str, int] = {}
    for p in oparams:
        for k, v in opt.state.get(p, {}).items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                state_numel[k] = state_numel.get(k, 0) + v.numel()
    return {
        "module_storage_nbytes": [p.untyped_storage().nbytes() for p in mparams],
        "module_shapes": [tuple(p.shape) for p in mparams],
        "module_grads": [None if p.grad is None else p.grad.numel() for p in mparams],
        "opt_param_numel": [p.numel() for p in oparams],
        "opt_param_dim": [p.dim() for p in oparams],
        "opt_param_dtype": [str(p.dtype) for p in oparams],
        "opt_param_is_parameter": [isinstance(p, torch.nn.Parameter) for p in oparams],
        "opt_grads": [None if p.grad is None else p.grad.numel() for p in oparams],
        "opt_state_numel": state_numel,
        # gradients accumulated locally between micro-steps (ZeRO-1; selective_unshard): the
        # accumulators' bytes, and whether any holds a gradient (zero between windows)
        "local_grad_bytes": engine._runtime.accum.held_bytes(),
        "local_grad_held": any(bool(a.any()) for a in engine._runtime.accum.by_pid.values()),
    }


def _unshard_check(engine) -> dict:
    """The parameters kept gathered, the gradients accumulated locally, and the kept copies
    that differ from a fresh gather of their shards (selective_unshard)."""
    rt = engine._runtime
    return {"kept": [e.name for e in rt.kept.entries],
            "accumulate": sorted(e.name for e in rt.registry if e.pid in rt.accum.by_pid),
            "stale": rt.kept.stale()}


def _full_optim_state(engine) -> dict:
    """{parameter fqn: its optimizer state, state tensors gathered to full size} (collective;
    a parameter without state is absent, as in torch's optimizer)."""
    osd = engine.optimizer.state_dict()
    index = {id(p): i for i, p in enumerate(p for g in engine.optimizer.param_groups
                                             for p in g["params"])}
    out = {}
    for e in engine._registry:
        st = osd["state"].get(index.get(id(e.shard)))
        if not st:
            continue
        full = {}
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.shape == e.shard.shape:
                full[k] = engine._comm.all_gather(v.detach().contiguous(), count=False)[
                    : e.numel].view(e.shape).cpu()
            else:
                full[k] = v.item() if isinstance(v, torch.Tensor) else v
        for name in e.names:
            out[name] = full
    return out


def _graph_stats() -> dict:
    from torch._dynamo.utils import counters
    return {"unique_graphs": int(counters["stats"].get("unique_graphs", 0)),
            "graph_breaks": int(sum(counters["graph_break"].values()))}


class _Warnings(logging.Handler):
    """deepcompile's warnings during a scenario."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _structures(engine) -> dict:
    """Every graph slot: its structure, whether its code has several and each call of it is
    agreed, its representative, plan version and profiles ([Note: graph structure])."""
    pipe = engine._pipeline
    return {"slots": {k: {"structure": s.structure, "varies": s.varies, "checked": s.checked,
                          "rep": s.rep.key if s.rep is not None else None,
                          "version": s.version, "profiled": bool(s.history),
                          "calls": s.calls, "kind": s.kind}
                      for k, s in pipe.slots.items()},
            "passes": [(e["pass"], list(e["changed"]), e.get("kept", True))
                       for e in pipe.pass_log],
            "phases": [phase for phase, _ in pipe.step_log],
            "structure_group": engine._rails.structure_group is not None}


def _one_scenario(rank: int, world: int, sc: dict) -> dict:
    with contextlib.ExitStack() as stack:
        if sc.get("recompile_limit") is not None:
            stack.enter_context(torch._dynamo.config.patch(recompile_limit=sc["recompile_limit"]))
        warnings = _Warnings()
        if "structures" in sc.get("record", ()):
            logger = logging.getLogger("deepcompile")
            logger.addHandler(warnings)
            stack.callback(logger.removeHandler, warnings)
        res = _run_scenario(rank, world, sc)
        if "structures" in res:
            res["structures"]["warnings"] = warnings.messages
        return res


def _run_scenario(rank: int, world: int, sc: dict) -> dict:
    import deepcompile
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    t0 = time.perf_counter()
    name = sc["model"]
    gas = gas_of(sc)
    record = set(sc.get("record", ()))
    cfg = {k: v for k, v in sc["config"].items()}
    # the suite's scenarios name their passes: those of the stage before passes="auto"
    # became the default (auto is tested in test_autoplan.py)
    cfg.setdefault("passes", LEGACY_PASSES[cfg.get("zero_stage", 3)]
                   if cfg.get("profile_steps", 1) else ())
    cfg.setdefault("measure_steps", 0)   # passes judged on memory only: schedules as written
    for k in ("param_dtype", "reduce_dtype"):
        if isinstance(cfg.get(k), str):
            cfg[k] = getattr(torch, cfg[k])
    model = _models.build_model(name)
    model_shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    with chunk_bytes(sc.get("chunk_bytes")), environment(sc.get("env")):
        engine = deepcompile.initialize(model, optimizer=make_optimizer(sc["optim"]),
                                        config=deepcompile.Config(**cfg))
    if sc.get("profile_seed") is not None:
        engine._pipeline.runner.perturb = functools.partial(random_times, sc["profile_seed"])
    res: dict = {"id": sc["id"], "rank": rank, "world": world, "losses": [],
                 "model_shapes": model_shapes}
    if "memory" in record:
        res["memory_init"] = _memory_snapshot(engine)
        res["memory_micro"] = []
        res["memory_step"] = []
    if "comm" in record:
        res["comm_init"] = _comm(engine)
        res["comm_raw_init"] = {k: dict(v) for k, v in engine.comm_stats().items()}
        res["comm_fwd"], res["comm_bwd"], res["comm_step"] = [], [], []
    if "initial_state" in record:
        before = _comm(engine)
        res["initial_state"] = {k: v.detach().clone() for k, v in engine.full_state_dict().items()}
        res["comm_initial_state"] = _diff(_comm(engine), before)

    micro = 0
    for _step in range(sc["steps"]):
        g0 = engine.comm_stats(by_group=True) if "comm_groups" in record else None
        for _m in range(gas):
            t_micro = time.perf_counter()
            batch = _models.local_batch(name, micro, rank, world)
            c0 = _comm(engine) if "comm" in record else None
            loss = _models.loss_of(engine(**batch))
            c1 = _comm(engine) if "comm" in record else None
            engine.backward(loss)
            if "comm" in record:
                c2 = _comm(engine)
                res["comm_fwd"].append(_diff(c1, c0))
                res["comm_bwd"].append(_diff(c2, c1))
            if "memory" in record:
                res["memory_micro"].append(_memory_snapshot(engine))
            res["losses"].append(float(loss.detach().float().item()))
            res.setdefault("micro_seconds", []).append(time.perf_counter() - t_micro)
            micro += 1
            if "step_every_micro" in record and _m < gas - 1:
                # before the accumulation boundary step() must do nothing at all
                c0 = _comm(engine)
                engine.step()
                res.setdefault("comm_step_nonboundary", []).append(_diff(_comm(engine), c0))
        if "unshard" in record:   # kept copies intact through the window (not overwritten)
            res.setdefault("unshard_before_step", []).append(_unshard_check(engine))
        c0 = _comm(engine) if "comm" in record else None
        engine.step()
        if "comm" in record:
            res["comm_step"].append(_diff(_comm(engine), c0))
        if "comm_groups" in record:
            res.setdefault("comm_groups_step", []).append(
                _group_diff(engine.comm_stats(by_group=True), g0))
        # the step's global gradient norm, as the public API gives it (before clipping)
        res.setdefault("grad_norms", []).append(engine.metrics()["grad_norm"])
        res.setdefault("grad_norm_tensors", []).append(float(engine.grad_norm()))
        if "unshard" in record:   # ... and refreshed by the step (not stale)
            res.setdefault("unshard_after_step", []).append(_unshard_check(engine))
        if "memory" in record:
            res["memory_step"].append(_memory_snapshot(engine))

    c0 = _comm(engine)
    state = engine.full_state_dict()
    res["comm_full_state_dict"] = _diff(_comm(engine), c0)
    res["state"] = {k: v.detach().clone() for k, v in state.items()}
    res["state_devices"] = sorted({str(v.device) for v in state.values()})
    res["graphs"] = _graph_stats()
    if "report" in record:
        res["report"] = engine.report().to_dict()
    if "structures" in record:
        res["structures"] = _structures(engine)
    if "replicas" in record:   # the module's own parameters (ZeRO-1/2: replicated)
        res["replicas"] = {n: p.detach().clone() for n, p in
                           engine.module.named_parameters(remove_duplicate=False)}
    res["opt_param_dtypes"] = sorted({str(p.dtype) for g in engine.optimizer.param_groups
                                      for p in g["params"]})
    if "optim_state" in record:
        res["optim_state"] = _full_optim_state(engine)
    res["seconds"] = time.perf_counter() - t0
    del engine, model
    torch._dynamo.reset()
    return res


SCENARIO_BARRIER_S = 300


def run_training(rank: int, world: int, scenarios: list[dict]) -> list[dict]:
    """Run every scenario on this rank (inside a process group); one result dict each.

    An exception in a scenario is returned as {"id", "rank", "error": traceback} and the job
    goes on with the next scenario, so one failing scenario fails only its own tests.  (The
    errors seen in practice -- compile errors, failed checks -- happen on every rank at the same
    point.  Should one rank fail alone while the others wait in a collective, the monitored
    barrier after the scenario or the harness's timeout ends the job.)
    """
    import traceback
    from datetime import timedelta

    import torch.distributed as dist

    out = []
    for sc in scenarios:
        try:
            out.append(_one_scenario(rank, world, sc))
        except Exception:  # noqa: BLE001 -- reported per scenario by Jobs.results
            out.append({"id": sc["id"], "rank": rank, "error": traceback.format_exc()})
            torch._dynamo.reset()
        dist.monitored_barrier(timeout=timedelta(seconds=SCENARIO_BARRIER_S))
    return out


class Jobs:
    """Runs each distributed job (a world size and a list of scenarios) at most once per test
    session and hands out its per-scenario results; a failed job fails every test that uses it
    with the same error, without re-running."""

    def __init__(self, jobs: dict[str, tuple[int, list[dict]]], timeout: float = 600.0):
        self.jobs = {}
        self.left_out: dict[str, set[str]] = {}   # [Note: the core matrix]
        for name, (world, scs) in jobs.items():
            inductor = name.startswith("inductor")
            core = scs if FULL else [
                sc for i, sc in enumerate(scs) if sc.get("core") or not sc.get("extended") and
                not inductor and (i == 0 or world <= 2)]
            self.left_out[name] = {sc["id"] for sc in scs} - {sc["id"] for sc in core}
            if core:
                self.jobs[name] = (world, core)
        self.timeout = timeout
        self._done: dict[str, object] = {}

    def params(self):
        """(job, scenario) pairs for pytest.mark.parametrize, with readable ids; jobs whose
        name starts with "inductor" are marked `inductor` (slow on CPU)."""
        import pytest

        def marks(job):
            return (pytest.mark.inductor,) if job.startswith("inductor") else ()

        return [pytest.param(job, sc, id=f"{job}-{sc['id']}", marks=marks(job))
                for job, (_world, scs) in self.jobs.items() for sc in scs]

    def results(self, job: str, scenario_id: str | None = None):
        """Every rank's result of `scenario_id` in `job` (or of every scenario if None)."""
        from _dist import run_distributed

        if scenario_id in self.left_out.get(job, ()):
            import pytest

            pytest.skip("the full matrix only: DEEPCOMPILE_FULL_TESTS=1 ([Note: the core matrix] "
                        "in tests/_train.py)")
        if job not in self._done:
            world, scs = self.jobs[job]
            t0 = time.perf_counter()
            try:
                per_rank = run_distributed(run_training, world, scs, timeout=self.timeout)
            except BaseException as exc:  # noqa: BLE001 -- remembered, re-raised per test
                self._done[job] = exc
            else:
                self._done[job] = {sc["id"]: [r[i] for r in per_rank] for i, sc in enumerate(scs)}
                print(f"\n[job] {job}: {len(scs)} scenarios on {world} ranks in "
                      f"{time.perf_counter() - t0:.1f}s")
        done = self._done[job]
        if isinstance(done, BaseException):
            raise done
        if scenario_id is None:
            return done
        per_rank = done[scenario_id]
        errors = [r for r in per_rank if "error" in r]
        if errors:
            from _dist import DistributedTestError

            by_text: dict[str, list[int]] = {}
            for r in errors:
                by_text.setdefault(r["error"], []).append(r["rank"])
            raise DistributedTestError(
                f"scenario {scenario_id} of job {job} failed:\n" + "\n".join(
                    f"ranks {ranks}:\n{text}" for text, ranks in by_text.items()))
        return per_rank


# ------------------------------------------------------------------------------- comparing
DEVIATIONS: list[dict] = []   # filled by compare_to_reference
# every measured deviation is also appended here (one JSON object a line, with a timestamp);
# conftest's summary reads it (the xdist workers' deviations are not in the controller)
DEVIATION_FILE = Path(__file__).resolve().parents[1] / "build" / "test-deviations.jsonl"


def last_profiles(report: dict) -> list[tuple[str, dict]]:
    """(slot key, its latest profile) of every graph slot of `engine.report().to_dict()`."""
    return [(s["slot"], s["profiles"][-1]) for g in report["graphs"] for s in g["slots"]]


def assert_peaks_within(report: dict, budget: float) -> None:
    """Every graph slot's latest measured profile peaks within `budget` (measured with the
    plan in force)."""
    over = [(key, prof["peak_bytes"]) for key, prof in last_profiles(report)
            if prof["peak_bytes"] > budget]
    assert not over, (budget, over)


def mean_losses(results: list[dict]) -> list[float]:
    """The distributed loss of each micro-step: the mean of the ranks' local losses."""
    per_rank = [r["losses"] for r in results]
    return [sum(v) / len(v) for v in zip(*per_rank)]


def max_param_deviation(state: dict, ref: dict) -> tuple[float, str]:
    worst, where = 0.0, ""
    for k, v in ref.items():
        d = (state[k].float() - v.float()).abs().max().item()
        if d > worst or not where:
            worst, where = d, k
    return worst, where


def check_state_consistent(results: list[dict]) -> None:
    """full_state_dict is the same (bitwise) on every rank, on CPU."""
    base = results[0]["state"]
    for r in results:
        assert r["state_devices"] == ["cpu"], r["state_devices"]
        assert set(r["state"]) == set(base)
        for k in base:
            assert torch.equal(r["state"][k], base[k]), f"rank {r['rank']} differs on {k}"


def compare_to_reference(sc: dict, results: list[dict], *, loss_tol: float = 1e-5,
                         param_tol: float | None = None, kind: str = "") -> dict:
    """Assert parity of a distributed run with the eager reference; return the deviations."""
    ref = reference_training(sc)
    world = len(results)
    losses = mean_losses(results)
    assert len(losses) == len(ref["losses"]) == sc["steps"] * gas_of(sc)
    assert all(math.isfinite(x) for x in losses), losses
    loss_dev = max(abs(a - b) for a, b in zip(losses, ref["losses"]))
    check_state_consistent(results)
    state = results[0]["state"]
    assert set(state) == set(ref["params"]), (sorted(state), sorted(ref["params"]))
    for k, v in ref["params"].items():
        assert state[k].shape == v.shape, (k, state[k].shape, v.shape)
        assert state[k].dtype == torch.float32, (k, state[k].dtype)
    param_dev, where = max_param_deviation(state, ref["params"])
    moved, _ = max_param_deviation(ref["params"], ref["initial"])
    norm_dev = check_grad_norms(results, ref["grad_norms"])
    if param_tol is None:
        param_tol = 1e-5 if sc["optim"][0] == "sgd" else 1e-4
    entry = {"id": sc["id"], "kind": kind or sc["model"], "world": world,
             "compiler": sc["config"].get("compiler"), "optim": sc["optim"][0],
             "gas": gas_of(sc), "clip": clip_of(sc), "steps": sc["steps"],
             "max_loss_dev": loss_dev, "max_param_dev": param_dev, "worst_param": where,
             "max_grad_norm_rel_dev": norm_dev,
             "max_param_change": moved,
             "seconds_rank0": round(results[0].get("seconds", 0.0), 1),
             "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    DEVIATIONS.append(entry)
    try:
        DEVIATION_FILE.parent.mkdir(parents=True, exist_ok=True)
        with DEVIATION_FILE.open("a") as f:
            f.write(json.dumps(entry) + "\n")
    except OSError:
        pass
    print(f"\n[deviation] {sc['id']} world={world}: loss {loss_dev:.3g}, "
          f"param {param_dev:.3g} ({where}); params moved {moved:.3g}; grad norm (relative) "
          f"{norm_dev:.3g}")
    assert moved > 10 * param_tol, f"training barely moved the parameters ({moved})"
    assert loss_dev <= loss_tol, \
        f"{sc['id']}: loss deviation {loss_dev:.3g} > {loss_tol}\n dist {losses}\n ref {ref['losses']}"
    assert param_dev <= param_tol, \
        f"{sc['id']}: parameter deviation {param_dev:.3g} > {param_tol} at {where}"
    assert norm_dev <= GRAD_NORM_REL_TOL, \
        f"{sc['id']}: gradient norm deviation {norm_dev:.3g} > {GRAD_NORM_REL_TOL}"
    return entry


# the step's gradient norm against eager's clip_grad_norm_ (before clipping), relative: fp32,
# the same gradients summed in another order (shards, reductions), on parameters that follow
# the reference within the parity tolerances (measured at most 2.7e-6 over the 47 scenarios of
# test_parity, test_zero12, test_composition and test_grad_norm: 1, 2 and 4 ranks, fx and
# Inductor)
GRAD_NORM_REL_TOL = 1e-4


def check_grad_norms(results: list[dict], ref_norms: list[float]) -> float:
    """engine.grad_norm() (and metrics()["grad_norm"]) of every optimizer step is the same on
    every rank, bitwise; returns its largest deviation from `ref_norms`, relative."""
    norms = results[0]["grad_norms"]
    assert len(norms) == len(ref_norms), (norms, ref_norms)
    for r in results:
        assert r["grad_norms"] == r["grad_norm_tensors"] == norms, (r["rank"], r["grad_norms"])
    return max(abs(a - b) / b for a, b in zip(norms, ref_norms))
