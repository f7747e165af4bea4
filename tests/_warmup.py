"""Imported by the ranks' fork server (`_dist._PRELOAD`), last: compiles one forward and backward
of the tiny Llama with torch's own `aot_eager` backend, then forgets it.

[Note: a warm fork server] A process's first compile costs about 3 s more than its later ones on
the 2-core machine (Dynamo's trace rules, AOTAutograd's and the partitioner's lazily built
tables, sympy's caches): every rank of every job paid it. Done once here, every rank forked from
the server starts with those tables built. What a compile leaves that a rank could observe is
put back, so that a forked rank is as fresh as a spawned one: Dynamo's caches and counters
(`torch._dynamo.reset()`, `counters.clear()`), the global random state, and the one thread the
compile starts (tqdm's monitor: a thread at fork time is not in the child, and tqdm starts a
new one when it finds its monitor stopped). Nothing of deepcompile runs here: its state starts
empty in every rank. Inductor is not warmed: a cold compile of this model with it takes ~50 s
(g++ per kernel), and few jobs compile with Inductor."""

from __future__ import annotations

import sys
import threading

import torch


def _warm() -> None:
    import _models
    from torch._dynamo.utils import counters

    rng = torch.get_rng_state()
    model = _models.build_model("llama")
    batch = _models.local_batch("llama", 0, 0, 1)
    _models.loss_of(torch.compile(model, backend="aot_eager")(**batch)).backward()
    torch._dynamo.reset()
    counters.clear()
    torch.set_rng_state(rng)
    try:
        from tqdm import tqdm
    except ImportError:
        return
    if tqdm.monitor is not None:
        tqdm.monitor.exit()
        tqdm.monitor = None


# the fork server ignores a preload module's ImportError and dies of any other exception: the
# warm-up is only a saving, so a failure of it is said and the server goes on cold
try:
    _warm()
except Exception as exc:  # noqa: BLE001
    sys.stderr.write(f"tests/_warmup.py: the fork server starts without its warm-up: {exc!r}\n")
if threading.active_count() != 1:
    sys.stderr.write("tests/_warmup.py: threads left in the fork server: "
                     f"{[t.name for t in threading.enumerate()]}\n")
