"""Graph families: one plan for every shape of a graph, on every rank; one family per structure.

[Note: shape families] Dynamo compiles a frame again when an input's shape changes (the second
time as a graph with dynamic sizes). With ragged data that happens on some ranks and not others,
at any step. The collectives a graph issues depend only on the parameters it uses (a gather or a
reduce-scatter has the parameter's size), never on the activations' shapes; what must not happen
is one rank running a *planned* graph (fused, prefetched, bucketed, kept...) while another runs
the insertion-only graph of the new shape. So:

* a *family* is every graph Dynamo compiles from one frame (code object) with one parameter
  tuple and one structure ([Note: graph structure]); its first graph of each kind (forward,
  backward, inference) is the family's *representative*: the one profiled, planned, agreed
  across ranks and keyed `g<i>.<kind>` (the family index `i` counts families in order of
  appearance, the same on every rank);
* every later graph of the kind (a *member*: another shape, or a recompilation for any other
  reason with the same parameters and structure) runs the representative's plan, transplanted
  onto its own nodes (`transplant`): the markers the passes placed in the representative are
  placed at the corresponding nodes of the member, and the member's collective sequence is
  checked equal to the representative's (kind, parameters, order), or the transplant fails
  loudly;
* a member's profile runs count as runs of its representative (`fold_to_rep`), so profiles,
  plans and the order of graphs in a step stay the same on every rank however the shapes vary.

Whichever member a rank runs, it issues its representative's collectives, which every rank
planned from the same agreed profiles: ranks never disagree on what to issue. A member needs no
agreement with the other ranks; a new representative does ([Note: new graphs are agreed] in
runtime/divergence.py).

The transplant reads three graphs: the representative as compiled (`original`, kept before any
pass ran), as planned (its current graph), and the member as compiled. Compute nodes of the two
compiled graphs are matched by a sequence alignment of their ops (a graph with dynamic sizes has
extra size nodes and keeps a few slices a static graph folds away), communication nodes
exactly, in order. Marker nodes go before the member's node that corresponds to the next
compute node after them in the planned representative, so the overlap and memory the plan chose
carry over; the order is then made topologically valid, and the collective sequence is compared.

[Note: graph structure] A recompilation may also change what the graph computes, not only its
sizes: code after a graph break that reads data (`for _ in range(int(k.sum()))`, `if
int(k[0]) % 2:`) is compiled once per value, the loop unrolled, the branch taken: a graph over
the same parameters with other inputs (the unrolled backward saves more activations) and other
nodes. No plan carries over between two such graphs, so each structure is a family of its own,
inserted, profiled, planned and agreed like any new graph. The structure (`structure_digest`)
is what Dynamo's graph computes with the sizes left out: its tensor inputs, and each node's op
and the tensor nodes it reads, in order; the nodes a graph with dynamic sizes adds (symbolic
sizes, their arithmetic) and every constant argument are not part of it. So a recompilation for
a new shape, static or dynamic, keeps its family's structure (tests/distributed/test_ragged.py: Llama with
ragged lengths), and an unrolled loop or another branch does not. One frame over one parameter
tuple with several structures (`Structures`) may take a different one on each rank in the same
step (the data differ): from its second structure on, the ranks agree on the structure at every
call of its forward graphs, before the graph issues any collective ([Note: structures are
agreed at each call] in runtime/divergence.py).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import heapq
from typing import Callable

import torch
from torch import fx

from ..runtime import ops
from ..runtime.divergence import digest
from ..runtime.registry import lookup
from .profiler import GraphProfile, NodeProfile

_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)
_INSERTED = (ops.ALLGATHER, ops.REDUCE_GRAD)


class TransplantError(RuntimeError):
    """A member graph cannot run its representative's plan."""


# -- collective signatures --------------------------------------------------------------------------
def _is_comm(node: fx.Node) -> bool:
    return node.op == "call_function" and (node.target in ops.COMM_KINDS
                                            or node.target in ops.MARKERS)


def _pids(node: fx.Node) -> tuple[int, ...]:
    p = node.args[1] if len(node.args) > 1 else None
    if isinstance(p, (list, tuple)):
        return tuple(int(x) for x in p)
    return (int(p),) if isinstance(p, int) else ()


def _name(pid: int) -> str:
    try:
        return lookup(pid).name
    except RuntimeError:
        return f"pid{pid}"


def _target(node: fx.Node) -> str:
    t = node.target
    name = getattr(t, "__name__", None) or str(t)
    return name[:-len(".default")] if name.endswith(".default") else name


