"""The full model's forward and backward graphs, composed from its pieces' graphs.

deepcompile compiles a model without graph breaks into one forward and one backward graph. The
planner builds them from the pieces (trace.py): the forward is the embedding's forward, then
`num_hidden_layers` copies of the layer's, then the head's; the backward is the head's backward,
the layers' in reverse order, then the embedding's. Every value is bound across pieces as the
model binds it: a layer's hidden-state input is the previous piece's output, the tensors a
piece's forward saves are its backward's inputs, a piece's input gradient is the previous
piece's tangent. Parameters are named per layer.

[Note: composed memory] Live bytes are computed over the whole micro-step (forward then
backward) with the profiler's CPU memory model (profiler.py, liveness.py): distinct storages
(views share their base's), each alive from the node that makes it to its last reader anywhere
in the step; what a forward saves is alive until its backward reads it. Parameters count zero
here: where and for how long a full parameter is alive is what a schedule decides
(schedules.py), and a gradient is consumed where the schedule reduces it (insertion: right
after it is complete). So `Node.live` is the activations and temporaries of the step only.

With activation checkpointing (`ac=True`, what the paper's runs used: each decoder layer
wrapped in `torch.utils.checkpoint`), a layer's forward keeps only its input, and its backward
first runs the layer's forward again (gathering its parameters once for both).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Callable

import torch
from torch import fx

from ...compiler.graph import is_alias_of_input
from .roofline import NodeCost
from .trace import PieceGraphs


@dataclasses.dataclass
class Param:
    pid: int
    name: str
    numel: int
    block: int            # the first block that uses it: 0 embedding, 1..L layers, L+1 head


@dataclasses.dataclass
class Node:
    name: str
    block: int
    time_s: float
    flops: float          # model FLOPs
    kernels: int          # device kernels (host launch cost); eager: ops
    live: int             # activation bytes alive after the node (parameters excluded)


@dataclasses.dataclass
class Use:
    """A parameter read in one graph: its first and last reading node."""
    pid: int
    first: int
    last: int


@dataclasses.dataclass
class Grad:
    """A parameter's gradient, complete after node `at` of the backward."""
    pid: int
    at: int
    nbytes: int
    partials: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (node, bytes)


@dataclasses.dataclass
class Graph:
    key: str              # "fw" or "bw"
    nodes: list[Node]
    uses: list[Use]       # by first use
    grads: list[Grad]     # by completion

    def compute_s(self) -> float:
        return sum(n.time_s for n in self.nodes)


@dataclasses.dataclass
class Model:
    name: str
    layers: int
    batch: int
    seq: int
    dtype: torch.dtype
    ac: bool
    params: list[Param]
    fw: Graph
    bw: Graph
    base_bytes: int       # token ids, labels, rotary tables: alive over the whole micro-step
    # the pieces' traced graphs it is composed of (trace.py; None: a model built otherwise),
    # where `activation_budget` finds its candidates (ours_activations.py)
    graphs: dict[str, PieceGraphs] | None = dataclasses.field(default=None, repr=False,
                                                               compare=False)

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    def tokens(self) -> int:
        return self.batch * self.seq

    def model_flops(self) -> float:
        """Useful FLOPs of one micro-step of one rank (recomputation excluded)."""
        fw = sum(n.flops for n in self.fw.nodes)
        return fw + sum(n.flops for n in self.bw.nodes if not n.name.startswith("R"))


Times = Callable[[str, str], dict[str, NodeCost]]   # (piece, "fw"|"bw") -> node name -> cost


def _val_roots(val) -> int:
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


