"""pytest setup for the validation harness's tests: a one-rank gloo process group in the
test's own process, as tests/conftest.py's."""

from __future__ import annotations

import pytest


@pytest.fixture
def group(tmp_path):
    import torch
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()
