"""The `activation_budget` pass at scale: its own planner on the composed graphs.

[Note: activations at scale] deepcompile compiles the model into one forward and one backward
graph, so the pass plans one pair. Its candidates are found as the pass finds them
(`activation_budget.analyse`: the saved values it may drop, each one's recompute chain, time,
intermediates and FLOPs), in each piece's traced graphs (the embedding's, the layer's, the
head's: trace.py) with the nodes timed as composed, and repeated for every block the piece makes
(the composed graphs' node names, `F<block>.` and `B<block>.`). `plan_pair` then chooses among
them on the profile of the plan so far (`Plan.profile`: the passes before it included), under the
memory budget, with the cost model's host<->device copy time; a GPU's copies overlap compute
(its copy streams), a CPU rank's are exposed, as the runtime's pass decides. The choices enter
the plan (`Plan.acts`, `ActMove`): in memory, a value leaves the device after its last forward
reader and is held again from its recompute (right before its first backward reader) or from
its copy back's start to its last backward reader; in time, a recompute runs its nodes' time on
the compute lane, an offload's copies run on the "d2h" and "h2d" lanes (the runtime's copy
streams, which the optimizer offload shares) and the first reader waits for the copy back.

What differs from a run: the pass's curve keeps the backward's inputs to the end of the
backward (the runtime profiler's model) where compose frees a value after its last reader, so
the pass may count on memory a choice frees after the last reader that the planner's curve had
freed already: the simulated peak, not the pass's prediction, is the plan's. Both run the
copies one after another on their lane ([Note: one copy lane each way] in the pass, with the
optimizer offload's state reloads, `Plan.reloads`, on the same host-to-device lane); the pass
replays them on its profile's compute, the simulation on the plan's whole timeline (a copy
back, in both, after its own copy out). A piece's inputs (the hidden states between layers) are
no candidates here (the runtime's one graph could move them too), and with `ac` (every layer
checkpointed) the layers save nothing: only the embedding's and the head's values are
candidates.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import fx

from ...passes import activation_budget
from ...passes._common import Step
from ...runtime import ops
from .ours_model import ActMove, Plan
from .trace import PieceGraphs


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A saved value of the composed graphs (`activation_budget.Activation` at node indices of
    `Model.fw` / `Model.bw`) and the matrix-multiply FLOPs of its recompute."""
    act: activation_budget.Activation
    flops: int


def candidates(plan: Plan) -> list[Candidate]:
    """Every saved value the pass may drop, per block, at composed node indices."""
    model = plan.model
    graphs = model.graphs
    if graphs is None:
        return []
    fw_at = {n.name: i for i, n in enumerate(model.fw.nodes)}
    bw_at = {n.name: i for i, n in enumerate(model.bw.nodes)}
    blocks = {"embed": [0], "layer": [] if model.ac else list(range(1, model.layers + 1)),
              "head": [model.layers + 1]}
    out = []
    for piece, pg in graphs.items():
        if not blocks.get(piece):
            continue
        first = blocks[piece][0]
        fw_gm, bw_gm = _gathered(pg)
        fw_nodes, bw_nodes = _nodes(fw_gm), _nodes(bw_gm)
        fw_steps = [Step(n.name, "compute", _time(model.fw, fw_at, f"F{first}.{n.name}"), 0)
                    for n in fw_nodes]
        bw_steps = [Step(n.name, "compute", _time(model.bw, bw_at, f"B{first}.{n.name}"), 0)
                    for n in bw_nodes]
        # a gathered parameter counts nothing, as in compose's activations
        out_bytes = {n.name: 0 if n.target is ops.ALLGATHER else _nbytes(n.meta.get("val"))
                     for n in fw_nodes}
        pair = activation_budget.analyse("fw", "bw", fw_gm, bw_gm, fw_steps, bw_steps, out_bytes)
        for b in blocks[piece]:
            for a in pair.acts:
                out.append(Candidate(dataclasses.replace(
                    a, name=f"F{b}.{a.name}",
                    fw_free=fw_at[f"F{b}.{fw_nodes[a.fw_free].name}"],
                    bw_first=bw_at[f"B{b}.{bw_nodes[a.bw_first].name}"],
                    bw_last=bw_at[f"B{b}.{bw_nodes[a.bw_last].name}"],
                    leaves=tuple(f"F{b}.{x}" for x in a.leaves)), pair.flops.get(a.name, 0)))
    return out


