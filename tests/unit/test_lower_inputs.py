"""A lowered graph's extra inputs are arguments of its generated code: two under one name
(a group of gathers started for the next graph that holds a parameter twice, a recompute's
gather fused with the backward's own: two `next_<pid>` shards) are two arguments, not a
duplicate argument (`SyntaxError` when the graph module is made; met at 2 ranks with
activation_budget's recompute and prefetch: test_activation_budget's
test_activations_freed_for_optimizer_state_alike_on_every_rank)."""

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
