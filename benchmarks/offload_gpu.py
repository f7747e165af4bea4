"""Optimizer-state offloading on one GPU: a Llama-shaped model whose mixed-precision AdamW
training does not fit under an explicit memory limit, trained by

  ours-offload       deepcompile, passes=("offload_optimizer",), budget under the limit
  ours-offload-host  the same, chunks whose masters go to the host stepping there
                     (DEEPCOMPILE_HOST_STEP=always: offload tier 4)
  ours-offload-streamed  the same, those chunks streamed through the device's step (=never)
  ours-no-offload    deepcompile without offloading, under the same limit (expected: OOM)
  ours-fits          deepcompile without offloading, with the whole GPU (where it still fits)
  fsdp2-cpuoffload   FSDP2 fully_shard with CPUOffloadPolicy (optimizer step on the CPU)
  deepspeed-offload  DeepSpeed ZeRO-3 with offload_optimizer (DeepSpeedCPUAdam)

One command, world size 1:

    python benchmarks/offload_gpu.py

Each system runs in its own process (the limit is `torch.cuda.set_per_process_memory_fraction`,
and an OOM must not poison the others). First `ours-fits` measures the peak of a step with
all state on the GPU; the limit is that peak minus half of the Adam state (so about half of it
has to live on the host), unless `--limit-gib` is given. The default model (~0.95 B parameters,
batch 8 x 1024 tokens) is sized so that the activations, not the optimizer step, make the
difference: the step with all state on the GPU (fp32 masters, gradients, Adam state and the
multi-tensor step's temporaries, ~19 GB) fits under that limit, the backward with all state
on the GPU does not. Per system: tokens/s over the last
`--timed` steps (after warm-up, profiling and planning), peak allocated memory, and the final
loss; a system that cannot run is reported as "not installed" or "failed: <reason>". Writes
JSON under benchmarks/results/<date>-<gpu>/ (never overwriting).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import socket
import subprocess
import sys
import time
import traceback

from _results import write_json  # benchmarks/_results.py (this script's folder)

SYSTEMS = ("ours-fits", "ours-offload", "ours-offload-host", "ours-offload-streamed",
           "ours-no-offload", "fsdp2-cpuoffload", "deepspeed-offload")
HOST_STEP = {"ours-offload-host": "always", "ours-offload-streamed": "never"}   # offload tier 4


def _model(args):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.heads,
                      intermediate_size=args.ffn, max_position_embeddings=args.seq,
                      attn_implementation=args.attn, use_cache=False)
    model = LlamaForCausalLM(cfg)
    if args.checkpoint:   # the model's own activation checkpointing, every N-th decoder layer
        enable = getattr(model, "activation_checkpointing_enable", None)   # transformers >= 5.2x
        if enable is not None:
            enable(every_n_layers=args.checkpoint)
        elif args.checkpoint == 1:
            model.gradient_checkpointing_enable()
        else:
            sys.exit("--checkpoint N > 1 needs transformers' activation_checkpointing_enable")
    return model


def _init_dist(backend: str) -> None:
    import torch
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    torch.cuda.set_device(0)
    dist.init_process_group(backend, device_id=torch.device("cuda", 0))


def _batches(args):
    import torch

    g = torch.Generator().manual_seed(0)
    for _ in range(args.steps):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).cuda()
        yield ids


def _timed_loop(args, step_fn) -> dict:
    import torch

    times, losses = [], []
    for ids in _batches(args):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        losses.append(step_fn(ids))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    timed = times[-args.timed:]
    return {"tokens_per_s": args.batch * args.seq * len(timed) / sum(timed),
            "step_s": sorted(timed)[len(timed) // 2], "losses": losses,
            "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
            "peak_reserved_bytes": torch.cuda.max_memory_reserved()}


def _engine_step(engine, ids) -> float:
    """One step of an engine with the DeepSpeed-style API (ours and DeepSpeed's share it)."""
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    return float(loss.detach())


def run_ours(args, offload: bool) -> dict:
    import torch
    import deepcompile

    _init_dist("nccl")
    model = _model(args).cuda()
    config = {"compiler": args.compiler, "param_dtype": torch.bfloat16,
              "reduce_dtype": torch.float32, "warmup_steps": 2,
              "passes": ("offload_optimizer",) if offload else (),
              "measure_steps": 0}   # the passes named, not timed against the graphs before them
    if args.budget_bytes:
        config["memory_budget"] = int(args.budget_bytes)
    engine = deepcompile.initialize(model, functools.partial(torch.optim.AdamW, lr=1e-4),
                                    config=config)

    out = _timed_loop(args, functools.partial(_engine_step, engine))
    rep = engine.report().to_dict()
    out["offload"] = rep.get("offload")
    out["passes"] = [{"pass": p["pass"], "decisions": {k: v for k, v in p["decisions"].items()
                                                       if k != "curve"}} for p in rep["passes"]]
    out["phase"] = rep["phase"]
    return out


def run_fsdp2(args) -> dict:
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    _init_dist("cpu:gloo,cuda:nccl")
    model = _model(args)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp, offload_policy=CPUOffloadPolicy())
    fully_shard(model, mp_policy=mp, offload_policy=CPUOffloadPolicy())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)   # steps on the CPU (params live there)

    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return _timed_loop(args, step)


