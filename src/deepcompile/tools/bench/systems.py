"""The systems the bench compares, as data, and whether each can run in this build / here.

Every "ours" system is a `Config(zero_stage=..., passes=...)`: one whose stage `Config` rejects,
or whose passes are not registered (`deepcompile.passes.known_passes()`), is reported as "not
available in this build" rather than failing, so a system appears in the table as soon as the
build has what it needs, without code changes here. `ours-z3-all` is every registered pass, in
the pipeline's canonical order; a system that resolves to the same configuration as one listed
before it (e.g. `ours-z3-all` while only prefetch and bucket_reduce exist) is not run twice.

Peers are imported only inside the bench's worker processes (`trainers.py`), never by the
library: DeepSpeed is an optional extra (`pip install -c constraints.txt -e '.[bench]'`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

# The order passes run in when several are configured: overlap communication first, then keep
# parameters gathered with the memory left, then offload what does not fit.
CANONICAL_PASS_ORDER = ("prefetch", "bucket_reduce", "selective_unshard", "offload_optimizer")
ALL = "all"  # passes=ALL: every registered pass
AUTO = "auto"  # passes=AUTO: the pipeline chooses (the default)

DS_INSTALL = "pip install -c constraints.txt -e '.[bench]' (with DS_BUILD_OPS=0 on a CPU machine)"


@dataclasses.dataclass(frozen=True)
class System:
    name: str
    kind: str              # ours | fsdp2 | ddp | compile | deepspeed
    description: str
    stage: int = 3         # ZeRO stage (ours, deepspeed)
    passes: tuple[str, ...] | str = ()   # ours: pass names, or ALL
    compile: bool = False  # peers: torch.compile (per block for FSDP2, engine.compile() for DS)
    deepcompile: bool = False  # DeepSpeed's own DeepCompile (CUDA only)
    single_process: bool = False  # one process, one rank's batch: the compute bound

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


SYSTEMS: dict[str, System] = {s.name: s for s in (
    System("ours-z3", "ours", "deepcompile ZeRO-3, insertion only (no passes)"),
    System("ours-z3+overlap", "ours", "deepcompile ZeRO-3 + prefetch + bucket_reduce "
           "(asynchronous fused gathers and bucketed reduce-scatters)",
           passes=("prefetch", "bucket_reduce")),
    System("ours-z3+overlap+unshard", "ours", "deepcompile ZeRO-3 + prefetch + bucket_reduce "
           "+ selective_unshard", passes=("prefetch", "bucket_reduce", "selective_unshard")),
    System("ours-z3-all", "ours", "deepcompile ZeRO-3 + every registered pass", passes=ALL),
    System("ours-z3-auto", "ours", "deepcompile ZeRO-3, passes chosen by the pipeline (the "
           "default: passes='auto')", passes=AUTO),
    System("ours-z1-auto", "ours", "deepcompile ZeRO-1, passes chosen by the pipeline (the "
           "default: passes='auto')", stage=1, passes=AUTO),
    # (explicit: a system's passes replace Config's per-stage default, which is bucket_reduce
    # at stages 1/2)
    System("ours-z1", "ours", "deepcompile ZeRO-1 (optimizer state sharded) + bucket_reduce "
           "(its default)", stage=1, passes=("bucket_reduce",)),
    System("fsdp2", "fsdp2", "PyTorch FSDP2 (fully_shard per decoder layer, then root), eager"),
    System("fsdp2-compile", "fsdp2", "FSDP2 with each decoder layer torch.compile'd before "
           "sharding (the torchtitan recipe)", compile=True),
    System("ddp", "ddp", "PyTorch DistributedDataParallel, eager (no_sync while accumulating)"),
    System("ddp-compile", "ddp", "torch.compile(DistributedDataParallel(model))", compile=True),
    System("ds-z3", "deepspeed", "DeepSpeed ZeRO-3, eager"),
    System("ds-z3-compile", "deepspeed", "DeepSpeed ZeRO-3 with engine.compile()", compile=True),
    System("ds-z1", "deepspeed", "DeepSpeed ZeRO-1, eager", stage=1),
    System("ds-deepcompile", "deepspeed", "DeepSpeed's own DeepCompile (ZeRO-3, "
           "compile.deepcompile=true, engine.compile())", compile=True, deepcompile=True),
    System("compile-1proc", "compile", "single process, torch.compile, one rank's batch, no "
           "communication: the compute bound", compile=True, single_process=True),
)}

CPU_DEFAULT = ("ours-z3", "ours-z3+overlap", "ours-z3+overlap+unshard", "ours-z3-all",
               "ours-z3-auto", "ours-z1", "ours-z1-auto",
               "fsdp2", "fsdp2-compile", "ddp", "ds-z3", "ds-z3-compile", "ds-z1",
               "ds-deepcompile", "compile-1proc")
CUDA_DEFAULT = ("ours-z3", "ours-z3+overlap", "ours-z3-all", "ours-z3-auto", "fsdp2",
                "fsdp2-compile", "ds-z3",
                "ds-deepcompile", "compile-1proc")

# The committed CPU result set (`deepcompile bench` with no --workloads/--systems): every system
# on the tiny Llama; ours' whole ladder against the main peers with 4 accumulation steps (where
# selective unsharding and accumulation interact); the strongest of ours against the main peers
# on the larger Llama and on the MoE; ZeRO-1 against DeepSpeed ZeRO-1 and DDP at batch 1. About
# 45 minutes for 5 launches on 2 quiet cores.
_MAIN_PEERS = ("fsdp2", "ddp", "ds-z3", "compile-1proc")
CPU_MATRIX: dict[str, tuple[str, ...]] = {
    "tiny-llama": CPU_DEFAULT,
    "tiny-llama-gas4": ("ours-z3", "ours-z3+overlap", "ours-z3+overlap+unshard", "ours-z3-all",
                        "ours-z3-auto", "ours-z1", "ours-z1-auto", "fsdp2", "fsdp2-compile",
                        "ddp", "ds-z3", "ds-z1", "compile-1proc"),
    "small-llama": ("ours-z3-all", "ours-z3-auto") + _MAIN_PEERS,
    "tiny-mixtral": ("ours-z3-all", "ours-z3-auto") + _MAIN_PEERS,
    "tiny-llama-b1": ("ours-z1", "ours-z1-auto", "ds-z1", "ddp"),
}
CUDA_MATRIX: dict[str, tuple[str, ...]] = {"llama-1b": CUDA_DEFAULT}


def matrix(device: str, workloads: tuple[str, ...] | None,
           systems: tuple[str, ...] | None) -> dict[str, tuple[str, ...]]:
    """Which systems run on which workload: the committed set for `device`, or `systems` on
    every one of `workloads` (each defaulting to the committed set's)."""
    base = CUDA_MATRIX if device == "cuda" else CPU_MATRIX
    default = CUDA_DEFAULT if device == "cuda" else CPU_DEFAULT
    names = workloads or tuple(base)
    return {w: tuple(systems) if systems else base.get(w, default) for w in names}


def get(name: str) -> System:
    if name not in SYSTEMS:
        raise ValueError(f"unknown system {name!r}; known: {', '.join(SYSTEMS)}")
    return SYSTEMS[name]


def resolved_passes(system: System) -> tuple[str, ...] | str:
    from ...passes import known_passes

    if system.passes == AUTO:
        return AUTO
    if system.passes != ALL:
        return tuple(system.passes)
    known = known_passes()
    return tuple(p for p in CANONICAL_PASS_ORDER if p in known) + \
        tuple(p for p in known if p not in CANONICAL_PASS_ORDER)


def ours_config(system: System, *, compiler: str, gas: int, dtype: str) -> dict[str, Any]:
    """The Config (as a dict) of an "ours" system for a workload."""
    cfg: dict[str, Any] = {"zero_stage": system.stage, "passes": resolved_passes(system),
                           "compiler": compiler, "gradient_accumulation_steps": gas}
    if dtype != "float32":
        cfg["param_dtype"] = dtype
    return cfg


def deepspeed_version() -> str | None:
    try:
        if importlib.util.find_spec("deepspeed") is None:
            return None
    except (ImportError, ValueError):  # a broken or blocked install
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("deepspeed")
    except PackageNotFoundError:
        return "unknown"


def unavailable(system: System, device: str, compiler: str) -> str | None:
    """Why `system` cannot run here (a line for the table), or None when it can."""
    if system.kind == "ours":
        from ...config import Config

        try:
            Config(**ours_config(system, compiler=compiler, gas=1, dtype="float32"))
        except ValueError as e:
            return f"not available in this build: {e}"
        return None
    if system.kind == "deepspeed":
        if system.deepcompile and device != "cuda":
            return ("needs CUDA: DeepSpeed's DeepCompile runs its own CUDA/NCCL C++ ops "
                    "(run the GPU mode: --device cuda)")
        if deepspeed_version() is None:
            return f"not installed: DeepSpeed is an optional extra, {DS_INSTALL}"
    return None


def same_as(system: System, earlier: list[System], compiler: str) -> str | None:
    """The name of an earlier "ours" system with the same configuration, if any."""
    if system.kind != "ours":
        return None
    mine = ours_config(system, compiler=compiler, gas=1, dtype="float32")
    for other in earlier:
        if other.kind == "ours" and \
                ours_config(other, compiler=compiler, gas=1, dtype="float32") == mine:
            return other.name
    return None
