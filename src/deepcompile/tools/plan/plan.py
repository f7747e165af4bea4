"""`deepcompile plan`: what a model will do on a cluster, from profiles we can take here.

    profile (pieces.py, trace.py; roofline.py, or host.py: a measured host profile)
      -> compose the full model's graphs (compose.py)
      -> per system, a schedule (ours*.py: the passes' own planners; peers.py: FSDP2, DeepSpeed)
      -> simulate one optimizer step (simulate.py) -> table, JSON, picture (report.py)

Assumed figures, all printed with a plan and overridable with `--assume key=value`:

* `gpu.*` (roofline.py): datasheet peaks of the target GPU and what kernels reach of them.
* `net.host_step_ns`: the host's optimizer step per parameter (offload tier 4, chunks whose
  masters are on the host stepping there): measured on this machine (torch's fused CPU AdamW
  over 16 M fp32 parameters, past the caches; its intra-op threads), which is not the target's
  host; set the target's with `--assume net.host_step_ns=...`.
* `net.*` (network.py): NVLink and NIC bandwidths, hop latencies, and `net.launch_host_s`,
  deepcompile's host time per collective launch. Default 20 us: the runtime's graphs launch
  torch's functional collectives (C++ ops called from Inductor's code: compiler/lower.py), whose
  launch on an H100 host is NCCL's enqueue plus c10d's work object (an assumption;
  `compiler.cost.calibrate` measures it at start-up, and `--assume net.launch_host_s=...` sets
  it). A runtime that launched each collective through a Python op would take 100-350 us:
  `--assume net.launch_host_s=1e-4` plans that.
* `peer.fsdp_hook_s` (150 us per FSDP2 collective: its pre/post hooks, copy-in/out launches;
  an assumption) and `peer.ds_hook_s` per DeepSpeed module fetch (900 us: one H100's llama-1b
  step, DeepSpeed ZeRO-3 eager against FSDP2 eager, the difference spread over the model's 312
  module fetches per step).
"""

from __future__ import annotations

import dataclasses
import math
import os
import platform
from typing import Any

import torch

from . import (compose, network, ours, ours_passes, peers, pieces, roofline, shapes, simulate,
               trace)
from . import host as hostprof
from ...compiler.autoplan import fusion_policy
from .schedule import (ADAM_BYTES, GRAD_SHARD_BYTES, MASTER_BYTES, Schedule, Setting)

GiB = 2**30

# the default ladder of deepcompile systems: (name, passes)
OURS = (("ours-z3", ()),
        ("ours-z3+prefetch", ("prefetch",)),
        ("ours-z3+overlap", ("prefetch", "bucket_reduce")),
        ("ours-z3+overlap+unshard", ("prefetch", "bucket_reduce", "selective_unshard")),
        ("ours-z3-all", ("prefetch", "bucket_reduce", "selective_unshard", "offload_optimizer")),
        ("ours-z3-auto", ours_passes.AUTO))
PEERS = ("fsdp2", "fsdp2-compile", "ds-z3")
PEERS_Z12 = ("ddp", "ddp-compile", "ds-z1")   # beside ZeRO-1/2 (the default at --stage 1, 2)


class PlanError(ValueError):
    """The plan cannot be made as asked (the message says why and what would work)."""