def _gathered(pg: PieceGraphs) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Copies of a piece's graphs as deepcompile's insertion leaves them for the pass: the
    forward reads each parameter through a gather, and the backward receives the shard (the
    backend tags gathers MUST_RECOMPUTE: trace.py), so a recompute may gather it again. The
    gathers are never run; the saved outputs stay as traced."""
    fw, bw = fx.Graph(), fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out = fw.graph_copy(pg.fw.graph, env)
    fw.output(out)
    params = [n for n in pg.fw.graph.nodes if n.op == "placeholder"][:pg.n_params]
    last = [n for n in fw.nodes if n.op == "placeholder"][-1]
    for p in params:
        q = env[p]
        with fw.inserting_after(last):
            g = fw.call_function(ops.ALLGATHER, (q,))
        g.meta["val"] = q.meta.get("val")
        q.replace_all_uses_with(g, delete_user_cb=lambda u: u is not g and u.op != "output")
    env = {}
    out = bw.graph_copy(pg.bw.graph, env)
    bw.output(out)
    have = {n.name for n in bw.nodes if n.op == "placeholder"}
    first = next(n for n in bw.nodes if n.op != "placeholder")
    for p in params:
        if p.name not in have:
            with bw.inserting_before(first):
                bw.placeholder(p.name)
    return fx.GraphModule(pg.fw, fw), fx.GraphModule(pg.bw, bw)


def _time(graph, at: dict[str, int], name: str) -> float:
    """A composed node's time; a gather's is none here (the schedule times the gathers)."""
    return graph.nodes[at[name]].time_s if name in at else 0.0


def _nodes(gm) -> list:
    return [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]


def _nbytes(val) -> int:
    vals = val if isinstance(val, (list, tuple)) else [val]
    return sum(v.numel() * v.element_size() for v in vals if isinstance(v, torch.Tensor))


def plan_activations(plan: Plan, target: float | None = None) -> dict[str, Any]:
    """The pass's decisions on the plan so far (the module docstring), applied to `plan.acts`;
    `target`: the peak to plan to, below the budget (a trade: `ours_passes`), else the budget."""
    s = plan.s
    if s.budget == float("inf"):
        return {"skipped": "memory budget unbounded: every saved activation stays"}
    # a plan replaces the one before it (a trade plans to several targets in turn): it is made
    # on the curve without any of this pass's moves, as the runtime's pass plans on the graphs
    # as partitioned
    plan.acts = []
    cands = candidates(plan)
    fw_steps, fw_items, _ = plan.profile("fw")
    bw_steps, bw_items, _ = plan.profile("bw")
    fw_step = {it.ref: j for j, it in enumerate(fw_items) if it.kind == "compute"}
    bw_step = {it.ref: j for j, it in enumerate(bw_items) if it.kind == "compute"}
    acts = [dataclasses.replace(c.act, fw_free=fw_step[c.act.fw_free],
                                bw_first=bw_step[c.act.bw_first], bw_last=bw_step[c.act.bw_last])
            for c in cands]
    busy = tuple(("bw", bw_step[after], sec) for after, _, sec in plan.reloads
                 if after in bw_step)   # the optimizer offload's state reloads
    d = activation_budget.plan_pair(fw_steps, bw_steps, acts,
                                    s.budget if target is None else target, s.planner_cost.copy_s,
                                    overlap=not s.host_is_compute, lane_busy=busy)
    node_at, node = [], -1   # per backward step: the last node at or before it
    for it in bw_items:
        node = it.ref if it.kind == "compute" else node
        node_at.append(node)
    step_of = {st.name: j for j, st in enumerate(bw_steps)}
    by_name = {c.act.name: c for c in cands}
    plan.acts = []
    for choice in d["choices"]:
        c = by_name[choice["name"]]
        a = c.act
        if choice["action"] == "recompute":
            plan.acts.append(ActMove(a.name, "recompute", a.nbytes, a.fw_free, a.bw_first,
                                     a.bw_last, None, a.recompute_s, a.recompute_bytes))
        else:
            after = choice["reload_after"]
            plan.acts.append(ActMove(a.name, "offload", a.nbytes, a.fw_free, a.bw_first,
                                     a.bw_last, -1 if after is None else node_at[step_of[after]],
                                     s.cost.copy_s(a.nbytes)))
    rec = [c for c in d["choices"] if c["action"] == "recompute"]
    off = [c for c in d["choices"] if c["action"] == "offload"]
    return {k: d[k] for k in ("budget_bytes", "peak_before", "peak_after", "candidates",
                              "candidate_bytes", "unattainable")} | {
        "recomputed": len(rec), "recomputed_bytes": sum(c["bytes"] for c in rec),
        "offloaded": len(off), "offloaded_bytes": sum(c["bytes"] for c in off),
        "recompute_s": d.get("recompute_s", 0.0), "added_s": d.get("added_s", 0.0),
        "copy_wait_s": d.get("copy_wait_s", 0.0),
        "recompute_flops": float(sum(by_name[c["name"]].flops for c in rec)),
        "host_bytes": d.get("host_bytes", 0)}
