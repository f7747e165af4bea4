"""The pass queue around a memory trade with a waiting buyer ([Note: a memory trade] in
passes/activation_budget.py): `PassManager.waits` queues the buyer after the pass that frees
memory, a declined trade gives that pass one more turn after the buyer (`unchanged`), and a
re-plan (`restart`) queues each pass once, where it was queued, to do so again."""

from __future__ import annotations

import dataclasses

from deepcompile.compiler.pass_manager import PassManager
from deepcompile.passes import PassContext, context


class _Runtime:
    def plan_state(self):
        return {}

    def restore_plan_state(self, state):
        pass


def _manager(monkeypatch, waits: bool) -> PassManager:
    offload = context.get_pass("offload_optimizer")
    monkeypatch.setitem(context._REGISTRY, "offload_optimizer",
                        dataclasses.replace(offload, waits_for_memory=lambda ctx: waits))
    ctx = PassContext(slots={}, profiles={}, order=[], registry=None, runtime=None, cost=None,
                      memory_budget=1000.0, world_size=1, decisions={})
    return PassManager(slots={}, runtime=_Runtime(), context=lambda: ctx, summarize=dict)


def _entry(name: str, decisions: dict) -> dict:
    before = {"budget_bytes": 1000.0, "collectives": 0, "exposed_comm_s": 0.0,
              "peak_bytes": 900}
    return {"pass": name, "decisions": decisions, "changed": [], "before": before,
            "after": None, "kept": True, "verdict": None}


PASSES = ("offload_optimizer", "activation_budget", "selective_unshard")


def test_a_buyer_that_waits_is_queued_after_the_seller_which_plans_again_when_it_declines(
        monkeypatch):
    pm = _manager(monkeypatch, waits=True)
    pm.configure(PASSES)
    assert pm.waits(pm.queue.pop(0))
    assert pm.queue == ["activation_budget", "offload_optimizer", "selective_unshard"]
    # declined: changes nothing, and plans once more right after the buyer
    pm.unchanged(_entry(pm.queue.pop(0), {"declined": {"for": "offload_optimizer"}}))
    assert pm.queue == ["offload_optimizer", "activation_budget", "selective_unshard"]
    assert not pm.waits(pm.queue.pop(0))   # asked once per plan
    pm.log(_entry("offload_optimizer", {}))
    pm.unchanged(_entry(pm.queue.pop(0), {}))   # its second turn: no third
    assert pm.queue == ["selective_unshard"]
    pm.log(_entry(pm.queue.pop(0), {}))
    # a re-plan: each pass once, the buyer back before the seller, to wait again
    chain = pm.restart(["offload_optimizer"])
    assert chain == list(PASSES)
    pm.configure(tuple(chain))
    assert pm.waits(pm.queue.pop(0))
    assert pm.queue == ["activation_budget", "offload_optimizer", "selective_unshard"]


def test_a_buyer_that_does_not_wait_plans_first(monkeypatch):
    pm = _manager(monkeypatch, waits=False)
    pm.configure(PASSES)
    assert not pm.waits(pm.queue.pop(0))
    assert pm.queue == ["activation_budget", "selective_unshard"]
    pm.log(_entry("offload_optimizer", {}))
    pm.unchanged(_entry(pm.queue.pop(0), {}))
    assert pm.queue == ["selective_unshard"]