class _Walk:
    """One micro-step's program: positions, storage roots, their sizes and last readers."""

    def __init__(self) -> None:
        self.size: dict[object, int] = {}
        self.made: dict[object, int] = {}
        self.last: dict[object, int] = {}
        self.param_reads: dict[tuple[str, int], list[int]] = {}   # (phase, pid) -> positions
        self.pos = 0

    def root(self, key, nbytes: int, at: int) -> tuple:
        self.size[key] = nbytes
        self.made[key] = at
        self.last.setdefault(key, at)
        return (key,)

    def read(self, roots: tuple, at: int, phase: str) -> None:
        for r in roots:
            if isinstance(r, tuple) and r[0] == "param":
                self.param_reads.setdefault((phase, r[1]), []).append(at)
            elif r in self.last:
                self.last[r] = max(self.last[r], at)

    def run(self, gm: fx.GraphModule, bind: list, phase: str, tag: str, block: int,
            nodes: list) -> tuple[list, list]:
        """Walk `gm` with its placeholders bound to `bind` (roots per input); returns the roots
        of its outputs and the position of the node each output is (None: an input or none).
        Appends (name, block, fx node) to `nodes`, one per position."""
        env: dict[fx.Node, object] = {}
        where: dict[fx.Node, int] = {}
        it = iter(bind)
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                env[node] = next(it)
                continue
            if node.op == "output":
                outs = list(node.args[0])
                return ([env[a] if isinstance(a, fx.Node) else () for a in outs],
                        [where.get(a) if isinstance(a, fx.Node) else None for a in outs])
            at = self.pos
            where[node] = at
            self.pos += 1
            nodes.append((f"{tag}.{node.name}", block, node))
            for a in node.all_input_nodes:
                self.read(_flat(env[a]), at, phase)
            env[node] = self._value(node, env, at, tag)
        raise RuntimeError("graph without an output node")

    def _value(self, node: fx.Node, env, at: int, tag: str):
        if node.op == "call_function" and node.target is operator.getitem:
            base = env[node.args[0]]
            return base[node.args[1]] if isinstance(base, list) else base
        if node.op == "call_function" and is_alias_of_input(node):
            base = env[node.args[0]]
            roots = _flat(base)
            val = node.meta.get("val")
            return [roots] * len(val) if isinstance(val, (list, tuple)) else roots
        val = node.meta.get("val")
        if isinstance(val, (list, tuple)):
            return [self.root((tag, node.name, i), _val_roots(v), at)
                    if isinstance(v, torch.Tensor) else () for i, v in enumerate(val)]
        if isinstance(val, torch.Tensor):
            return self.root((tag, node.name), _val_roots(val), at)
        return ()


def _flat(value) -> tuple:
    if isinstance(value, list):
        return tuple(r for v in value for r in v)
    return value