def run_deepspeed(args) -> dict:
    try:
        import deepspeed
    except ImportError as e:
        return {"status": f"not installed ({e})"}

    _init_dist("nccl")
    model = _model(args)
    ds_config = {
        "train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0, "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                              "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config)

    return _timed_loop(args, functools.partial(_engine_step, engine))


def child(args) -> None:
    import torch

    if args.limit_bytes:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(args.limit_bytes / total, 1.0), 0)
    try:
        if args.child == "ours-fits":
            out = run_ours(args, offload=False)
        elif args.child in ("ours-offload", *HOST_STEP):
            if args.child in HOST_STEP:   # read by the pass when it plans
                os.environ["DEEPCOMPILE_HOST_STEP"] = HOST_STEP[args.child]
            out = run_ours(args, offload=True)
        elif args.child == "ours-no-offload":
            out = run_ours(args, offload=False)
        elif args.child == "fsdp2-cpuoffload":
            out = run_fsdp2(args)
        else:
            out = run_deepspeed(args)
        out.setdefault("status", "ok")
    except torch.cuda.OutOfMemoryError as e:
        out = {"status": f"failed: out of memory ({str(e).splitlines()[0][:200]})",
               "peak_allocated_bytes": torch.cuda.max_memory_allocated()}
    except Exception as e:  # noqa: BLE001 -- reported, the other systems still run
        out = {"status": f"failed: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}",
               "traceback": traceback.format_exc()[-4000:]}
    print("RESULT " + json.dumps(out, default=str), flush=True)


def _run_child(system: str, args, limit: int | None, budget: int | None) -> dict:
    cmd = [sys.executable, __file__, "--child", system] + _model_args(args)
    if limit:
        cmd += ["--limit-bytes", str(limit)]
    if budget:
        cmd += ["--budget-bytes", str(budget)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired as e:   # the next systems still run, the record is written
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
        return {"status": f"failed: timed out after {args.timeout:g} s", "stderr": err[-4000:]}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        return {"status": f"failed: exit code {proc.returncode}", "stderr": proc.stderr[-4000:]}
    out = json.loads(lines[-1][len("RESULT "):])
    out["wall_s"] = time.perf_counter() - t0
    return out


_MODEL_KEYS = ("layers", "hidden", "ffn", "heads", "vocab", "seq", "batch", "steps", "timed",
               "compiler", "attn", "checkpoint")


def _model_args(args) -> list[str]:
    return [x for k in _MODEL_KEYS for x in (f"--{k}", str(getattr(args, k)))]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--timed", type=int, default=6)
    p.add_argument("--compiler", default="inductor", choices=("inductor", "fx"))
    p.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"))
    p.add_argument("--checkpoint", type=int, default=0, metavar="N",
                   help="activation checkpointing of every N-th decoder layer (0: none), for "
                        "every system (the model's own: Hugging Face's)")
    p.add_argument("--limit-gib", type=float, default=None,
                   help="memory limit for the constrained systems (default: see the docstring)")
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--limit-bytes", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--budget-bytes", type=int, default=None, help=argparse.SUPPRESS)
    return p


def main() -> None:
    args = parser().parse_args()
    if args.child:
        return child(args)

    import torch

    if not torch.cuda.is_available():
        sys.exit("offload_gpu.py needs a CUDA GPU")
    with torch.device("meta"):
        n = sum(x.numel() for x in _model(args).parameters())
    adam_bytes = 8 * n                       # exp_avg + exp_avg_sq, fp32
    results: dict[str, dict] = {}
    if "ours-fits" in args.systems or args.limit_gib is None:
        results["ours-fits"] = _run_child("ours-fits", args, None, None)
        print("ours-fits", json.dumps({k: v for k, v in results["ours-fits"].items()
                                       if k not in ("losses", "passes", "traceback")}), flush=True)
    if args.limit_gib is not None:
        limit = int(args.limit_gib * 2**30)
    else:
        peak = results["ours-fits"].get("peak_allocated_bytes")
        if results["ours-fits"].get("status") != "ok" or not peak:
            sys.exit(f"ours-fits failed, give --limit-gib: {results['ours-fits']}")
        limit = int(peak - adam_bytes // 2)
    budget = int(limit * 0.92)               # headroom for the allocator and the optimizer's temporaries
    for system in args.systems:
        if system == "ours-fits":
            continue
        results[system] = _run_child(system, args, limit,
                                     budget if system.startswith("ours") else None)
        print(system, json.dumps({k: v for k, v in results[system].items()
                                  if k not in ("losses", "passes", "traceback", "stderr")}),
              flush=True)
    props = torch.cuda.get_device_properties(0)
    record = {
        "command": " ".join([sys.executable] + sys.argv),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "gpu": props.name, "gpu_memory_bytes": props.total_memory, "torch": torch.__version__,
        "model": {k: getattr(args, k) for k in _MODEL_KEYS}, "params": n,
        "adam_state_bytes": adam_bytes, "limit_bytes": limit, "ours_budget_bytes": budget,
        "results": results,
    }
    write_json(record, "offload_gpu", args.out, props.name)
    print(f"\nlimit {limit / 2**30:.2f} GiB (ours: budget {budget / 2**30:.2f} GiB); {n / 1e9:.2f} B params")
    print(f"{'system':<20} {'status':<40} {'tokens/s':>10} {'peak GiB':>9}")
    for name, r in results.items():
        tps = r.get("tokens_per_s")
        peak = r.get("peak_allocated_bytes")
        print(f"{name:<20} {r.get('status', '?')[:40]:<40} "
              f"{'-' if tps is None else f'{tps:10.0f}':>10} "
              f"{'-' if peak is None else f'{peak / 2**30:9.2f}':>9}")
    print(f"written: {path}")


if __name__ == "__main__":
    main()
