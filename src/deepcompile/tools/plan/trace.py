"""A piece's forward and backward graphs, as AOTAutograd partitions them for deepcompile.

Each piece (pieces.py) is traced by AOTAutograd with the min-cut partitioner, as deepcompile's
backend does, on fake tensors (nothing is allocated: a Llama-3-70B layer traces in ~2 s) or on
real ones. The graphs are the plain model's: no gather or reduce ops are inserted here.
The planner places them itself (compose.py) where deepcompile's insertion pass puts them: a
gather right before the first use of the parameter (or of a view of it) in each graph — the
backend tags gathers and their views MUST_RECOMPUTE, so the backward gathers again where the
plain partitioner would have saved the parameter — and a reduce right after the parameter's
gradient is complete.

`PieceGraphs` records how the forward's outputs split into the piece's outputs and the tensors
saved for the backward, and how the backward's inputs and outputs map back (saved tensors,
tangents; one gradient per piece input).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from unittest import mock

import torch
from torch import fx

from ... import _compat
from .pieces import Piece, Pieces


@dataclasses.dataclass
class PieceGraphs:
    piece: Piece
    fw: fx.GraphModule
    bw: fx.GraphModule
    n_outputs: int             # the forward's first n_outputs outputs are the piece's outputs
    tangent_of: list[int]      # backward tangent j is the gradient of piece output tangent_of[j]

    @property
    def n_params(self) -> int:
        return len(self.piece.params)

    def saved(self) -> list[fx.Node]:
        return _outputs(self.fw)[self.n_outputs:]

    def bw_placeholders(self) -> tuple[list[fx.Node], list[fx.Node]]:
        """(saved-tensor inputs, tangent inputs) of the backward graph."""
        ph = [n for n in self.bw.graph.nodes if n.op == "placeholder"]
        k = len(ph) - len(self.tangent_of)
        return ph[:k], ph[k:]


def _outputs(gm: fx.GraphModule) -> list:
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return list(out.args[0])


def trace_piece(piece: Piece, mode=None) -> PieceGraphs:
    graphs: dict[str, fx.GraphModule] = {}

    def capture(kind):
        def compiler(gm, _example_inputs):
            graphs[kind] = gm

            def run(args):   # AOT's boxed calling convention: one list of arguments
                return gm(*args)
            run._boxed_call = True
            return run
        return compiler

    fn = piece.fn
    flat = list(piece.params) + list(piece.inputs)
    with _compat.no_autograd_cache():
        compiled = _compat.aot_function(fn, fw_compiler=capture("fw"), bw_compiler=capture("bw"),
                                        partition_fn=_compat.min_cut_partition)
        with (mode if mode is not None else _nullcontext()):
            args = [t.detach().requires_grad_(t.requires_grad or t.is_floating_point()
                                              and i < len(piece.params))
                    for i, t in enumerate(flat)]
            outs = compiled(*args)
            outs = outs if isinstance(outs, (tuple, list)) else (outs,)
            diff = [i for i, o in enumerate(outs)
                    if isinstance(o, torch.Tensor) and o.requires_grad]
            torch.autograd.backward([outs[i] for i in diff],
                                    [torch.ones_like(outs[i]) for i in diff])
    if "bw" not in graphs:
        raise RuntimeError(f"deepcompile plan: piece {piece.name} traced without a backward")
    return PieceGraphs(piece, graphs["fw"], graphs["bw"], len(outs), diff)


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def trace_all(pieces: Pieces) -> dict[str, PieceGraphs]:
    """The three pieces' graphs (the inputs requiring grad as the full model would: every
    parameter, the hidden states; not the ids, labels or rotary tables)."""
    with as_dynamo_sees_it():
        return {p.name: trace_piece(p, pieces.mode) for p in pieces.all()}


@contextlib.contextmanager
def as_dynamo_sees_it():
    """Hugging Face picks some code paths by `is_torchdynamo_compiling()`: its MoE experts use
    `torch._grouped_mm` only for bf16 when compiled (else its own `grouped_mm_fallback` op).
    deepcompile's graphs come from Dynamo, so the
    pieces are traced with that switch on (scoped to the trace, in the modules that read it)."""
    with contextlib.ExitStack() as stack:
        for name in ("transformers.integrations.moe",):
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
            if hasattr(module, "is_torchdynamo_compiling"):
                stack.enter_context(mock.patch.object(module, "is_torchdynamo_compiling",
                                                      lambda: True))
        yield