def comm_signature(gm: fx.GraphModule) -> list[tuple[str, tuple[str, ...]]]:
    """The graph's communication nodes in order: (op, parameter names). Two graphs with the same
    signature issue the same collectives in the same order (sizes are the parameters')."""
    return [(_target(n), tuple(_name(p) for p in _pids(n)))
            for n in gm.graph.nodes if _is_comm(n)]


def comm_digest(gm: fx.GraphModule, last: bool) -> int:
    """The digest of what one run of the lowered graph issues ([Note: divergence check])."""
    return digest(repr((last, comm_signature(gm))))


def describe(gm: fx.GraphModule, limit: int = 6) -> str:
    """A short account of a graph's collectives, for error messages."""
    sig = comm_signature(gm)
    if not sig:
        return "no collectives"
    parts = [f"{op}({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
             for op, names in sig[:limit]]
    more = f" and {len(sig) - limit} more" if len(sig) > limit else ""
    return f"{len(sig)} communication ops: " + ", ".join(parts) + more


def snapshot(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of `gm` whose graph the passes will not touch (same node names; metadata shared)."""
    return fx.GraphModule(gm, copy.deepcopy(gm.graph))


# -- structure --------------------------------------------------------------------------------------
_SIZES = (*_SYMBOLIC, int, float, bool, torch.Size)


def _is_size(value) -> bool:
    """A size or a tuple of sizes: what a graph with dynamic sizes computes besides tensors."""
    if isinstance(value, _SIZES):
        return True
    return isinstance(value, (tuple, list)) and bool(value) and all(map(_is_size, value))


def structure_digest(gm: fx.GraphModule) -> int:
    """The digest of what Dynamo's graph `gm` computes, sizes and constants left out ([Note:
    graph structure]): stable across processes, the same for every shape of one structure."""
    index: dict[fx.Node, int] = {}
    rows: list[tuple] = []
    for node in gm.graph.nodes:
        if node.op != "output" and _is_size(node.meta.get("example_value", node.meta.get("val"))):
            continue
        reads: list[int] = []
        fx.node.map_arg((node.args, node.kwargs),
                        lambda a: reads.append(index[a]) if a in index else None)
        rows.append((node.op, "" if node.op == "placeholder" else _target(node), tuple(reads)))
        index[node] = len(index)
    return digest(repr(rows))


@dataclasses.dataclass(eq=False)
class Structures:
    """The families of one frame over one parameter tuple, one per structure ([Note: graph
    structure]), in order of appearance; `checked`: the ranks agree on the structure at calls
    of their graphs (from the second structure on)."""
    families: list[int] = dataclasses.field(default_factory=list)
    checked: bool = False


# -- transplant -------------------------------------------------------------------------------------
def _symbolic(node: fx.Node) -> bool:
    v = node.meta.get("val", node.meta.get("example_value"))
    return isinstance(v, _SYMBOLIC)


def _correspond(s0: fx.Graph, n0: fx.Graph) -> dict[fx.Node, fx.Node]:
    """Representative-as-compiled node -> member-as-compiled node."""
    corr: dict[fx.Node, fx.Node] = {}
    sp = [n for n in s0.nodes if n.op == "placeholder" and not _symbolic(n)]
    npl = [n for n in n0.nodes if n.op == "placeholder" and not _symbolic(n)]
    if len(sp) != len(npl):
        raise TransplantError(f"the graphs take {len(sp)} and {len(npl)} tensor inputs")
    corr.update(zip(sp, npl))
    sc = [n for n in s0.nodes if n.op == "call_function" and n.target in _INSERTED]
    nc = [n for n in n0.nodes if n.op == "call_function" and n.target in _INSERTED]
    if [(n.target, n.args[1]) for n in sc] != [(n.target, n.args[1]) for n in nc]:
        raise TransplantError("the graphs gather or reduce other parameters, or in another order")
    corr.update(zip(sc, nc))

    def rest(g: fx.Graph) -> list[fx.Node]:
        return [n for n in g.nodes if n.op not in ("placeholder", "output")
                and not (n.op == "call_function" and n.target in _INSERTED) and not _symbolic(n)]

    rs, rn = rest(s0), rest(n0)
    key: Callable[[fx.Node], tuple] = lambda n: (n.op, str(n.target))
    matcher = difflib.SequenceMatcher(None, [key(n) for n in rs], [key(n) for n in rn],
                                      autojunk=False)
    for a, b, size in matcher.get_matching_blocks():
        for k in range(size):
            corr[rs[a + k]] = rn[b + k]
    corr[next(n for n in s0.nodes if n.op == "output")] = next(n for n in n0.nodes if n.op == "output")
    return corr


def _same_shapes(s0: fx.Graph, n0: fx.Graph) -> bool:
    """The two graphs take inputs of the same static shapes."""
    def shapes(g: fx.Graph) -> list:
        return [tuple(v.shape) if isinstance(v := n.meta.get("val"), torch.Tensor) else repr(v)
                for n in g.nodes if n.op == "placeholder"]
    a, b = shapes(s0), shapes(n0)
    return a == b and not any(isinstance(d, torch.SymInt) for t in a if isinstance(t, tuple)
                              for d in t)


def _resolvable(resolve: Callable[[fx.Node], tuple], node: fx.Node) -> bool:
    try:
        resolve(node)
    except TransplantError:
        return False
    return True


def _flat(args) -> list:
    out: list = []
    fx.node.map_aggregate(args, out.append)
    return out


def transplant(rep_original: fx.GraphModule, rep_planned: fx.GraphModule,
               member_original: fx.GraphModule) -> tuple[fx.GraphModule, dict[str, str]]:
    """The member's graph with the representative's plan, and {member node: representative
    node} for the nodes that correspond (see [Note: shape families])."""
    s0, star, n0 = rep_original.graph, rep_planned.graph, member_original.graph
    corr = _correspond(s0, n0)
    bound = [p.name for p in star.nodes if p.meta.get("dc_shape_bound")]
    if bound and not _same_shapes(s0, n0):
        raise TransplantError(f"the plan computes {bound[0]} with the representative's shapes "
                              "(activation_budget's recompute), and the member's differ")
    s0_by_name = {n.name: n for n in s0.nodes}
    star_by_name = {n.name: n for n in star.nodes}
    orig = {n: s0_by_name[n.name] for n in star.nodes if n.name in s0_by_name}   # planned -> compiled
    # compiled representative nodes the passes erased -> the planned node that took their uses
    replaced: dict[fx.Node, fx.Node] = {}
    for x in s0.nodes:
        if x.name in star_by_name:
            continue
        for u in x.users:
            u_star = star_by_name.get(u.name)
            if u_star is None:
                continue
            a0, a1 = _flat((u.args, u.kwargs)), _flat((u_star.args, u_star.kwargs))
            if len(a0) == len(a1):
                hit = next((q for p, q in zip(a0, a1) if p is x), None)
                if hit is not None:
                    replaced[x] = hit
                    break
    # communication nodes of the compiled representative that are still in the plan: the member
    # runs the planned version of each (a kept parameter, an accumulated gradient)
    comm_kept = {corr[s]: p for p, s in orig.items() if s in corr and _is_comm(s)}
    erased = {corr[x]: x for x in s0.nodes if x.name not in star_by_name and x in corr}

    def item_of_member(a: fx.Node) -> tuple:
        x = erased.get(a)
        if x is not None:
            r = replaced.get(x)
            if r is None:
                raise TransplantError(f"{x.name} was removed by a pass with nothing in its place")
            return item_of_plan(r)
        p = comm_kept.get(a)
        return ("p", p) if p is not None else ("m", a)

    def item_of_plan(a: fx.Node) -> tuple:
        s = orig.get(a)
        if s is None or _is_comm(s):
            return ("p", a)
        m = corr.get(s)
        if m is None:
            raise TransplantError(f"the planned graph reads {a.name}, which the member lacks")
        return item_of_member(m)

    # an op that a node only orders (ops.ORDER_ONLY) follows the node before it where the member
    # lacks that node (a shape-dependent decomposition: an `alias` one shape has and another not)
    order_sub: dict[fx.Node, fx.Node] = {}
    for p in star.nodes:
        if p.op != "call_function" or p.target not in ops.ORDER_ONLY or not p.args:
            continue
        after = p.args[0]
        if not isinstance(after, fx.Node) or _resolvable(item_of_plan, after):
            continue
        q = after.prev
        while q.op != "root" and not (isinstance(q.meta.get("val"), torch.Tensor)
                                      and _resolvable(item_of_plan, q)):
            q = q.prev
        if q.op == "root":
            raise TransplantError(f"{p.name} is ordered after {after.name}, which the member "
                                  "lacks, and nothing before it has a place in the member")
        order_sub[p] = q

    def resolver(it: tuple) -> Callable[[fx.Node], tuple]:
        kind, node = it
        if kind == "m":
            return item_of_member
        sub = order_sub.get(node)
        if sub is None:
            return item_of_plan
        after = node.args[0]
        return lambda a: item_of_plan(sub if a is after else a)

    # the intended order: the member's nodes, each planned marker before the member's node that
    # corresponds to the next compiled node after it in the plan
    anchored: dict[fx.Node, list[fx.Node]] = {}
    pending: list[fx.Node] = []
    for p in star.nodes:
        s = orig.get(p)
        anchor = corr.get(s) if s is not None else None
        if anchor is None:
            if s is None:
                pending.append(p)
            continue
        if pending:
            anchored.setdefault(anchor, []).extend(pending)
            pending = []
    items: list[tuple] = []
    for m in n0.nodes:
        items.extend(("p", p) for p in anchored.get(m, ()))
        if m in erased:
            continue
        p = comm_kept.get(m)
        items.append(("p", p) if p is not None else ("m", m))
    index = {it: i for i, it in enumerate(items)}
    # uses the plan moved to a node of its own while the node they used stays (activation_budget:
    # a saved value's readers read it back from the host or recomputed; the forward returns a
    # host buffer or an empty tensor in its place): the member's node moves them alike (by
    # value: a graph with symbolic sizes has more arguments, the sizes it saves)
    moved: dict[fx.Node, dict[fx.Node, fx.Node]] = {}
    for x in s0.nodes:
        x_star, m = star_by_name.get(x.name), corr.get(x)
        if x_star is None or m is None:
            continue
        a0, a1 = _flat((x.args, x.kwargs)), _flat((x_star.args, x_star.kwargs))
        subs = {corr.get(a): b for a, b in zip(a0, a1)
                if isinstance(a, fx.Node) and isinstance(b, fx.Node) and a.name in star_by_name
                and a.name != b.name and orig.get(b) is None}
        if not subs:
            continue
        if len(a0) != len(a1) or None in subs:
            raise TransplantError(f"the plan moved what {x.name} reads, which the member's "
                                  f"{m.name} lacks")
        moved[m] = subs

    def deps(it: tuple) -> list[tuple]:
        resolve = resolver(it)
        subs = moved.get(it[1], {}) if it[0] == "m" else {}
        return [resolve(a) for a in _flat((it[1].args, it[1].kwargs)) if isinstance(a, fx.Node)] \
            + [("p", b) for b in subs.values()]

    # a stable topological order (the intended order wherever the dependencies allow it)
    waiting = {it: set(deps(it)) for it in items}
    for it, ds in waiting.items():
        missing = [d for d in ds if d not in index]
        if missing:
            raise TransplantError(f"{it[1].name} reads {missing[0][1].name}, which has no place "
                                  "in the member")
    users: dict[tuple, list[tuple]] = {}
    for it, ds in waiting.items():
        for d in ds:
            users.setdefault(d, []).append(it)
    ready = [index[it] for it, ds in waiting.items() if not ds]
    heapq.heapify(ready)
    graph = fx.Graph()
    new: dict[tuple, fx.Node] = {}
    to_rep: dict[str, str] = {}
    inv = {m: s for s, m in corr.items()}
    while ready:
        it = items[heapq.heappop(ready)]
        kind, node = it
        subs = moved.get(node, {}) if kind == "m" else {}
        made = graph.node_copy(node, lambda a, r=resolver(it), subs=subs:
                               new[("p", subs[a])] if a in subs else new[r(a)])
        new[it] = made
        if kind == "p":
            to_rep[made.name] = node.name
        else:
            s = inv.get(node)
            if s is not None and s.name in star_by_name:
                to_rep[made.name] = s.name
        for u in users.get(it, ()):
            ds = waiting[u]
            ds.discard(it)
            if not ds:
                heapq.heappush(ready, index[u])
    if len(new) != len(items):
        raise TransplantError("the plan's markers cannot be ordered within the member")
    graph.lint()
    out = fx.GraphModule(member_original, graph)
    if comm_signature(out) != comm_signature(rep_planned):
        raise TransplantError("the member would issue other collectives than its representative")
    return out, to_rep


# -- profiles ---------------------------------------------------------------------------------------
def fold_to_rep(prof: GraphProfile, to_rep: dict[str, str], rep: fx.GraphModule,
                name_of: Callable[[int], str]) -> GraphProfile:
    """A member's profile (per node of its planned graph) as a run of its representative."""
    from .lower import _param_of, _target_name

    by = {to_rep[n.name]: n for n in prof.nodes if n.name in to_rep}
    nodes, live, clock = [], 0, 0.0
    for node in rep.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        rec = by.get(node.name)
        if rec is not None:
            live, clock = rec.live_bytes, rec.start_s
        kind = ops.COMM_KINDS.get(node.target, "compute") if node.op == "call_function" else "compute"
        nodes.append(NodeProfile(
            name=node.name, op=_target_name(node), kind=kind,
            param=_param_of(node, name_of) if kind != "compute" else None,
            time_s=rec.time_s if rec is not None else 0.0, start_s=clock,
            out_bytes=rec.out_bytes if rec is not None else 0, live_bytes=live))
    return GraphProfile(slot=prof.slot, version=prof.version, nodes=nodes, total_s=prof.total_s,
                        launched=prof.launched)
