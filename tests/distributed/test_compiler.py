"""The insertion pass and its invariants, checked directly.

* the saved-parameter check fails loudly on a forward graph that keeps a gathered parameter
  (or a view of one) alive past the forward, and passes a graph that does not;
* gathered parameters are freed after their last use: in a forward of a 6-layer MLP at most
  one layer's parameters are alive at once, and none survive the forward or the backward
  (measured with weak references to every gathered buffer, fx compiler, 2 ranks).
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import fx, nn

from _dist import run_distributed
from deepcompile.compiler.backend import GatheredParameterSavedError, check_no_gathered_param_saved
from deepcompile.runtime import ops


def _forward_graph(save_view: bool) -> fx.GraphModule:
    g = fx.Graph()
    shard, x = g.placeholder("shard"), g.placeholder("x")
    full = g.call_function(ops.ALLGATHER, (shard, 12345, [4, 4], torch.float32))
    t = g.call_function(torch.ops.aten.t.default, (full,))
    y = g.call_function(torch.ops.aten.mm.default, (x, t))
    saved = t if save_view else x
    g.output((y, saved))
    return fx.GraphModule(nn.Module(), g)


def test_saved_gathered_parameter_fails_loudly():
    with pytest.raises(GatheredParameterSavedError, match="pid 12345"):
        check_no_gathered_param_saved(_forward_graph(save_view=True))


def test_forward_that_saves_only_activations_passes():
    check_no_gathered_param_saved(_forward_graph(save_view=False))


def _settled_count(live, timeout: float = 2.0) -> int:
    """Live buffers once the transport has let go of them.

    gloo's worker thread drops its handle on a collective's output only after the caller's wait
    returned, so on a loaded machine the last gathered buffer can outlive its last use by a few
    milliseconds. A buffer the graph really keeps stays alive for the whole timeout."""
    import time

    deadline = time.monotonic() + timeout
    while live.live_count() and time.monotonic() < deadline:
        time.sleep(0.01)
    return live.live_count()


def _liveness(rank: int, world: int) -> dict:
    import deepcompile
    from deepcompile.runtime.memory import track_live_buffers

    torch.manual_seed(0)
    layers = [nn.Linear(24, 24) for _ in range(6)]
    model = nn.Sequential(*[m for layer in layers for m in (layer, nn.Tanh())])
    engine = deepcompile.initialize(model, optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                                    config={"compiler": "fx"})
    out = {}
    x = torch.randn(8, 24)
    engine.backward(engine(x).sum())  # compile outside the measurement
    engine.step()
    with track_live_buffers() as live:
        loss = engine(x).sum()
        out["forward_peak"] = live.peak_count
        out["after_forward"] = _settled_count(live)
        out["gathered_in_forward"] = live.total
        engine.backward(loss)
        out["after_backward"] = _settled_count(live)
        out["gathered_total"] = live.total
    out["param_storage"] = sum(p.untyped_storage().nbytes() for p in model.parameters())
    out["eager_gathers"] = engine._fallback.materializations   # 0: the compiled graphs ran
    return out


def test_gathered_parameters_are_freed_after_last_use():
    for r in run_distributed(_liveness, 2, timeout=300):
        assert r["gathered_in_forward"] == 12          # 6 weights + 6 biases
        assert r["forward_peak"] <= 2                  # one layer's weight and bias at a time
        assert r["after_forward"] == 0                 # nothing gathered is kept for backward
        assert r["gathered_total"] == 12 + 5           # backward re-gathers weights 2..6
        assert r["after_backward"] == 0
        assert r["param_storage"] == 0
        assert r["eager_gathers"] == 0