@dataclasses.dataclass
class PlanArgs:
    model: str
    nodes: int = 1
    gpus_per_node: int = 8
    gpu: str = "h100"            # a GPU of roofline.GPUS, or "cpu": gloo ranks, from a host
                                 # profile (host.py)
    seq: int = 1024
    batch: int = 1
    gas: int = 1
    stage: int = 3
    passes: list[tuple[str, ...] | str] | None = None   # None: the OURS ladder; "auto": the
                                                        # runtime's choice (ours_passes.auto_choice)
    peers: tuple[str, ...] = PEERS
    memory_budget: float | None = None   # bytes, a fraction (<= 1) of GPU memory, or None (0.9)
    ac: bool = False             # activation checkpointing of every decoder layer
    assume: dict[str, float] = dataclasses.field(default_factory=dict)
    host_profile: str | None = None   # CPU: the host profile's JSON (host.py)
    # data-parallel layouts to plan ([Note: layouts] in runtime/mesh.py): "shard" (the ladder
    # of pass sets), "hsdp", "hsdp_zero" and "hpz" (passes="auto", or the --passes given),
    # "auto" (which one the runtime's rule at initialize picks: compiler/layouts.py); None: all
    # of them past one node, "shard" on one
    layouts: tuple[str, ...] | None = None

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclasses.dataclass
class SystemResult:
    system: str
    description: str
    result: simulate.Result
    schedule: Schedule
    fits: bool
    layout: str = "shard"

    def row(self, tokens: int, flops: float, gas: int, world: int,
            nodes: int = 1) -> dict[str, Any]:
        r = self.result
        groups = self.schedule.group_bytes
        across = groups.get("inter", 0) + (groups.get("world", 0) if nodes > 1 else 0)
        return {"system": self.system, "step_s": r.step_s,
                "layout": self.layout, "across_nodes_bytes": across,
                "tokens_per_s": tokens * world / r.step_s if r.step_s else None,
                "tflops_per_gpu": flops / r.step_s / 1e12 if r.step_s else None,
                "exposed_comm_s": r.exposed_comm_s, "comm_s": r.comm_s,
                "compute_s": r.compute_s, "host_s": r.host_s, "host_bound_s": r.host_bound_s,
                "peak_bytes": r.peak_bytes, "fits": self.fits,
                "collectives": self.schedule.collectives,
                "decisions": self.schedule.decisions, "description": self.description}


@dataclasses.dataclass
class Plan:
    args: PlanArgs
    shape: shapes.ModelShape
    params: int
    setting: dict[str, Any]          # the assumed figures
    results: list[SystemResult]
    model: compose.Model
    memory: dict[str, Any]           # fit check
    machine: dict[str, Any]
    layout_choice: dict[str, Any] | None = None   # layout="auto": the runtime rule's pick

    def rows(self) -> list[dict[str, Any]]:
        tokens = self.model.tokens() * self.args.gas
        flops = self.model.model_flops() * self.args.gas
        return [r.row(tokens, flops, self.args.gas, self.args.world, self.args.nodes)
                for r in self.results]

    def to_dict(self) -> dict[str, Any]:
        a = dataclasses.asdict(self.args)
        return {"args": a, "model": self.shape.to_dict(), "parameters": self.params,
                "tokens_per_step": self.model.tokens() * self.args.gas * self.args.world,
                "model_flops_per_step_per_gpu": self.model.model_flops() * self.args.gas,
                "assumed": self.setting, "memory": self.memory, "machine": self.machine,
                "layout_choice": self.layout_choice, "systems": self.rows()}


# -------------------------------------------------------------------------- overrides
def _override(obj, prefix: str, assume: dict[str, float]):
    fields = {f.name for f in dataclasses.fields(obj)}
    changes = {}
    for key, value in assume.items():
        head, _, name = key.partition(".")
        if head != prefix:
            continue
        if name not in fields:
            raise PlanError(f"deepcompile plan: --assume {key}: {type(obj).__name__} has no "
                            f"field {name!r}; fields: {', '.join(sorted(fields))}")
        changes[name] = type(getattr(obj, name))(value)
    return dataclasses.replace(obj, **changes) if changes else obj


def _check_assume(assume: dict[str, float]) -> None:
    bad = [k for k in assume if k.partition(".")[0] not in ("gpu", "net", "peer")]
    if bad:
        raise PlanError(f"deepcompile plan: --assume {', '.join(bad)}: keys are gpu.<field>, "
                        "net.<field> or peer.<field> (see the assumed figures a plan prints)")


# ------------------------------------------------------------------------------ memory
def minimum_gpus(numel: int, fixed: int, memory: float, per_param: int) -> int | None:
    """Smallest N with per_param x numel / N + fixed <= memory (None: none)."""
    room = memory - fixed
    if room <= 0:
        return None
    return max(1, math.ceil(per_param * numel / room))


