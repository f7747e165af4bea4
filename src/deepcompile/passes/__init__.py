"""Optimization passes, registered by name.

Issue 2 ships insertion only (done in `compiler.insert`); the profile-guided passes (prefetch,
selective unsharding, offloading) register here as they land.
"""

from __future__ import annotations

from typing import Callable

_REGISTRY: dict[str, Callable] = {}


def register_pass(name: str, fn: Callable) -> Callable:
    if name in _REGISTRY:
        raise ValueError(f"pass {name!r} is already registered")
    _REGISTRY[name] = fn
    return fn


def known_passes() -> tuple[str, ...]:
    return tuple(_REGISTRY)
