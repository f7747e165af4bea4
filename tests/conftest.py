"""Shared pytest setup: a summary of the parity deviations measured by the distributed tests
(tests/_train.py fills `_train.DEVIATIONS`; each entry is also appended to
build/test-deviations.jsonl)."""

from __future__ import annotations

import pytest

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


@pytest.fixture
def group(tmp_path):
    """A one-rank gloo process group in the test's own process (in-process tests at world
    size 1); Dynamo's caches are reset after it."""
    import torch
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()
