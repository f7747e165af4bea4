"""Tier 3 of `offload_optimizer`'s planner (passes/_offload_plan.py): the masters it takes, and
the curve and step peak it returns for them, which it computes from each candidate's own bytes,
are those `_all_state_off` recomputes from scratch with the same masters; and each master taken
lowered the peak where it was taken. Random small steps, streamed and hosted."""

from __future__ import annotations

import itertools
import random

import pytest

from deepcompile.passes import _offload_plan as P


def _case(rng: random.Random):
    n, chunks = rng.randint(0, 12), rng.randint(1, 8)
    live = [rng.randint(1000, 5000) for _ in range(n)]
    items = [P.Item(chunk=c, nbytes=rng.randint(10, 300)) for c in range(chunks)
             if rng.random() < 0.8]
    grads = [P.GradItem(chunk=c, nbytes=rng.randint(10, 200), flat_bytes=rng.randint(10, 200),
                        at=rng.randint(0, n + 1)) for c in range(chunks) if rng.random() < 0.6]
    masters = [P.MasterItem(chunk=c, nbytes=rng.randint(10, 400),
                            master_bytes=rng.randint(10, 500),
                            per_point=[rng.randint(0, 400) for _ in range(n)]
                            if rng.random() < 0.4 else None)
               for c in range(chunks) if rng.random() < 0.7]
    queue = (list(itertools.accumulate(rng.random() for _ in range(n))), lambda b: b * 1e-3)
    budget = rng.choice([float("-inf"), rng.randint(0, 6000)])
    return live, items, grads, masters, queue, budget


@pytest.mark.parametrize("hosted", [False, True])
def test_the_masters_curve_is_the_full_recomputation(hosted):
    rng = random.Random(7)
    for _ in range(1500):
        live, items, grads, masters, queue, budget = _case(rng)
        gone, curve = P._take_masters(live, items, grads, 300, queue, masters, budget, hosted)
        c, s = P._all_state_off(live, items, grads, 300, queue, gone, hosted)
        assert curve == c + [s]
        # each one taken lowered the peak of those taken before it
        for k, m in enumerate(gone):
            c0, s0 = P._all_state_off(live, items, grads, 300, queue, gone[:k], hosted)
            c1, s1 = P._all_state_off(live, items, grads, 300, queue, gone[:k + 1], hosted)
            assert max(c1 + [s1]) < max(c0 + [s0])
