"""Optimization passes, registered by name.

A pass has two halves so that a cached plan can be re-applied without profiling:
  plan(ctx)  -> decisions: a JSON-serializable dict, computed from the agreed profiles; it must
                depend only on what `ctx` holds (the same on every rank), never on local timing;
  apply(ctx, decisions) -> the keys of the graph slots it changed (empty: nothing to do).
Decisions holding "trade" ({"for": the pass queued next, ...}) free memory for that pass, and
the two are judged together ([Note: a memory trade] in passes/activation_budget.py).
A re-plan (the step drifted: compiler/drift.py) runs the kept passes again on the graphs as
compiled ([Note: a re-plan starts over] in compiler/pass_manager.py): a pass never sees its
own previous rewrite.
Passes only schedule: they never change a graph's inputs or outputs, but for
`activation_budget`, which changes what a forward hands its backward in a saved value's place
([Note: activations after partitioning]). A pass is a no-op when its pattern is absent.
Built-in passes register here as they land; users register
their own with `deepcompile.register_pass`.
"""

from __future__ import annotations

from .context import (Facts, Pass, PassContext, get_pass, known_passes, needs_of,  # noqa: F401
                      passes_with, register_pass)


def _register_builtin() -> None:
    from . import (activation_budget, bucket_reduce, offload_optimizer,  # noqa: F401
                   overlap_refresh, prefetch,
                   selective_unshard)


_register_builtin()
