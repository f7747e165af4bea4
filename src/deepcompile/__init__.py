"""deepcompile: train an unmodified PyTorch model data-parallel (ZeRO) by compiling it.

Public API: `initialize`, `Config`, the `Engine` it returns, `verify` (a model of your own
trained with the engine and with eager PyTorch, compared step by step), and `register_pass`
(with the `PassContext` a pass receives) for user-defined optimization passes.

Nothing heavy is imported with the package: torch and the compiler load on first use of one of
these names (PEP 562), so that `deepcompile --help` answers at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._version import __version__

# [Note: the default group kept by an import] `torch.distributed.nn.functional` takes the default
# process group as a default argument of its functions, evaluated when it is first imported;
# Dynamo imports it, so a script that imports torch, creates the process group and then compiles
# (deepcompile.initialize does) keeps the default group alive after `destroy_process_group()`:
# it is destroyed with that module, during the interpreter's finalization, where destroying a
# process group can abort the process ("terminate called without an active exception"). Where
# torch is already imported, the module is imported here, before any process group exists, and
# its defaults are None. Without torch yet (the command line), nothing is imported.


def _import_before_any_process_group() -> None:
    import importlib
    import sys

    if "torch" in sys.modules:
        try:
            importlib.import_module("torch.distributed.nn.functional")
        except ImportError:   # a torch built without distributed
            pass


_import_before_any_process_group()
del _import_before_any_process_group

__all__ = ["initialize", "Config", "Engine", "verify", "register_pass", "PassContext"]

_LAZY = {
    "initialize": "._api",
    "Config": ".config",
    "Engine": ".engine",
    "verify": ".tools.verify",   # a tool, exported by name only: the library never imports it
    "register_pass": ".passes",
    "PassContext": ".passes",
}

if TYPE_CHECKING:  # pragma: no cover
    from ._api import initialize
    from .config import Config
    from .engine import Engine
    from .passes import PassContext, register_pass


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'deepcompile' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
