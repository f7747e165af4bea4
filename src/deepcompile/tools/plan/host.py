"""A host profile: what `deepcompile plan --gpu cpu` plans with in place of a GPU's roofline.

A CPU rank has no datasheet: its node times, optimizer step, framework time and network are
measured, at the plan's world size, batch and sequence length, by the validation harness
(benchmarks/validation/host_profile.py, which spawns the gloo ranks and runs deepcompile on
them), and saved as JSON. The planner only reads the file (`load`), so a plan for this machine
is as repeatable as a plan for a GPU, and the planner measures nothing.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path
from typing import Any

from ...compiler.cost import LinearCostModel
from .network import Measured
from .roofline import NodeCost

FORMAT = "deepcompile-host-profile"
VERSION = 1
HARNESS = "benchmarks/validation/host_profile.py"


class ProfileError(ValueError):
    """No host profile, or not one for this plan (the message says how to measure one)."""


def command(model: str, world: int, batch: int, seq: int, out: str = "host.json") -> str:
    """The command that measures a profile for these figures (in a source checkout)."""
    return shlex.join(["python", HARNESS, "--model", model, "--world", str(world),
                       "--batch", str(batch), "--seq", str(seq), "--out", out])


@dataclasses.dataclass
class HostProfile:
    model: str                               # as `deepcompile plan --model` names it
    world: int                               # gloo ranks
    batch: int                               # sequences per rank per micro-step
    seq: int                                 # tokens per sequence
    node_s: dict[str, dict[str, float]]      # "piece.phase" -> node name -> seconds
    optimizer_s: float                       # ours: the flat AdamW step + engine.step's own time
    peer_optimizer_s: float                  # the peers: per-parameter AdamW + the same
    framework_s: float                       # per micro-step, the framework's time outside
                                             # the graphs (and what the composed pieces miss)
    framework_async_s: float | None          # the same with asynchronous collectives (N ranks)
    network: Measured
    copy_bw: float                           # host memory copy, bytes/s (read + write once)
    plan_cost: LinearCostModel | None = None  # what the runtime's calibration gives its
                                             # passes to plan with; None: `network`
    record: dict[str, Any] = dataclasses.field(default_factory=dict)   # the harness's own
                                             # figures and checks, printed with a plan

    def times(self, piece: str, phase: str) -> dict[str, NodeCost]:
        return {n: NodeCost(t, 0.0, 1) for n, t in self.node_s[f"{piece}.{phase}"].items()}

    def summary(self) -> dict[str, Any]:
        """What a plan prints of it: every figure but the per-node times (their sums)."""
        d = self.to_dict()
        del d["node_s"], d["format"], d["version"]
        return {**d, "graph_s": {k: sum(v.values()) for k, v in self.node_s.items()}}

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["network"] = self.network.to_dict()
        d["plan_cost"] = self.plan_cost.to_dict() if self.plan_cost is not None else None
        return {"format": FORMAT, "version": VERSION, **d}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HostProfile:
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in fields} | {
            "network": Measured.from_dict(d["network"]),
            "plan_cost": LinearCostModel.from_dict(d["plan_cost"]) if d.get("plan_cost")
            else None})

    def check(self, model: str, world: int, batch: int, seq: int, where: str) -> None:
        """A `ProfileError` (naming the command that measures the right one) where this
        profile was measured for another model, world size, batch or sequence length."""
        got = (self.model, self.world, self.batch, self.seq)
        want = (model, world, batch, seq)
        if got != want:
            raise ProfileError(
                f"deepcompile plan: the host profile {where} was measured for {self.model} at "
                f"{self.world} rank(s), batch {self.batch}, seq {self.seq}; this plan is for "
                f"{model} at {world}, batch {batch}, seq {seq}. Measure one with: "
                f"{command(model, world, batch, seq)}")

    def check_graphs(self, graphs, is_free) -> None:
        """Every node of the pieces' graphs that moves data has a measured time (the harness's
        ranks traced the same graphs: the same model, shapes and torch)."""
        for name, pg in graphs.items():
            for phase in ("fw", "bw"):
                got = self.node_s.get(f"{name}.{phase}", {})
                missing = [n.name for n in getattr(pg, phase).graph.nodes
                           if n.op == "call_function" and not is_free(n) and n.name not in got]
                if missing:
                    raise ProfileError(f"deepcompile plan: the host profile has no time for "
                                    f"{name}.{phase} nodes {missing[:5]}: it was measured on "
                                    "other graphs (another torch?); measure it again")


def load(path: str | Path) -> HostProfile:
    """The profile the harness wrote to `path`; a `ProfileError` where it cannot be read."""
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ProfileError(f"deepcompile plan: cannot read the host profile {path}: {e}") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT or d.get("version") != VERSION:
        raise ProfileError(f"deepcompile plan: {path} is not a host profile (format {FORMAT!r}, "
                        f"version {VERSION}) as {HARNESS} writes it")
    return HostProfile.from_dict(d)
