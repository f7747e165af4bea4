"""Fused re-gathers of full parameters from the shards (runtime/regather.py: ZeRO-1/2 replicas and
kept parameters are refreshed with it): exact values for every grouping, including many groups
with two collectives in flight, one collective per group, and a loud error for a bad destination."""

from __future__ import annotations

import functools

import pytest
import torch

import _models
from _dist import run_distributed


def _job(rank: int, world: int) -> dict:
    import deepcompile
    from deepcompile.runtime import regather
    from deepcompile.runtime.registry import padded_view

    engine = deepcompile.initialize(_models.build_model("mlp"),
                                    optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                                    config={"compiler": "fx"})
    entries = list(engine._registry)
    with torch.no_grad():   # distinct values per rank's shard, so a misplaced block shows
        for e in entries:
            e.shard.add_(torch.arange(e.shard.numel(), dtype=e.shard.dtype) * (rank + 1))
    expected = engine.full_state_dict()
    out = {"sizes": [e.padded_numel * 4 for e in entries]}
    for max_bytes in (1, 1000, 1 << 30):   # one group per parameter; mixed; one group
        # each destination at the head of a padded buffer (as replicas and kept copies are)
        dests = [torch.full((e.padded_numel,), float("nan"))[: e.numel].view(e.shape)
                 for e in entries]
        before = engine.comm_stats()["all_gather"]["count"]
        plan = regather.RegatherPlan(entries, [padded_view(d, world) for d in dests], max_bytes)
        n = plan.run()
        out[max_bytes] = {
            "collectives": n, "counted": engine.comm_stats()["all_gather"]["count"] - before,
            "groups": [len(g) for g in regather.groups(entries, max_bytes)],
            "exact": all(torch.equal(d, expected[e.name]) for e, d in zip(entries, dests))}
    try:
        regather.RegatherPlan(entries[:1], [torch.empty(entries[0].shape).t()], 1)
    except RuntimeError as exc:
        out["error"] = str(exc)
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_job, 2, timeout=300)


@pytest.mark.parametrize("max_bytes", [1, 1000, 1 << 30])
def test_regather_is_exact_for_every_grouping(results, max_bytes):
    for r in results:
        got = r[max_bytes]
        assert got["exact"], got
        assert got["collectives"] == got["counted"] == len(got["groups"]), got
        assert sum(got["groups"]) == len(r["sizes"])
    groups = results[0][max_bytes]["groups"]
    if max_bytes == 1:
        assert groups == [1] * len(results[0]["sizes"])
    elif max_bytes == 1000:
        assert 1 < len(groups) < len(results[0]["sizes"]), groups
    else:
        assert groups == [len(results[0]["sizes"])]


def test_regather_rejects_a_destination_of_another_layout(results):
    for r in results:
        assert "cannot re-gather" in r["error"], r.get("error")
