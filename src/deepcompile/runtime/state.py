"""Where the engine is within an optimizer step, for runtime ops whose behaviour depends on it.

A compiled graph is the same for every micro-step of a gradient-accumulation window, but some
of its work differs on the last micro-step (a gradient kept local until the window ends is
reduced then: the graph runs its "last" variant). The engine updates one `StepState` per engine
(held by its runtime, runtime/runtime.py) before each forward. Every rank runs the same
micro-steps in the same order, so every rank sees the same state: decisions taken from it do not
diverge.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class StepState:
    gradient_accumulation_steps: int = 1
    micro_step: int = 0        # index, within the accumulation window, of the running micro-step
    optimizer_steps: int = 0   # optimizer steps taken so far

    @property
    def last_micro_step(self) -> bool:
        """The running micro-step ends the accumulation window (the optimizer steps after it)."""
        return self.micro_step >= self.gradient_accumulation_steps - 1
