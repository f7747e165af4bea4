"""Pass `activation_budget`: the copy lanes ([Note: one copy lane each way]).

Unit tests of the pure planner on synthetic profiled pairs (1 ms a step, copies at 1 GB/s): copies
that each hide alone but queue past their readers together are charged the wait, and the values
whose recompute is cheaper than that are recomputed; copies that hide together stay offloads; the
optimizer offload's state reloads share the lane; a copy back waits for its own copy out, and
only compute hides copies; the plan is a function of its inputs only (the same on every rank,
whatever order the values come in).
"""

from __future__ import annotations

import pytest

from deepcompile.passes import activation_budget as A
from deepcompile.passes._common import Step

COPY = lambda nbytes: 1e-9 * nbytes   # noqa: E731  (1 GB/s)
MB = 1_000_000                        # 1 ms of copy
HOST3 = 3 * A.HOST_OP_S


def _pair(acts, n_fw=8, n_bw=10, t=1e-3, top=0):
    """Steps of `t` s; live bytes: every saved value from its `fw_free` on, and in the whole
    backward (the profiler's model), and `top` bytes more in the first three backward steps."""
    fw = [Step(f"f{i}", "compute", t, sum(a.nbytes for a in acts if i >= a.fw_free))
          for i in range(n_fw)]
    bw = [Step(f"b{j}", "compute", t, sum(a.nbytes for a in acts) + (top if j < 3 else 0))
          for j in range(n_bw)]
    return fw, bw


def _actions(plan):
    return {c["name"]: c["action"] for c in plan["choices"]}


def test_copies_that_queue_past_their_reader_are_recomputed_where_cheaper():
    # six values read first at the same backward step: each copy back (1 ms) starts a step
    # before it and hides alone, but the six run one after another on the lane; all six must
    # leave for the top of the backward (12 MB) to fit 6.5 MB
    acts = [A.Activation(f"a{i}", MB, i, 5, 6, 0.5e-3) for i in range(6)]
    fw, bw = _pair(acts, top=6 * MB)
    alone = [A.options(a, fw, bw, COPY, True) for a in acts]
    assert all(o.cost_s == pytest.approx(HOST3) for opts in alone for o in opts
               if o.action == "offload")   # priced alone: hidden, so offloading wins
    everything = [(a, next(o for o in opts if o.action == "offload"))
                  for a, opts in zip(acts, alone)]
    assert A.lane_stall(fw, bw, everything, COPY) == pytest.approx(5e-3)   # 6 ms in a 1 ms lead

    plan = A.plan_pair(fw, bw, acts, 6.5 * MB, COPY, overlap=True)
    assert not plan["unattainable"] and len(plan["choices"]) == 6
    actions = _actions(plan)
    # what is left on the lane hides; every other value is recomputed (0.5 ms against the
    # 1 ms wait each offload adds)
    assert sorted(actions.values()) == ["offload"] + ["recompute"] * 5
    assert plan["copy_wait_s"] == pytest.approx(0.0)
    assert plan["added_s"] == pytest.approx(5 * 0.5e-3 + HOST3)
    assert plan["peak_after"] <= 6.5 * MB


def test_copies_that_hide_together_stay_offloads():
    # the same values read two steps apart: each copy back has the lane to itself
    acts = [A.Activation(f"a{i}", MB, i, 2 + 2 * i, 2 + 2 * i, 0.5e-3) for i in range(4)]
    fw, bw = _pair(acts)
    plan = A.plan_pair(fw, bw, acts, 2.5 * MB, COPY, overlap=True)
    assert not plan["unattainable"]
    assert set(_actions(plan).values()) == {"offload"} and len(plan["choices"]) == 4
    assert plan["copy_wait_s"] == pytest.approx(0.0)
    assert plan["added_s"] == pytest.approx(4 * HOST3)
    assert all(c["cost_s"] == pytest.approx(HOST3) for c in plan["choices"])


def test_the_optimizer_offloads_state_reloads_share_the_lane():
    # as above, but a 6 ms state reload is issued after the first backward step: the copies
    # back queue behind it, and the values read while it runs are recomputed instead
    acts = [A.Activation(f"a{i}", MB, i, 2 + 2 * i, 2 + 2 * i, 0.5e-3) for i in range(4)]
    fw, bw = _pair(acts)
    plan = A.plan_pair(fw, bw, acts, 2.5 * MB, COPY, overlap=True,
                       lane_busy=(("bw", 0, 6e-3),))
    assert not plan["unattainable"]
    # each swap moves the wait onto the next copy in the queue; the last value is read after
    # the reload ends: its copy still hides
    assert _actions(plan) == {"a0": "recompute", "a1": "recompute", "a2": "recompute",
                              "a3": "offload"}
    assert plan["copy_wait_s"] == pytest.approx(0.0)


def test_a_copy_back_waits_for_its_own_copy_out():
    # the value's last forward reader is the forward's last step: its copy out (2.5 ms) ends
    # 2.5 ms into the backward, the copy back then takes 2.5 ms more, and its reader is 3 ms in
    a = A.Activation("a", 2_500_000, 3, 3, 9, None)
    fw, bw = _pair([a], n_fw=4)
    (opt,) = A.options(a, fw, bw, COPY, True)
    assert opt.reload_after is None   # from the top of the backward
    assert A.lane_stall(fw, bw, [(a, opt)], COPY) == pytest.approx(2e-3)
    # a synchronous collective's time at the end of the forward hides nothing: the passes
    # after this one may hide it behind compute
    fw.append(Step("ag", "all_gather", 10e-3, fw[-1].live_bytes))
    assert A.lane_stall(fw, bw, [(a, opt)], COPY) == pytest.approx(2e-3)


def test_the_plan_is_a_function_of_its_inputs_only():
    """The same profile gives the same plan (every rank plans on the agreed profile), whatever
    order the values come in."""
    acts = [A.Activation(f"a{i}", MB * (1 + i % 3), i, 5 - i % 2, 7, (0.3 + 0.2 * i) * 1e-3)
            for i in range(7)]
    fw, bw = _pair(acts)
    budget = 0.4 * sum(a.nbytes for a in acts)
    plans = [A.plan_pair(fw, bw, order, budget, COPY, overlap=True)
             for order in (acts, acts[::-1], acts[3:] + acts[:3], list(acts))]
    assert all(p == plans[0] for p in plans[1:])
    assert set(_actions(plans[0]).values()) == {"offload", "recompute"}
