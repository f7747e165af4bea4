"""`deepcompile demo`: train a tiny Llama on a few ranks, then check it against plain PyTorch.

The job, end to end:

1. spawn ``nproc`` local ranks (gloo on CPU, NCCL on GPUs);
2. every rank builds the same tiny Hugging Face ``LlamaForCausalLM`` from a config (random
   weights from a fixed seed, nothing downloaded) and trains it with ``deepcompile.initialize``
   on byte-level windows of a built-in English text (``workloads.text_windows``), each rank on
   its slice of a deterministic global batch;
3. rank 0 prints progress, what the compiler did (``engine.report()``) and the communication
   counters (``engine.comm_stats()``), and hands its losses and ``engine.full_state_dict()`` to
   the parent;
4. the parent trains the same model with eager PyTorch on the whole global batch in one process
   (``workloads.train_reference``) and compares losses step by step and the final parameters.

The exit status is 0 when the two agree (max |Δloss| below ``LOSS_TOLERANCE``), 1 otherwise.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import shutil
import sys
import tempfile
import time
import traceback
from typing import Any

import torch

from . import spawn, workloads

LOSS_TOLERANCE = 1e-4
# how long the parent waits for the ranks before terminating them (seconds)
JOIN_TIMEOUT_S = float(os.environ.get("DEEPCOMPILE_DEMO_TIMEOUT", 30 * 60))


@dataclasses.dataclass(frozen=True)
class DemoArgs:
    nproc: int = 2
    steps: int = 30
    compiler: str = "fx"
    grad_accum: int = 1
    seed: int = 0
    device: str = "cpu"  # "cpu" (gloo) or "cuda" (nccl)
    per_rank_batch: int = 4
    seq_len: int = 32
    lr: float = 3e-3
    passes: tuple[str, ...] | str = "auto"


# ----------------------------------------------------------------------------------------------
# model and data (shared by the ranks and the reference)

def require_transformers(command: str = "demo"):
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"deepcompile {command} needs the 'transformers' package ({e}); "
                         f"install it with: pip install -c constraints.txt -e '.[{command}]'"
                         ) from None
    return transformers


def build_model(seed: int) -> torch.nn.Module:
    """A tiny Llama with random weights (the bench's tiny-llama); the same `seed` gives the same
    weights everywhere."""
    return workloads.build("tiny-llama", seed=seed)


def make_optimizer_factory(lr: float):
    return functools.partial(torch.optim.AdamW, lr=lr)


# ----------------------------------------------------------------------------------------------
# the reference: one process, plain eager PyTorch, the whole global batch

def train_reference(args: DemoArgs, device: torch.device | str = "cpu"):
    """Returns (per-step losses, {name: final parameter on CPU})."""
    model = build_model(args.seed).to(device)
    windows = workloads.text_windows(args.seq_len)
    global_size = args.per_rank_batch * args.nproc

    def batch(micro: int) -> dict[str, torch.Tensor]:
        x = workloads.text_batch(windows, micro, global_size).to(device)
        return {"input_ids": x, "labels": x}

    ref = workloads.train_reference(model, make_optimizer_factory(args.lr)(model.parameters()),
                                    batch, steps=args.steps, gas=args.grad_accum)
    params = {n: p.detach().cpu() for n, p in model.named_parameters()}
    return ref.losses, params


# ----------------------------------------------------------------------------------------------
# one rank

def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def format_comm_stats(stats: dict[str, Any]) -> str:
    lines = [f"{'collective':<20} {'count':>8} {'bytes':>14}"]
    for name, v in stats.items():
        if isinstance(v, dict):
            count = v.get("count", "")
            nbytes = v.get("bytes")
            b = _human_bytes(nbytes) if isinstance(nbytes, (int, float)) else ""
            lines.append(f"{name:<20} {count!s:>8} {b:>14}")
        else:
            lines.append(f"{name:<20} {v!s:>8}")
    return "\n".join(lines)


def _worker(local_rank: int, world: int, args: DemoArgs) -> dict | None:
    """One rank's training; rank 0 returns its losses and the full state, on the CPU."""
    import torch.distributed as dist

    import deepcompile

    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        model = build_model(args.seed).to(device)
        engine = deepcompile.initialize(
            model,
            optimizer=make_optimizer_factory(args.lr),
            config=deepcompile.Config(compiler=args.compiler, passes=args.passes,
                                      gradient_accumulation_steps=args.grad_accum),
        )
        windows = workloads.text_windows(args.seq_len)
        global_size = args.per_rank_batch * world
        if rank == 0:
            print(f"[demo] {world} ranks ({'nccl' if args.device == 'cuda' else 'gloo'}), "
                  f"compiler={args.compiler}, passes={args.passes if isinstance(args.passes, str) else ','.join(args.passes) or 'none'}, "
                  f"{args.steps} steps x {args.grad_accum} micro-steps, "
                  f"global batch {global_size} x {args.seq_len} tokens, "
                  f"{sum(p.numel() for p in model.parameters()):,} parameters", flush=True)
        losses, times = [], []
        micro = 0
        for step in range(args.steps):
            if args.device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            total = torch.zeros((), device=device)
            for _ in range(args.grad_accum):
                x = workloads.rank_slice(workloads.text_batch(windows, micro, global_size),
                                         rank, args.per_rank_batch).to(device)
                micro += 1
                out = engine(input_ids=x, labels=x)
                engine.backward(out.loss)
                total += out.loss.detach().float()
            engine.step()
            dist.all_reduce(total)
            loss = total.item() / (world * args.grad_accum)
            dt = time.perf_counter() - t0
            losses.append(loss)
            # the first steps, every 5th, the last, and any step that was unusually slow (the
            # engine may profile and recompile after its first steps)
            usual = sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else 0.0
            slow = step > 0 and dt > max(1.0, 5 * usual)
            times.append(dt)
            if rank == 0 and (step < 3 or step == args.steps - 1 or (step + 1) % 5 == 0 or slow):
                note = "  (includes compilation)" if step == 0 else ""
                print(f"[demo] step {step + 1:4d}/{args.steps}  loss {loss:.5f}  "
                      f"{dt * 1000:8.1f} ms{note}", flush=True)
        state = engine.full_state_dict()
        result = None
        if rank == 0:
            print("\n[demo] what the compiler did (engine.report()):", flush=True)
            print(engine.report(), flush=True)
            print("\n[demo] communication on rank 0 (engine.comm_stats()):", flush=True)
            print(format_comm_stats(engine.comm_stats()), flush=True)
            state = {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v
                     for k, v in state.items()}
            result = {"losses": losses, "state": state}
        dist.barrier()
        return result
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# the parent

def _default_inductor_cache() -> tuple[str, bool]:
    """(directory, whether we created a temporary one that should be removed afterwards)."""
    build = os.path.join(os.getcwd(), "build")
    if os.path.isdir(build):
        return os.path.join(build, "inductor-cache"), False
    return tempfile.mkdtemp(prefix="deepcompile-inductor-"), True


def _compare(args: DemoArgs, result: dict, device: str) -> int:
    print(f"\n[demo] reference: the same model trained by plain eager PyTorch in one process on "
          f"the whole global batch ({args.per_rank_batch * args.nproc} sequences)", flush=True)
    t0 = time.perf_counter()
    ref_losses, ref_params = train_reference(args, device=device)
    print(f"[demo] reference done in {time.perf_counter() - t0:.1f} s", flush=True)

    losses = result["losses"]
    deltas = [abs(a - b) for a, b in zip(losses, ref_losses)]
    print(f"\n{'step':>6} {'deepcompile':>14} {'reference':>14} {'|Δ|':>10}")
    shown = sorted({0, 1, 2, len(losses) - 1} | set(range(4, len(losses), 5)))
    for i in shown:
        if 0 <= i < len(losses):
            print(f"{i + 1:>6} {losses[i]:>14.6f} {ref_losses[i]:>14.6f} {deltas[i]:>10.2e}")
    max_dloss = max(deltas) if deltas else math.inf
    if len(losses) != len(ref_losses):
        max_dloss = math.inf

    state = result["state"]
    max_dparam, missing = 0.0, []
    for name, ref in ref_params.items():
        got = state.get(name)
        if got is None:
            missing.append(name)
            continue
        max_dparam = max(max_dparam, (got.float() - ref.float()).abs().max().item())
    print(f"\n[demo] max |Δloss| over {len(losses)} steps: {max_dloss:.2e} "
          f"(tolerance {LOSS_TOLERANCE:.0e})")
    print(f"[demo] max |Δparam| after training, full_state_dict() vs reference: {max_dparam:.2e} "
          f"over {len(ref_params) - len(missing)} parameters")
    if missing:
        print(f"[demo] warning: full_state_dict() lacks {len(missing)} parameters, e.g. "
              f"{missing[:3]}", file=sys.stderr)
    if missing or not max_dloss < LOSS_TOLERANCE:
        print("[demo] WARNING: deepcompile and the reference disagree", file=sys.stderr,
              flush=True)
        return 1
    print("[demo] OK: deepcompile matches single-process PyTorch", flush=True)
    return 0


def run(args: DemoArgs) -> int:
    require_transformers()
    if args.nproc < 1 or args.steps < 1 or args.grad_accum < 1:
        raise SystemExit("deepcompile demo: --nproc, --steps and --grad-accum must be >= 1")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("deepcompile demo: --device cuda but CUDA is not available")
        if args.nproc > torch.cuda.device_count():
            raise SystemExit(f"deepcompile demo: --nproc {args.nproc} > "
                             f"{torch.cuda.device_count()} visible CUDA devices")

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cache_tmp = None
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        cache, created = _default_inductor_cache()
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        cache_tmp = cache if created else None

    try:
        t0 = time.perf_counter()
        try:
            result = spawn.launch(_worker, args.nproc, args, timeout_s=JOIN_TIMEOUT_S,
                                  cpu=args.device == "cpu")[0]
        except spawn.LaunchError as e:   # the others were stopped
            print(f"[demo] error: every rank was stopped:\n{e}", file=sys.stderr, flush=True)
            return 1
        print(f"[demo] distributed run done in {time.perf_counter() - t0:.1f} s", flush=True)
        return _compare(args, result, "cuda:0" if args.device == "cuda" else "cpu")
    except Exception:
        traceback.print_exc()
        return 1
    finally:
        if cache_tmp:
            shutil.rmtree(cache_tmp, ignore_errors=True)
