#!/usr/bin/env python3
"""Train a Llama data-parallel with deepcompile (ZeRO-1/2/3 by compilation), launched by torchrun.

    # 8 GPUs on one node, bf16, 4 micro-steps per optimizer step, checkpoints every 100 steps
    torchrun --nproc-per-node 8 examples/train_llama.py --model 1b --bf16 --grad-accum 4 \
        --steps 1000 --ckpt-dir ckpt --save-every 100
    # the same run, resumed from its last checkpoint (any number of GPUs)
    torchrun --nproc-per-node 8 examples/train_llama.py --model 1b --bf16 --grad-accum 4 \
        --steps 1000 --ckpt-dir ckpt --save-every 100 --resume
    # smallest setting (what CI runs): 2 CPU ranks over gloo
    torchrun --nproc-per-node 2 examples/train_llama.py --model tiny --compiler fx --steps 4

Multi-node: the same command on every node with `--nnodes N --node-rank I --rdzv-backend
c10d --rdzv-endpoint HOST:PORT` (README: "Launching"). Each process uses GPU LOCAL_RANK
(`torch.cuda.set_device`), builds the model on it and hands it to `deepcompile.initialize`;
without CUDA it trains on the CPU over gloo.

Data: byte-level tokens (vocabulary 256 of the model's) of `--data FILE` (default: this file),
cut into windows of `--seq-len`, shuffled by a DistributedSampler; the position in the data,
the LR schedule (linear warm-up, cosine decay) and the step are saved with each checkpoint
(`client_state`) and restored by `--resume`. Logged every `--log-every` steps (rank 0): loss
(mean over ranks), learning rate, the gradient norm before clipping (`engine.metrics()`),
tokens/s (all ranks), peak memory; a progress bar with tqdm; a line as each phase of
deepcompile's setup begins, and when its plan is final (from then on the steps run the final
code: time from there; docs/guide/setup.md).
`engine.metrics()` every step to TensorBoard (`--tensorboard DIR`) and/or W&B (`--wandb
PROJECT`): step time, tokens/s, FLOP/s and MFU (GPUs whose peak is known), exposed
communication, peak memory, collectives per step, gradient norm. `--plot-dir DIR` traces one
steady step (forward, backward and optimizer step) and writes the report and its pictures.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import resource
import sys
import time

import torch
import torch.distributed as dist

import deepcompile

PRESETS = {   # LlamaConfig fields; "1b" is TinyLlama-1.1B's shape
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=256),
    "small": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, vocab_size=32000),
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
               num_attention_heads=32, num_key_value_heads=4, vocab_size=32000),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny",
                   help=f"a preset ({', '.join(PRESETS)}) with random weights, or a Hugging Face "
                        "model directory (from_pretrained)")
    p.add_argument("--data", default=__file__, help="a text file (byte-level tokens)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per rank per micro-step")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps in total")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=2, help="linear warm-up steps, then cosine")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--zero-stage", type=int, default=3, choices=(1, 2, 3))
    p.add_argument("--compiler", default=None, choices=("inductor", "fx"),
                   help="default: inductor on GPUs, fx on the CPU")
    p.add_argument("--passes", default=None,
                   help="optimization passes, comma-separated (default: the stage's default)")
    p.add_argument("--bf16", action="store_true", help="compute in bfloat16 (fp32 masters)")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="activation checkpointing (model.gradient_checkpointing_enable())")
    p.add_argument("--ckpt-dir", default=None, help="checkpoint directory")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (and at the end)")
    p.add_argument("--async-save", action="store_true", help="checkpoints written in the background")
    p.add_argument("--resume", action="store_true", help="continue from --ckpt-dir if it holds one")
    p.add_argument("--save-pretrained", default=None, help="write the final model here (HF format)")
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="write engine.metrics() every step as TensorBoard scalars (rank 0; "
                        "pip install -c constraints.txt -e '.[tensorboard]')")
    p.add_argument("--wandb", default=None, metavar="PROJECT",
                   help="log engine.metrics() to Weights & Biases (rank 0; pip install wandb)")
    p.add_argument("--plot-dir", default=None, metavar="DIR",
                   help="trace one steady step and, at the end, write the report and its "
                        "pictures there (engine.plot; needs matplotlib)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop-after", type=int, default=None,
                   help="leave after this many steps of this launch, as if preempted (tests resume)")
    return p.parse_args(argv)


def setup() -> tuple[torch.device, int, int]:
    """The process group from torchrun's environment; this process's device."""
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500"), ("RANK", "0"),
                       ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)   # plain `python train_llama.py`: one process
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)   # before any CUDA work, NCCL included
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device, dist.get_rank(), dist.get_world_size()


def build_model(args, device: torch.device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if args.model in PRESETS:
        config = LlamaConfig(max_position_embeddings=max(args.seq_len, 128), use_cache=False,
                             attn_implementation="sdpa", **PRESETS[args.model])
        torch.manual_seed(args.seed)   # the same weights on every rank (rank 0's are used)
        with device:
            model = LlamaForCausalLM(config)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
        model.to(device)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    return model.train()


class TokenWindows(torch.utils.data.Dataset):
    def __init__(self, path: str, seq_len: int):
        data = torch.frombuffer(bytearray(open(path, "rb").read()), dtype=torch.uint8).long()
        n = len(data) // seq_len
        if n == 0:
            raise SystemExit(f"{path}: shorter than one window of {seq_len} tokens")
        self.windows = data[: n * seq_len].view(n, seq_len)

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, i):
        return self.windows[i]


def batches(loader, sampler, epoch: int, skip: int):
    """(epoch, index in epoch, batch) forever, starting `skip` batches into `epoch`."""
    while True:
        sampler.set_epoch(epoch)
        for i, batch in enumerate(loader):
            if i >= skip:
                yield epoch, i, batch
        epoch, skip = epoch + 1, 0


def lr_lambda(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def peak_memory(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB allocated"
    return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB RSS"


class MetricsSink:
    """engine.metrics() to TensorBoard and/or W&B, on rank 0 (what a training script logs)."""

    KEYS = ("step_s", "tokens_per_s", "flops_per_s", "mfu", "exposed_comm_s",
            "exposed_comm_s_measured", "peak_memory_bytes", "collectives_per_step", "grad_norm")

    def __init__(self, args, rank: int) -> None:
        self.tb = self.run = None
        if rank != 0:
            return
        if args.tensorboard:
            from torch.utils.tensorboard import SummaryWriter   # needs the tensorboard package
            self.tb = SummaryWriter(args.tensorboard)
        if args.wandb:
            import wandb
            self.run = wandb.init(project=args.wandb, config=vars(args))

    def log(self, step: int, metrics: dict, loss: float | None, lr: float) -> None:
        values = {f"deepcompile/{k}": metrics[k] for k in self.KEYS if metrics.get(k) is not None}
        values["train/lr"] = lr
        if loss is not None:
            values["train/loss"] = loss
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(k, v, step)
            self.tb.add_text("deepcompile/phase", metrics["phase"], step)
        if self.run is not None:
            self.run.log({**values, "deepcompile/phase": metrics["phase"]}, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.run is not None:
            self.run.finish()


def main(argv=None) -> int:
    args = parse_args(argv)
    device, rank, world = setup()
    model = build_model(args, device)
    dataset = TokenWindows(args.data, args.seq_len)
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=world, rank=rank,
                                                  shuffle=True, seed=args.seed, drop_last=True)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.micro_batch, sampler=sampler,
                                         drop_last=True)
    if len(loader) == 0:
        raise SystemExit("not enough data for one micro-batch per rank")
    config = deepcompile.Config(
        zero_stage=args.zero_stage,
        compiler=args.compiler or ("inductor" if device.type == "cuda" else "fx"),
        gradient_accumulation_steps=args.grad_accum,
        max_grad_norm=args.max_grad_norm or None,
        param_dtype=torch.bfloat16 if args.bf16 else None,
        passes=None if args.passes is None else tuple(p for p in args.passes.split(",") if p))
    engine = deepcompile.initialize(
        model, optimizer=functools.partial(torch.optim.AdamW, lr=args.lr, betas=(0.9, 0.95),
                                           weight_decay=args.weight_decay), config=config)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        engine.optimizer, functools.partial(lr_lambda, warmup=args.warmup, total=args.steps))

    step, epoch, position = 0, 0, 0
    if args.resume and args.ckpt_dir and os.path.exists(args.ckpt_dir):
        client = engine.load_checkpoint(args.ckpt_dir)   # any world size
        scheduler.load_state_dict(client["scheduler"])
        step, epoch, position = client["step"], client["epoch"], client["position"]
        if rank == 0:
            print(f"resumed from {args.ckpt_dir} at step {step}", flush=True)

    def save(pending):
        if pending is not None:
            pending.result()   # one background save at a time
        state = {"scheduler": scheduler.state_dict(), "step": step, "epoch": epoch,
                 "position": position}
        if args.async_save:   # returns at once; the data was copied
            return engine.save_checkpoint(args.ckpt_dir, client_state=state, async_save=True)
        engine.save_checkpoint(args.ckpt_dir, client_state=state)
        return None

    bar = None
    if rank == 0:
        try:
            from tqdm import tqdm
            bar = tqdm(total=args.steps, initial=step, desc="train", unit="step",
                       disable=not sys.stderr.isatty())
        except ImportError:
            pass
    data = batches(loader, sampler, epoch, position)
    sink = MetricsSink(args, rank)
    traced = False
    pending = None
    tokens_since, t_since = 0, time.perf_counter()
    launched = 0
    shown = None   # the setup phase last shown

    def show_setup():   # where deepcompile's setup is, as each phase begins (docs/guide/setup.md)
        nonlocal shown
        if rank != 0 or engine.phase == shown:
            return
        shown = engine.phase
        line = (f"setup: step {step + 1}: {shown}" if engine.setup_steps is None else
                f"setup done ({engine.setup_steps} steps): steady state from step {step + 1}")
        if bar is not None and not bar.disable:
            bar.write(line)
        else:
            print(line, flush=True)

    show_setup()
    while step < args.steps:
        losses = []
        if args.plot_dir and not traced and engine.phase == "steady":
            traced = engine.trace_next_step()   # this whole step, for --plot-dir's timeline
        for _ in range(args.grad_accum):
            epoch, index, ids = next(data)
            position = index + 1
            ids = ids.to(device, non_blocking=True)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            losses.append(loss.detach())
            tokens_since += ids.numel() * world
        engine.step()
        scheduler.step()
        step += 1
        launched += 1
        show_setup()
        metrics = engine.metrics()   # cheap: every step
        mean = None
        if step % args.log_every == 0 or step == args.steps:
            mean = torch.stack(losses).mean().float()
            dist.all_reduce(mean)
            mean = mean.item() / world
            elapsed = time.perf_counter() - t_since
            if rank == 0:
                line = (f"step {step}/{args.steps} loss {mean:.8f} lr {scheduler.get_last_lr()[0]:.3e} "
                        f"grad norm {metrics['grad_norm']:.4f} "
                        f"tokens/s {tokens_since / elapsed:,.0f} peak memory {peak_memory(device)}")
                if bar is not None and not bar.disable:
                    bar.set_postfix_str(f"loss {mean:.4f}")
                    bar.write(line)
                else:
                    print(line, flush=True)
            tokens_since, t_since = 0, time.perf_counter()
        sink.log(step, metrics, mean, scheduler.get_last_lr()[0])
        if bar is not None:
            bar.update(1)
        if args.ckpt_dir and ((args.save_every and step % args.save_every == 0)
                              or step == args.steps):
            pending = save(pending)
        if args.stop_after is not None and launched >= args.stop_after:
            break
    if pending is not None:
        pending.result()
    if args.save_pretrained:
        engine.save_pretrained(args.save_pretrained)
    sink.close()
    if args.plot_dir:
        paths = engine.plot(args.plot_dir)   # every rank (collective); rank 0 writes
        if rank == 0:
            print(engine.report(), flush=True)
            print("wrote " + ", ".join(paths), flush=True)
    if bar is not None:
        bar.close()
    if rank == 0:
        print(f"done at step {step}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