def fit_check(model: compose.Model, args: PlanArgs, device_memory: float,
              csize: int) -> dict[str, Any]:
    """Whether ZeRO-3 can run at all: its insertion-only peak (state shards + activations +
    the largest parameters gathered at once) within device memory, with all optimizer state on
    the device, or with offload_optimizer's most off it: Adam's moments, the gradient shards
    and, under a narrower compute dtype, the fp32 masters less their copies (tiers 1 to 3)."""
    world = args.world
    numel = model.numel
    act = max(n.live for n in model.fw.nodes + model.bw.nodes) + model.base_bytes
    biggest = max(p.numel for p in model.params) * csize
    fixed = act + 2 * biggest
    state = MASTER_BYTES + ADAM_BYTES + GRAD_SHARD_BYTES
    need = state * math.ceil(numel / world) + fixed
    kept = state - ADAM_BYTES - GRAD_SHARD_BYTES   # per parameter with the most offloaded
    if csize < MASTER_BYTES:
        kept = csize                               # the masters' copies (tier 3)
    need_off = kept * math.ceil(numel / world) + fixed
    out = {"device_bytes": device_memory, "state_bytes_per_gpu": state * math.ceil(numel / world),
           "activation_peak_bytes": act, "largest_param_bytes": biggest,
           "estimate_bytes": need, "fits": need <= device_memory,
           "fits_with_offload": need_off <= device_memory,
           "min_gpus": minimum_gpus(numel, fixed, device_memory, state),
           "min_gpus_with_offload": minimum_gpus(numel, fixed, device_memory, kept),
           "masters_off": csize < MASTER_BYTES}
    return out


# ---------------------------------------------------------------------------- the plan
def _budget(args: PlanArgs, device_memory: float) -> float:
    b = args.memory_budget
    if b is None:
        return 0.9 * device_memory if math.isfinite(device_memory) else float("inf")
    if b <= 1.0:
        if not math.isfinite(device_memory):
            raise PlanError("deepcompile plan: --memory-budget as a fraction needs a GPU")
        return b * device_memory
    return float(b)


