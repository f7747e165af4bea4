#!/usr/bin/env python3
"""Train a Llama with the Hugging Face Trainer and deepcompile (DeepCompileTrainer).

    torchrun --nproc-per-node 8 examples/hf_trainer.py --bf16 --max-steps 1000 --output-dir out
    torchrun --nproc-per-node 8 examples/hf_trainer.py --bf16 --max-steps 1000 --output-dir out --resume
    # smallest setting (what CI runs): 2 CPU ranks over gloo
    torchrun --nproc-per-node 2 examples/hf_trainer.py --max-steps 2 --compiler fx --output-dir out

Everything is the Trainer's (TrainingArguments: batch sizes, accumulation, LR schedule,
logging, checkpoints every --save-steps with rotation, resume); `DeepCompileTrainer` trains
through `deepcompile.initialize` with the ZeRO stage of `--zero-stage`. The model is a tiny Llama
built from a config (random weights; `--model DIR` loads one with from_pretrained); the data
are byte-level windows of `--data FILE` (default: this file).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

import deepcompile
from deepcompile.integrations.hf import DeepCompileTrainer


class TokenWindows(torch.utils.data.Dataset):
    def __init__(self, path: str, seq_len: int):
        data = torch.frombuffer(bytearray(open(path, "rb").read()), dtype=torch.uint8).long()
        n = len(data) // seq_len
        self.windows = data[: n * seq_len].view(n, seq_len)

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, i):
        return {"input_ids": self.windows[i], "labels": self.windows[i]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a Hugging Face model directory (default: tiny Llama)")
    p.add_argument("--data", default=__file__)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--per-device-batch", type=int, default=2)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--save-steps", type=int, default=10)
    p.add_argument("--zero-stage", type=int, default=3, choices=(1, 2, 3))
    p.add_argument("--compiler", default=None, choices=("inductor", "fx"))
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--resume", action="store_true", help="resume from the last checkpoint")
    args = p.parse_args(argv)

    from transformers import (AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM,
                              TrainingArguments)

    cuda = torch.cuda.is_available()
    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    else:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            use_cache=False))
    training_args = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps,
        per_device_train_batch_size=args.per_device_batch,
        gradient_accumulation_steps=args.grad_accum, learning_rate=args.lr,
        lr_scheduler_type="cosine", warmup_steps=max(1, args.max_steps // 10), weight_decay=0.1,
        max_grad_norm=1.0, bf16=args.bf16, logging_steps=1, save_strategy="steps",
        save_steps=args.save_steps, save_total_limit=2, report_to="none", use_cpu=not cuda,
        dataloader_num_workers=0, seed=0)
    trainer = DeepCompileTrainer(
        model=model, args=training_args, train_dataset=TokenWindows(args.data, args.seq_len),
        deepcompile_config=deepcompile.Config(
            zero_stage=args.zero_stage, compiler=args.compiler or ("inductor" if cuda else "fx")))
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    trainer.save_model(os.path.join(args.output_dir, "final"))   # every rank; rank 0 writes
    if trainer.is_world_process_zero():
        print(f"done at step {trainer.state.global_step}; model in "
              f"{os.path.join(args.output_dir, 'final')}", flush=True)
    if torch.distributed.is_initialized():   # the Trainer started it: end it here, not in the
        torch.distributed.destroy_process_group()   # interpreter's teardown
    return 0


if __name__ == "__main__":
    sys.exit(main())
