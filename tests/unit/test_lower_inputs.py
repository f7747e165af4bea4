"""A lowered graph's extra inputs are arguments of its generated code: two under one name
(a recompute's gather of a parameter the backward gathers too, each started in the graph
before it: two `next_<pid>` inputs there, two parked `prev_<pid>` buffers here) are two
arguments, not a duplicate argument (`SyntaxError` when the graph module is made)."""

from __future__ import annotations

import torch
from torch import fx

from deepcompile.compiler.lower import _Lowering


def test_two_extra_inputs_under_one_name_are_two_arguments():
    lw = object.__new__(_Lowering)   # only what `extra_input` uses
    lw.g, lw.input_names = fx.Graph(), {}
    a, b, c = lw.extra_input("next_41"), lw.extra_input("next_41"), lw.extra_input("prev_4")
    lw.g.output((lw.g.call_function(torch.add, (a, b)), c))
    gm = fx.GraphModule(torch.nn.Module(), lw.g)   # generates and compiles the code
    assert len({a.target, b.target, c.target}) == 3 and a.target == "rt_next_41"
    out = gm(torch.ones(1), 2 * torch.ones(1), torch.zeros(1))
    assert out[0].item() == 3.0 and out[1].item() == 0.0
