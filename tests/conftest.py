"""Shared pytest setup.

The tests are in layers, one folder each, marked by it and run in this order:
  unit    no process group: pure functions, synthetic graphs, the configuration, the layering
  engine  one rank in the test's process (the `group` fixture)
  tools   the `deepcompile` command, bench, planner, verify, examples and packaging
  distributed  several gloo ranks on the CPU (tests/_dist.py launches them)
  gpu     CUDA only (skipped without a GPU)
`pytest tests/unit` is the quick subset; `pytest -m "not distributed"` leaves out the ranks.
Tests marked `extended` run only with DEEPCOMPILE_FULL_TESTS=1 ([Note: the core matrix] in
tests/_train.py).

At the end, the test time per layer (setup, call and teardown, summed over the workers), and
a summary of the parity deviations measured by the distributed tests (tests/_train.py
appends each to build/test-deviations.jsonl; the summary reads those of this session).

[Note: two workers] The suite runs in two pytest-xdist workers (`-n 2 --dist loadfile` in
pyproject.toml): a test file's tests all run in one worker, where its module fixtures run its
jobs once. On the 2-core machine one process running the suite keeps the cores busy 65-70% of
the time in the in-process layers (one core) and 80-90% in the distributed one (collectives,
barriers, the reference training between jobs): the second worker fills the rest. Each worker
has its own fork server and its own rendezvous ports (`_dist._free_port`). `-n 0` runs
everything in this process, in order.

[Note: scalar Inductor kernels] The suite's Inductor compiles generate scalar C++
(TORCHINDUCTOR_VEC_ISA_OK=0, set here before torch is imported, so that the ranks, the
examples' torchrun and the tools' subprocesses inherit it). A fresh clone compiles every kernel
with g++; without the vectorized variants the suite's Inductor tests take about a quarter less
time on a cold cache. What the tests check of Inductor is how it compiles deepcompile's graphs
(its ops, its order, its in-place writes, its buffer reuse), which the instruction set does not
change. `TORCHINDUCTOR_VEC_ISA_OK=1` in the environment runs them vectorized."""

from __future__ import annotations

import json
import os
import time

os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")   # [Note: scalar Inductor kernels]

import pytest

import _train
from _dist import LAYERS


def _layer(item) -> str | None:
    name = item.path.parent.name
    return name if name in LAYERS else None


def pytest_collection_modifyitems(session, config, items):
    full_only = pytest.mark.skip(reason="in the full suite only (DEEPCOMPILE_FULL_TESTS=1): "
                                        "[Note: the core matrix] in tests/_train.py")
    for item in items:
        layer = _layer(item)
        if layer is not None:
            item.add_marker(layer)
        if not _train.FULL and item.get_closest_marker("extended") is not None:
            item.add_marker(full_only)
    # the layers in order (a failure in a lower one shows first); within one, as collected
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    items.sort(key=lambda item: rank.get(_layer(item), len(rank)))


def pytest_sessionstart(session):
    session.config._deviations_since = time.strftime("%Y-%m-%dT%H:%M:%S")


def _deviations(config) -> list[dict]:
    """The deviations recorded since this session started (by this process or its workers)."""
    since = getattr(config, "_deviations_since", "")
    try:
        lines = _train.DEVIATION_FILE.read_text().splitlines()
    except OSError:
        return list(_train.DEVIATIONS)
    out = []
    for line in lines:
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if e.get("time", "") >= since:
            out.append(e)
    return out


# seconds of test time (setup, call and teardown) per layer, summed over the workers: the
# controller receives every worker's reports
_LAYER_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    parts = report.nodeid.split("/")
    if len(parts) > 2 and parts[0] == "tests" and parts[1] in LAYERS:
        _LAYER_SECONDS[parts[1]] = _LAYER_SECONDS.get(parts[1], 0.0) + report.duration


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if hasattr(config, "workerinput"):   # an xdist worker: the controller writes the summary
        return
    if _LAYER_SECONDS:
        per_layer = ", ".join(f"{layer} {_LAYER_SECONDS[layer]:.0f} s"
                              for layer in LAYERS if layer in _LAYER_SECONDS)
        terminalreporter.write_line(f"test time per layer (summed over workers): {per_layer}")
    deviations = _deviations(config)
    if not deviations:
        return
    tr = terminalreporter
    tr.section("deepcompile parity deviations (max over steps; vs eager reference)")
    tr.write_line(f"{'scenario':<34} {'world':>5} {'compiler':>8} {'optim':>6} {'gas':>3} "
                  f"{'clip':>5} {'loss dev':>10} {'param dev':>10} {'moved':>8}")
    for e in deviations:
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