def compose(graphs: dict[str, PieceGraphs], layers: int, times: Times, *, name: str,
            batch: int, seq: int, dtype: torch.dtype, ac: bool = False) -> Model:
    """The model's forward and backward graphs (see the module docstring)."""
    emb, lay, head = graphs["embed"], graphs["layer"], graphs["head"]
    walk = _Walk()
    params: dict[str, Param] = {}

    def pid_of(template: str, numel: int, block: int, i: int | None) -> tuple:
        name = template.format(i=i) if i is not None else template
        if name not in params:
            params[name] = Param(len(params), name, numel, block)
        return (("param", params[name].pid),)

    def param_roots(pg: PieceGraphs, block: int, i: int | None) -> list:
        return [pid_of(n, p.numel(), block, i)
                for n, p in zip(pg.piece.param_names, pg.piece.params)]

    glob = {}
    for role, piece in (("ids", emb.piece), ("cos", lay.piece), ("sin", lay.piece),
                        ("labels", head.piece)):
        t = piece.inputs[piece.input_roles.index(role)]
        glob[role] = walk.root(("global", role), _val_roots(t), -1)
    glob["loss_tangent"] = ()

    def inputs_of(pg: PieceGraphs, hidden) -> list:
        return [hidden if r == "hidden" else glob[r] for r in pg.piece.input_roles]

    fw_nodes: list = []
    bw_nodes: list = []
    # forward
    blocks = [(emb, 0, None)] + [(lay, 1 + i, i) for i in range(layers)] + \
        [(head, layers + 1, None)]
    saved: dict[int, list] = {}
    layer_input: dict[int, tuple] = {}
    hidden = ()
    for pg, block, i in blocks:
        tag = f"F{block}"
        outs, _ = walk.run(pg.fw, param_roots(pg, block, i) + inputs_of(pg, hidden), "fw", tag,
                           block, fw_nodes)
        if pg is lay:
            layer_input[block] = hidden
        saved[block] = outs[pg.n_outputs:]
        hidden = outs[0]
    fw_end = walk.pos - 1
    walk.read(_flat(hidden), fw_end, "fw")          # the loss, returned by the forward
    if ac:   # checkpointed layers keep nothing of their forward
        for block in range(1, layers + 1):
            saved[block] = None
    # backward
    tangent = glob["loss_tangent"]
    grads: dict[int, list[tuple[int, int]]] = {}
    for pg, block, i in reversed(blocks):
        sv = saved[block]
        if sv is None:   # recompute the checkpointed layer's forward first
            outs, _ = walk.run(pg.fw, param_roots(pg, block, i) + inputs_of(pg, layer_input[block]),
                               "bw", f"R{block}", block, bw_nodes)
            sv = outs[pg.n_outputs:]
        n_saved = len(pg.bw_placeholders()[0])
        if len(sv) != n_saved:
            raise RuntimeError(f"deepcompile plan: {pg.piece.name}: {len(sv)} saved tensors, "
                               f"backward takes {n_saved}")
        if len(pg.tangent_of) != 1:
            raise RuntimeError(f"deepcompile plan: {pg.piece.name}: one tangent expected")
        outs, where = walk.run(pg.bw, list(sv) + [tangent], "bw", f"B{block}", block, bw_nodes)
        p_roots = param_roots(pg, block, i)
        for (root,), g, at in zip(p_roots, outs[:len(p_roots)], where):
            _, pid = root
            r = _flat(g)
            if r and at is not None:
                grads.setdefault(pid, []).append((at, sum(walk.size[x] for x in r), r))
        k = pg.piece.input_roles.index("hidden") if "hidden" in pg.piece.input_roles else None
        tangent = outs[len(p_roots) + k] if k is not None else ()
    # each gradient is consumed where it is complete (the reduce right after it)
    grad_list = []
    for pid, parts in grads.items():
        at = max(p[0] for p in parts)
        for _, _, roots in parts:
            walk.read(roots, at, "bw")
        grad_list.append(Grad(pid, at - (fw_end + 1), parts[-1][1],
                              [(p[0] - (fw_end + 1), p[1]) for p in parts[:-1]]))
    live = _live_curve(walk)
    cost_of = {("fw", "F"): "fw", ("bw", "B"): "bw", ("bw", "R"): "fw"}
    piece_of = {0: "embed", layers + 1: "head"}

    def nodes_of(entries, offset, phase):
        out = []
        for k, (tag_name, block, node) in enumerate(entries):
            tag = tag_name.split(".", 1)[0]
            piece = piece_of.get(block, "layer")
            cost = times(piece, cost_of[(phase, tag[0])]).get(node.name) or NodeCost(0.0, 0.0, 0)
            out.append(Node(tag_name, block, cost.time_s,
                            0.0 if tag[0] == "R" else cost.flops, cost.kernels,
                            live[offset + k]))
        return out

    fw = Graph("fw", nodes_of(fw_nodes, 0, "fw"), _uses(walk, "fw", 0), [])
    bw = Graph("bw", nodes_of(bw_nodes, len(fw_nodes), "bw"), _uses(walk, "bw", len(fw_nodes)),
               sorted(grad_list, key=lambda g: (g.at, g.pid)))
    base = sum(walk.size[r] for (r,) in (glob["ids"], glob["cos"], glob["sin"], glob["labels"]))
    return Model(name, layers, batch, seq, dtype, ac, sorted(params.values(), key=lambda p: p.pid),
                 fw, bw, base, graphs)


def _uses(walk: _Walk, phase: str, offset: int) -> list[Use]:
    out = [Use(pid, min(pos) - offset, max(pos) - offset)
           for (ph, pid), pos in walk.param_reads.items() if ph == phase]
    return sorted(out, key=lambda u: (u.first, u.pid))


def _live_curve(walk: _Walk) -> list[int]:
    """Live bytes after each position (globals excluded: Model.base_bytes)."""
    n = walk.pos
    delta = [0] * (n + 1)
    for r, size in walk.size.items():
        if isinstance(r, tuple) and r[0] == "global":
            continue
        made, last = walk.made[r], walk.last[r]
        if last <= made:      # never read after the node that made it
            continue
        delta[made] += size
        delta[last] -= size   # freed after its last reader
    out, acc = [], 0
    for k in range(n):
        acc += delta[k]
        out.append(acc)
    return out