def make_plan(args: PlanArgs, host: hostprof.HostProfile | None = None,
              replay: dict | None = None) -> Plan:
    """`host` (CPU): the host profile to plan with, else read from `args.host_profile`.
    `replay`: a run's decisions to replay instead of planning them (`Setting.replay`)."""
    if args.stage not in (1, 2, 3):
        raise PlanError(f"deepcompile plan: --stage {args.stage}: 1, 2 or 3")
    _check_assume(args.assume)
    shape = shapes.load(args.model)
    cpu = args.gpu == "cpu"
    ladder = list(OURS) if args.passes is None else [
        ("ours-z3-auto", ours_passes.AUTO) if _is_auto(ps) else
        ("ours-z3" + "".join(f"+{p}" for p in ps) if ps else "ours-z3", tuple(ps))
        for ps in args.passes]
    if args.stage < 3:   # what applies at ZeRO-1/2 of each pass set, and overlap_refresh
        z12 = ("bucket_reduce", "overlap_refresh")
        if args.passes is None:
            ladder = ladder[:-1] + [("", z12)] + ladder[-1:]
        z12 += ("activation_budget",)
        ladder = [(f"ours-z{args.stage}-auto", ours_passes.AUTO) if ps == ours_passes.AUTO else
                  (f"ours-z{args.stage}" + "".join(f"+{p}" for p in ps if p in z12),
                   tuple(p for p in ps if p in z12))
                  for _, ps in ladder]
        ladder = list(dict(ladder).items())
    layouts = _layouts(args, cpu)
    for _, ps in ladder:
        unknown = [p for p in ps if p not in ours_passes.PASSES] if ps != ours_passes.AUTO else []
        if unknown:
            raise PlanError(f"deepcompile plan: unknown pass(es) {', '.join(unknown)}; known: "
                            f"{', '.join(ours_passes.PASSES)}")
    if cpu:
        try:
            if host is None:
                host = _read_host_profile(args)
            host.check(args.model, args.world, args.batch, args.seq,
                       args.host_profile or "given")
            ps = pieces.build(shape, batch=args.batch, seq=args.seq, dtype=torch.float32,
                              fake=False)
            graphs = trace.trace_all(ps)
            host.check_graphs(graphs, roofline.is_free)
        except hostprof.ProfileError as e:
            raise PlanError(str(e)) from None
        net = host.network
        fused_times = unfused_times = host.times
        device_memory = float("inf")
        gpu = None
        mem_bw = host.copy_bw
        setting_info = {"host": host.summary(), "network": net.describe(),
                        "host_copy_bw": mem_bw}
    else:
        if args.host_profile is not None:
            raise PlanError(f"deepcompile plan: --host-profile times gloo ranks (--gpu cpu); "
                            f"--gpu {args.gpu} is timed by its roofline")
        gpu = _override(roofline.get_gpu(args.gpu), "gpu", args.assume)
        ps = pieces.build(shape, batch=args.batch, seq=args.seq, dtype=torch.bfloat16, fake=True)
        graphs = trace.trace_all(ps)
        fused, unfused = {}, {}

        def fused_times(piece, phase):
            if (piece, phase) not in fused:
                fused[piece, phase] = roofline.fused_times(getattr(graphs[piece], phase), gpu)
            return fused[piece, phase]

        def unfused_times(piece, phase):
            if (piece, phase) not in unfused:
                unfused[piece, phase] = roofline.unfused_times(getattr(graphs[piece], phase), gpu)
            return unfused[piece, phase]

        net = _override(network.Fabric(args.nodes, args.gpus_per_node, gpu.nvlink_bw, gpu.nic_bw,
                                       gpu.pcie_bw, host_step_ns=_host_step_ns()),
                        "net", args.assume)
        device_memory = gpu.memory
        mem_bw = gpu.hbm_bw * gpu.mem_eff
        setting_info = {"gpu": gpu.to_dict(), "roofline": roofline.roofline_summary(gpu),
                        "network": net.describe(), "net": net.to_dict()}
    costs = _override(peers.PeerCosts(), "peer", args.assume)
    setting_info["peer"] = dataclasses.asdict(costs)
    dtype = ps.dtype
    model_f = compose.compose(graphs, shape.layers, fused_times, name=shape.name,
                              batch=args.batch, seq=args.seq, dtype=dtype, ac=args.ac)
    model_u = model_f if cpu else compose.compose(
        graphs, shape.layers, unfused_times, name=shape.name, batch=args.batch, seq=args.seq,
        dtype=dtype, ac=args.ac)
    csize = torch.empty((), dtype=dtype).element_size()
    memory = fit_check(model_f, args, device_memory, csize)
    # a pass set with the activation pass lowers the activations the fit check counts: the
    # plans say what fits
    acts = any(ps != ours_passes.AUTO and "activation_budget" in ps for _, ps in ladder)
    if not memory["fits_with_offload"] and args.stage == 3 and not acts:
        raise PlanError(_does_not_fit(shape, args, memory))
    budget = _budget(args, device_memory)
    setting_info["memory_budget_bytes"] = budget

    def setting(model, peer: bool = False, layout: str = "shard"):
        opt_s = None   # a GPU's: from its memory bandwidth
        if cpu:        # measured: ours steps flat chunks, the peers parameter by parameter
            opt_s = host.peer_optimizer_s if peer else host.optimizer_s
        cost = net if layout == "shard" else network.LayoutFabric(net, layout, args.gpus_per_node)
        return Setting(model, args.world, cost, budget, args.gas, mem_bw,
                       gpu.kernel_host_s if gpu else 0.0, gpu.eager_op_host_s if gpu else 0.0,
                       host_is_compute=cpu, optimizer_s=opt_s,
                       stage=args.stage,
                       framework_s=host.framework_s if cpu else gpu.framework_host_s,
                       framework_async_s=host.framework_async_s if cpu else None,
                       plan_cost=host.plan_cost if cpu else None, replay=replay,
                       fusion=fusion_policy("cpu" if cpu else "cuda")[0],
                       layout=layout, group=args.gpus_per_node if layout != "shard" else 0)

    results = []
    for layout in [x for x in layouts if x != "auto"]:
        # the shard layout plans the ladder; the others its "auto" pass set (or the sets given)
        rungs = ladder if layout == "shard" or args.passes is not None else \
            [(n, ps) for n, ps in ladder if ps == ours_passes.AUTO]
        for name, ps_ in rungs:
            auto = None
            if layout != "shard":
                name = f"{name}-{layout}"
            what = f"deepcompile ZeRO-{args.stage}" + (
                "" if layout == "shard" else f" {layout} (groups of {args.gpus_per_node})")
            if ps_ == ours_passes.AUTO:
                ps_, auto = resolve_auto(setting(model_f, layout=layout), device_memory, cpu)
                desc = (f"{what}, passes='auto' (the runtime's choice and verdicts, on "
                        f"predictions): " + (" + ".join(ps_) or "insertion only"))
            else:
                desc = what + (f" + {' + '.join(ps_)}" if ps_ else ", insertion only")
            sch = ours.schedule(setting(model_f, layout=layout), ps_, name, desc)
            if auto is not None:
                sch.decisions = {"auto": auto, **sch.decisions}
            results.append(_run(sch, device_memory, cpu, layout))
    choice = _layout_choice(model_f, args, net, budget, csize) if "auto" in layouts else None
    if args.stage < 3:
        for peer in PEERS_Z12 if tuple(args.peers) == PEERS else args.peers:
            if peer in ("ddp", "ddp-compile"):
                sch = peers.ddp(setting(model_u if peer == "ddp" else model_f, True), costs,
                                compiled=peer == "ddp-compile", name=peer,
                                description="PyTorch DDP" + (" under torch.compile"
                                                             if peer == "ddp-compile" else
                                                             ", eager") + ", default buckets")
            elif peer == "ds-z1":
                sch = peers.deepspeed_z1(setting(model_u, True), costs, name=peer,
                                         description="DeepSpeed ZeRO-1, eager, default buckets")
            else:
                raise PlanError(f"deepcompile plan: peer {peer!r} does not run at ZeRO-"
                                f"{args.stage}; known there: {', '.join(PEERS_Z12)}")
            results.append(_run(sch, device_memory, cpu))
    if args.stage == 3:
        for peer in args.peers:
            if peer == "fsdp2":
                sch = peers.fsdp2(setting(model_u, True), costs, compiled=False, name=peer,
                                  description="FSDP2 (per-layer units, one ahead), eager")
            elif peer == "fsdp2-compile":
                sch = peers.fsdp2(setting(model_f, True), costs, compiled=True, name=peer,
                                  description="FSDP2 with compiled layers")
            elif peer == "ds-z3":
                sch = peers.deepspeed(setting(model_u, True), costs, name=peer,
                                      description="DeepSpeed ZeRO-3, eager, default buckets")
            else:
                raise PlanError(f"deepcompile plan: unknown peer {peer!r}; known: "
                                f"{', '.join(PEERS)}")
            results.append(_run(sch, device_memory, cpu))
    return Plan(args, shape, model_f.numel, setting_info, results, model_f, memory, _machine(),
                choice)


