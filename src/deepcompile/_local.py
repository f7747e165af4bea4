"""Local runs: ranks spawned on this machine, and the eager reference they are checked against.

`spawn(fn, nprocs, args)` runs `fn(local_rank, *args)` in `nprocs` fresh processes (the "spawn"
start method: nothing of the parent's state, CUDA included, is inherited) with torchrun's
environment set (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE) and
OMP_NUM_THREADS=1 unless set; `fn` initializes the process group itself. `deepcompile demo`
and `deepcompile verify` launch their ranks with it.

`train_eager(model, optimizer, batches, forward)` is the single-process reference: plain eager
PyTorch on the whole global batch of every micro-step, `slices` forwards of equal parts of it
when the run it is compared with has as many ranks (see its docstring).

`split_batch`, `to_device` and `call` are how a batch (a tensor, or a dict, list or tuple of
them) is cut per rank, moved and passed to a model, the same way in every process.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import time
from typing import Any, Callable, Iterable, Sequence

import torch


# ----------------------------------------------------------------------------------------------
# launching ranks

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def terminate(processes) -> None:
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()


def _rank_main(local_rank: int, nprocs: int, port: int, fn: Callable, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank),
                      WORLD_SIZE=str(nprocs), LOCAL_RANK=str(local_rank),
                      LOCAL_WORLD_SIZE=str(nprocs))
    fn(local_rank, *args)


def spawn(fn: Callable, nprocs: int, args: tuple = (), *, timeout_s: float = 30 * 60,
          name: str = "deepcompile") -> int:
    """Run `fn(local_rank, *args)` on `nprocs` spawned ranks (see the module docstring); 0 when
    every rank returned, else 1 with the reason printed (a rank's traceback, its exit, or the
    ranks still running after `timeout_s`, then terminated). `fn` and `args` are pickled."""
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.start_processes(_rank_main, args=(nprocs, free_port(), fn, args), nprocs=nprocs,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                print(f"[{name}] error: the ranks did not finish within {timeout_s:g} s; "
                      "terminating them", file=sys.stderr, flush=True)
                terminate(ctx.processes)
                return 1
    except mp.ProcessRaisedException as e:  # a rank raised: its traceback is in the message
        print(f"[{name}] error: a rank failed (the others were stopped):\n{e}", file=sys.stderr,
              flush=True)
        return 1
    except mp.ProcessExitedException as e:  # a rank died (signal, os._exit, ...)
        print(f"[{name}] error: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        terminate(ctx.processes)
        raise
    return 0


# ----------------------------------------------------------------------------------------------
# batches

def split_batch(batch: Any, parts: int) -> list:
    """`batch` cut into `parts` equal slices along dim 0 of every tensor of at least one
    dimension (dicts, lists and tuples recursively; anything else, 0-d tensors included, is the
    same object in every slice). A dimension `parts` does not divide raises ValueError."""
    def cut(x: Any, where: str) -> list:
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            if x.shape[0] % parts:
                raise ValueError(f"the batch's {where or 'tensor'} has {x.shape[0]} rows along "
                                 f"dim 0, which {parts} ranks cannot share equally; make the "
                                 f"global batch a multiple of {parts}")
            return [t.contiguous() for t in x.chunk(parts)]
        if isinstance(x, dict):
            per = {k: cut(v, f"{where}[{k!r}]") for k, v in x.items()}
            return [type(x)((k, v[i]) for k, v in per.items()) for i in range(parts)]
        if isinstance(x, (list, tuple)):
            per = [cut(v, f"{where}[{j}]") for j, v in enumerate(x)]
            return [type(x)(v[i] for v in per) if not hasattr(x, "_fields")
                    else type(x)(*(v[i] for v in per)) for i in range(parts)]
        return [x] * parts
    return cut(batch, "")


def to_device(batch: Any, device: torch.device | str) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return type(batch)((k, to_device(v, device)) for k, v in batch.items())
    if isinstance(batch, (list, tuple)):
        moved = [to_device(v, device) for v in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    return batch


def call(model: Callable, batch: Any) -> Any:
    """`model(**batch)` for a dict, `model(*batch)` for a list or tuple, else `model(batch)`."""
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (list, tuple)):
        return model(*batch)
    return model(batch)


# ----------------------------------------------------------------------------------------------
# the reference

@dataclasses.dataclass
class EagerStep:
    losses: list[float]        # per micro-step: the loss of its global batch (mean of the slices)
    no_grad: list[str]         # trainable parameters autograd gave no gradient in this step


def train_eager(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                batches: Iterable[Sequence[Any]], forward: Callable[[torch.nn.Module, Any], torch.Tensor],
                *, slices: int = 1, max_grad_norm: float | None = None,
                after_step: Callable[[int, torch.nn.Module], None] | None = None) -> list[EagerStep]:
    """Train `model` with plain eager PyTorch in this process; one `EagerStep` per optimizer step.

    batches: per optimizer step, its micro-steps' global batches (one micro-step: a list of one).
    forward(model, batch): the scalar loss of `batch`.
    slices: each global batch is forwarded as `slices` equal parts (`split_batch`), each loss
        divided by slices * micro-steps before its backward: the gradient of the mean loss
        over the parts, as data parallelism over `slices` ranks computes it (a batch-coupled
        module such as BatchNorm normalizes each part apart, as it does on each rank). With a
        loss that is a mean over equal parts this is the gradient of the whole batch's loss.
    max_grad_norm: clip the global gradient norm (`torch.nn.utils.clip_grad_norm_`) first.
    after_step(step, model): called after each optimizer step.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    out: list[EagerStep] = []
    for step, micro_batches in enumerate(batches):
        micro_batches = list(micro_batches)
        parts = slices * len(micro_batches)
        losses = []
        for batch in micro_batches:
            total = 0.0
            for part in (split_batch(batch, slices) if slices > 1 else [batch]):
                loss = forward(model, part)
                (loss / parts if parts > 1 else loss).backward()
                total += loss.item()
            losses.append(total / slices)
        no_grad = [n for n, p in named if p.grad is None]
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out.append(EagerStep(losses, no_grad))
        if after_step is not None:
            after_step(step, model)
    return out
