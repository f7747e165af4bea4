"""`deepcompile demo`: train a tiny Llama on a few ranks, then check it against plain PyTorch.

The job, end to end:

1. spawn ``nproc`` local ranks (gloo on CPU, NCCL on GPUs);
2. every rank builds the same tiny Hugging Face ``LlamaForCausalLM`` from a config (random
   weights from a fixed seed, nothing downloaded) and trains it with ``deepcompile.initialize``
   on byte-level windows of a built-in English text, each rank on its slice of a deterministic
   global batch;
3. rank 0 prints progress, what the compiler did (``engine.report()``) and the communication
   counters (``engine.comm_stats()``), and hands its losses and ``engine.full_state_dict()`` to
   the parent;
4. the parent trains the same model with eager PyTorch on the whole global batch in one process
   and compares losses step by step and the final parameters.

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

from ._local import spawn, train_eager

LOSS_TOLERANCE = 1e-4
# how long the parent waits for the ranks before terminating them (seconds)
JOIN_TIMEOUT_S = float(os.environ.get("DEEPCOMPILE_DEMO_TIMEOUT", 30 * 60))

# A few paragraphs of plain English, tokenized as bytes (vocabulary 256).
TEXT = """\
Training a large neural network on one device is limited by the memory of that device. The
parameters, their gradients and the state of the optimizer all have to fit, and for a model with
billions of parameters trained with Adam they take sixteen bytes or more per parameter before a
single activation is stored. Data parallel training copies the model to every device and gives each
device a different slice of the batch. It makes training faster, but it does not make the model
any smaller: every device still holds every parameter.

Sharded data parallelism removes that redundancy. Each device keeps only its own shard of the
parameters, of the gradients and of the optimizer state. Just before a layer runs, the devices
exchange their shards with an all-gather so that every device briefly holds the full weights of
that layer; as soon as the layer is done the full copy is freed again. In the backward pass the
gradients of a layer are summed across devices with a reduce-scatter, which leaves each device
with the gradient of exactly the shard it owns, and the optimizer updates that shard locally.

The cost of this scheme is communication. A naive schedule waits for every all-gather before it
computes, and the devices sit idle while bytes cross the network. Good schedules start each
gather early enough to overlap it with the computation of earlier layers, keep small parameters
resident, and release large ones as soon as their last use has passed. Finding such a schedule by
hand means rewriting the model around hooks and wrappers.

A compiler can do it instead. When the whole training step is captured as a graph, every use of
every parameter is visible at once. A pass can insert the gather right before the first use, the
release right after the last one, and the reduce-scatter right where the gradient is produced.
Later passes can move those operations to hide their latency, or decide that some parameters are
worth keeping whole. The model code stays exactly as it was written, and the same graph can be
profiled, rewritten and measured again until the schedule is good.

Small experiments are the best place to check such a system. A model with a hundred thousand
parameters, a short text and two processes on one machine are enough to compare the sharded run
against a single process that trains the same model on the same data. If the compiler is right,
the two runs agree to the last few digits, step after step.
"""


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
    """A tiny Llama with random weights; the same `seed` gives the same weights everywhere."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,  # byte-level tokens
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        use_cache=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.train()
    return model


def make_windows(seq_len: int, text: str = TEXT) -> torch.Tensor:
    """The text as bytes, cut into non-overlapping windows: int64 tensor [num_windows, seq_len]."""
    data = list(text.encode())
    n = len(data) // seq_len
    if n == 0:
        raise ValueError(f"text of {len(data)} bytes is shorter than one window of {seq_len}")
    return torch.tensor(data[: n * seq_len], dtype=torch.long).view(n, seq_len)


def global_batch(windows: torch.Tensor, micro_step: int, global_size: int) -> torch.Tensor:
    """The `micro_step`-th global batch: `global_size` consecutive windows, wrapping around."""
    n = windows.shape[0]
    idx = [(micro_step * global_size + i) % n for i in range(global_size)]
    return windows[idx]


def rank_slice(batch: torch.Tensor, rank: int, per_rank: int) -> torch.Tensor:
    return batch[rank * per_rank:(rank + 1) * per_rank]


def make_optimizer_factory(lr: float):
    return functools.partial(torch.optim.AdamW, lr=lr)


# ----------------------------------------------------------------------------------------------
# the reference: one process, plain eager PyTorch, the whole global batch

def train_reference(args: DemoArgs, device: torch.device | str = "cpu"):
    """Returns (per-step losses, {name: final parameter on CPU})."""
    model = build_model(args.seed).to(device)
    opt = make_optimizer_factory(args.lr)(model.parameters())
    windows = make_windows(args.seq_len)
    global_size = args.per_rank_batch * args.nproc
    gas = args.grad_accum
    batches = ([global_batch(windows, step * gas + m, global_size).to(device) for m in range(gas)]
               for step in range(args.steps))
    steps = train_eager(model, opt, batches, lambda m, x: m(input_ids=x, labels=x).loss)
    losses = [sum(s.losses) / len(s.losses) for s in steps]
    params = {n: p.detach().cpu() for n, p in model.named_parameters()}
    return losses, params


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


def _worker(local_rank: int, args: DemoArgs, result_path: str) -> None:
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
        windows = make_windows(args.seq_len)
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
                x = rank_slice(global_batch(windows, micro, global_size), rank,
                               args.per_rank_batch).to(device)
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
        if rank == 0:
            print("\n[demo] what the compiler did (engine.report()):", flush=True)
            print(engine.report(), flush=True)
            print("\n[demo] communication on rank 0 (engine.comm_stats()):", flush=True)
            print(format_comm_stats(engine.comm_stats()), flush=True)
            state = {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v
                     for k, v in state.items()}
            torch.save({"losses": losses, "state": state}, result_path)
        dist.barrier()
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

    tmp = tempfile.mkdtemp(prefix="deepcompile-demo-")
    try:
        result_path = os.path.join(tmp, "rank0.pt")
        t0 = time.perf_counter()
        rc = spawn(_worker, args.nproc, (args, result_path), timeout_s=JOIN_TIMEOUT_S,
                   name="demo")
        if rc != 0:
            return rc
        if not os.path.exists(result_path):
            print("[demo] error: rank 0 finished without writing its results", file=sys.stderr)
            return 1
        print(f"[demo] distributed run done in {time.perf_counter() - t0:.1f} s", flush=True)
        result = torch.load(result_path, weights_only=False)
        return _compare(args, result, "cuda:0" if args.device == "cuda" else "cpu")
    except Exception:
        traceback.print_exc()
        return 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if cache_tmp:
            shutil.rmtree(cache_tmp, ignore_errors=True)