def _layouts(args: PlanArgs, cpu: bool) -> tuple[str, ...]:
    known = ("shard", "hsdp", "hsdp_zero", "hpz", "auto")
    layouts = args.layouts
    if layouts is None:
        layouts = known if args.nodes > 1 and not cpu else ("shard",)
        if args.stage < 3:
            layouts = tuple(x for x in layouts if x not in ("hpz", "hsdp_zero"))
    unknown = [x for x in layouts if x not in known]
    if unknown:
        raise PlanError(f"deepcompile plan: --layouts {', '.join(unknown)}: known: "
                        f"{', '.join(known)}")
    if cpu and set(layouts) != {"shard"}:
        raise PlanError("deepcompile plan: --gpu cpu plans gloo ranks of one machine: only the "
                        "'shard' layout (--layouts shard)")
    for name in ("hpz", "hsdp_zero"):
        if name in layouts and args.stage < 3:
            raise PlanError(f"deepcompile plan: --layouts {name} needs --stage 3 (its secondary "
                            f"shards serve ZeRO-3's gathers)")
    if "shard" not in layouts:
        layouts = ("shard", *layouts)   # the ladder's baselines (ours-z3, the peers' column)
    return tuple(dict.fromkeys(layouts))


def _layout_choice(model: compose.Model, args: PlanArgs, net, budget: float,
                   csize: int) -> dict[str, Any]:
    """What Config.layout="auto" picks at initialize on this cluster ([Note: choosing the
    layout] in compiler/layouts.py): its rule, with the network model's figures per group in
    place of the measured ones, for the (first) pass set planned."""
    from ...compiler.layouts import ParamFacts, choose
    from ...passes.context import known_passes

    params = [ParamFacts(p.numel, csize, csize, MASTER_BYTES) for p in model.params]
    fabric = network.LayoutFabric(net, "hsdp", args.gpus_per_node)
    if args.nodes == 1:
        return {"layout": "shard", "why": "one node: every layout is 'shard'"}
    given = None if args.passes is None else args.passes[0]
    passes = known_passes() if given is None or _is_auto(given) else tuple(given)
    name, why, figures = choose(params, args.world, args.gpus_per_node, args.stage, args.gas,
                                budget, fabric.group_s, passes=passes)
    return {"layout": name, "why": why, "figures": figures}


