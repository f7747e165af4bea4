"""The phases of the profile-guided pipeline (the phase machine: compiler/pipeline.py), which
the slot runner (compiler/runner.py) reads at every graph call, and the parameter names that
profiles and the plan cache's key carry."""

from __future__ import annotations

import enum

from ..runtime import registry as _registry


class Phase(enum.Enum):
    WARMUP = "warmup"
    PROFILE = "profile"
    MEASURE = "measure"
    STEADY = "steady"


def param_name(pid: int) -> str:
    try:
        return _registry.lookup(pid).name
    except RuntimeError:
        return f"pid{pid}"
