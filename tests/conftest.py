"""Shared pytest setup: a summary of the parity deviations measured by the distributed tests
(tests/_train.py fills `_train.DEVIATIONS`; each entry is also appended to
build/test-deviations.jsonl)."""

from __future__ import annotations

import _train


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _train.DEVIATIONS:
        return
    tr = terminalreporter
    tr.section("deepcompile parity deviations (max over steps; vs eager reference)")
    tr.write_line(f"{'scenario':<34} {'world':>5} {'compiler':>8} {'optim':>6} {'gas':>3} "
                  f"{'clip':>5} {'loss dev':>10} {'param dev':>10} {'moved':>8}")
    for e in _train.DEVIATIONS:
        tr.write_line(f"{e['id']:<34} {e['world']:>5} {str(e['compiler']):>8} {e['optim']:>6} "
                      f"{e['gas']:>3} {str(e['clip']):>5} {e['max_loss_dev']:>10.2e} "
                      f"{e['max_param_dev']:>10.2e} {e['max_param_change']:>8.3f}")
