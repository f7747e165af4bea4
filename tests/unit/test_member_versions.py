"""A member of a shape family runs its representative's plan under versions of its own, and its
code is cached under them: a version must never name two plans.

The case it guards: a re-plan after the steady state (a longer sequence) made a member's face
numbered like the face the steady state kept, so the member ran the kept face's compiled code,
of the old plan, while its backward ran the new one (seen as "a backward graph reloads an
activation that its forward did not offload")."""

import types

import torch
from torch import fx

from deepcompile.compiler.phases import Phase
from deepcompile.compiler.runner import SlotRunner
from deepcompile.compiler.slots import GraphSlot


def _graph() -> fx.GraphModule:
    return fx.symbolic_trace(lambda x: torch.relu(x) * 2)


def test_a_members_versions_are_never_reused():
    rep = GraphSlot("g0.fw", 0, "fw", _graph(), runner=None)
    rep.original = _graph()
    member = GraphSlot("g0.fw~1", 0, "fw", _graph(), runner=None)
    member.rep, member.original = rep, _graph()
    rep.members.append(member)
    runner = types.SimpleNamespace(phase=Phase.PROFILE)
    plan_of: dict[int, int] = {}   # member version -> the representative version it runs

    def follow(phase: Phase) -> None:
        runner.phase = phase
        SlotRunner.follow(runner, member)
        assert member.following == rep.version
        assert plan_of.setdefault(member.version, rep.version) == rep.version, \
            (member.version, plan_of)
        # what `SlotRunner.run` caches for the version that runs now
        member.compiled.setdefault((True, member.version, phase is Phase.STEADY),
                                   rep.version)

    follow(Phase.PROFILE)
    for _ in range(2):   # passes
        rep.changed()
        follow(Phase.PROFILE)
    follow(Phase.STEADY)   # keeps one face and its code
    assert {v for _, v, _ in member.compiled} == {member.version}
    for _ in range(4):   # a re-plan: the graphs as compiled, then the passes again
        rep.changed()
        follow(Phase.PROFILE)
        assert all(plan == rep.version for (_, v, _), plan in member.compiled.items()
                   if v == member.version), member.compiled
    follow(Phase.STEADY)