def _is_auto(ps) -> bool:
    return ps == ours_passes.AUTO or tuple(ps) == (ours_passes.AUTO,)


def resolve_auto(s: Setting, device_memory: float, cpu: bool) -> tuple[tuple[str, ...], dict]:
    """`passes="auto"` as the runtime runs it ([Note: choosing passes] and [Note: keeping a
    pass] in compiler/autoplan.py): the passes `ours_passes.auto_choice` chooses, in order,
    each kept or reverted by the runtime's own rule (`autoplan.verdict`), with the simulated step
    and peak in place of the measured steps and the re-profile."""
    from ...compiler.autoplan import verdict

    chosen, left_out = ours_passes.auto_choice(s)
    kept: tuple[str, ...] = ()
    prev = _run(ours.schedule(s, kept, "auto", ""), device_memory, cpu).result
    verdicts = {}
    for name in chosen:
        r = _run(ours.schedule(s, kept + (name,), "auto", ""), device_memory, cpu).result
        ok, why = verdict({"peak_bytes": prev.peak_bytes, "measured_s": [prev.step_s]},
                          {"peak_bytes": r.peak_bytes, "measured_s": [r.step_s]}, s.budget)
        verdicts[name] = ("kept: " if ok else "reverted: ") + why.replace("measured", "predicted")
        if ok:
            kept, prev = kept + (name,), r
    return kept, {"chosen": chosen, "left_out": left_out, "verdicts": verdicts,
                  "passes": list(kept)}


def _read_host_profile(args: PlanArgs) -> hostprof.HostProfile:
    if args.host_profile is None:
        raise hostprof.ProfileError(
            "deepcompile plan: --gpu cpu plans from a host profile of this machine: its gloo "
            "ranks' node times, optimizer step and network, measured by the validation harness "
            "in a source checkout: "
            f"{hostprof.command(args.model, args.world, args.batch, args.seq)}; then plan with "
            "--host-profile host.json")
    return hostprof.load(args.host_profile)


def _run(sch: Schedule, device_memory: float, cpu: bool, layout: str = "shard") -> SystemResult:
    r = simulate.simulate(sch.events, host_is_compute=cpu)
    return SystemResult(sch.system, sch.description, r, sch, r.peak_bytes <= device_memory,
                        layout)


def _does_not_fit(shape, args: PlanArgs, memory: dict[str, Any]) -> str:
    gb = lambda b: f"{b / GiB:.1f} GiB"  # noqa: E731
    if memory["min_gpus_with_offload"] is None:
        return (f"deepcompile plan: {shape.name} cannot train at batch {args.batch} x seq "
                f"{args.seq} on {args.gpu} at any number of GPUs: its activations and largest "
                f"gathered parameters alone take "
                f"{gb(memory['activation_peak_bytes'] + 2 * memory['largest_param_bytes'])} "
                f"of {gb(memory['device_bytes'])}; reduce --batch or --seq, or use "
                f"--activation-checkpointing")
    return (f"deepcompile plan: {shape.name} does not fit on {args.world} x {args.gpu}: ZeRO-3 "
            f"needs about {gb(memory['estimate_bytes'])} per GPU (state "
            f"{gb(memory['state_bytes_per_gpu'])}, activations "
            f"{gb(memory['activation_peak_bytes'])}) of {gb(memory['device_bytes'])}; it needs at "
            f"least {memory['min_gpus']} GPUs, or {memory['min_gpus_with_offload']} with "
            f"optimizer state and gradients on the host"
            + (" and the masters' compute-dtype copies on the device" if memory["masters_off"]
               else "") + " (offload_optimizer)")


def _host_step_ns(numel: int = 1 << 24, repeats: int = 3) -> float:
    """This machine's AdamW step on the CPU (torch's fused kernel, fp32, its intra-op threads),
    nanoseconds per parameter: the fastest of `repeats` (`--assume net.host_step_ns` sets the
    target host's instead)."""
    import time

    p = torch.nn.Parameter(torch.zeros(numel))
    p.grad = torch.full((numel,), 1e-3)
    opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
    opt.step()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        opt.step()
        ts.append(time.perf_counter() - t0)
    return min(ts) / numel * 1e9


def _machine() -> dict[str, Any]:
    return {"host": platform.node(), "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(), "load": list(os.getloadavg())}
