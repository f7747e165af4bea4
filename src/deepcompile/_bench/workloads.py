"""The work every system does: model shape, data, optimizer, batch, accumulation, dtype.

A workload is everything that must be identical across the systems of one comparison. Models are
Hugging Face Llama / Mixtral built from a config (random weights from `seed`, nothing
downloaded); data is a deterministic *global* batch per micro-step (learnable sequences, so the
loss falls within a few steps), of which rank r trains on slice r. `train_reference` trains the
same model with plain eager PyTorch in one process on the whole global batch: the oracle every
system's losses are compared with.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

# AdamW hyper-parameters shared by every system (and the reference).
ADAMW = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01}

# name -> (architecture, HF config kwargs). Sizes are chosen so a launch is short on 2 CPU
# cores (tiny, small) or so the model is "about 1B parameters" (GPU mode).
_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny-llama": ("llama", dict(vocab_size=256, hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2)),
    "small-llama": ("llama", dict(vocab_size=2048, hidden_size=256, intermediate_size=688,
                                  num_hidden_layers=4, num_attention_heads=8,
                                  num_key_value_heads=4)),
    "tiny-mixtral": ("mixtral", dict(vocab_size=256, hidden_size=64, intermediate_size=96,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2)),
    # TinyLlama-1.1B's shape (22 layers, hidden 2048, GQA 32/4 heads, vocab 32000)
    "llama-1b": ("llama", dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                               num_hidden_layers=22, num_attention_heads=32,
                               num_key_value_heads=4)),
}


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str                 # e.g. "tiny-llama-gas4"
    model: str                # a key of _MODELS
    seq: int                  # tokens per sequence
    batch: int                # sequences per rank per micro-step
    gas: int = 1              # micro-steps per optimizer step
    dtype: str = "float32"    # compute dtype ("bfloat16": fp32 masters, bf16 compute)
    seed: int = 0

    @property
    def vocab(self) -> int:
        return _MODELS[self.model][1]["vocab_size"]

    def tokens_per_step(self, world: int) -> int:
        return self.seq * self.batch * self.gas * world

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["model_config"] = dict(_MODELS[self.model][1], arch=_MODELS[self.model][0])
        return d


def _w(model: str, seq: int, batch: int, gas: int = 1, **kw) -> Workload:
    suffix = "" if gas == 1 else f"-gas{gas}"
    return Workload(f"{model}{suffix}", model, seq, batch, gas, **kw)


WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    _w("tiny-llama", seq=64, batch=4),
    _w("tiny-llama", seq=64, batch=4, gas=4),
    _w("small-llama", seq=128, batch=4),
    _w("small-llama", seq=128, batch=4, gas=4),
    _w("tiny-mixtral", seq=64, batch=4),
    _w("tiny-mixtral", seq=64, batch=4, gas=4),
    # batch 1, short sequences: where ZeRO-1's communication is most exposed (the paper's
    # ZeRO-1 setting, scaled down)
    Workload("tiny-llama-b1", "tiny-llama", seq=32, batch=1),
    Workload("small-llama-b1", "small-llama", seq=128, batch=1),
    _w("llama-1b", seq=1024, batch=4, dtype="bfloat16"),
    # the GPU paths on a tiny model (tests/test_bench.py, marked gpu)
    Workload("tiny-llama-bf16", "tiny-llama", seq=64, batch=4, dtype="bfloat16"),
)}


def get(name: str) -> Workload:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    return WORKLOADS[name]


def build_model(w: Workload, device: str | torch.device = "cpu") -> torch.nn.Module:
    """The workload's model in fp32, initialized on `device` from `w.seed` (identical in every
    process that builds it on the same kind of device)."""
    import transformers

    arch, kwargs = _MODELS[w.model]
    common = dict(max_position_embeddings=max(w.seq, 128), use_cache=False,
                  tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(w.seed)
    with torch.device(device):  # a 1B model is initialized on the GPU, not by one CPU thread
        if arch == "llama":
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, **kwargs))
        else:
            model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**common, **kwargs))
    return model.float().train()


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The transformer blocks (what FSDP2 shards and torchtitan compiles one by one)."""
    return model.model.layers


def num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@functools.lru_cache(maxsize=64)
def _global_ids(vocab: int, seq: int, rows: int, seed: int, micro_step: int) -> torch.Tensor:
    # a random first token, then t -> (5 t + 3) mod vocab: the next token is a function of this
    # one, so the loss falls quickly and a wrong gradient shows
    g = torch.Generator().manual_seed(seed * 100003 + micro_step)
    ids = torch.empty(rows, seq, dtype=torch.long)
    ids[:, 0] = torch.randint(0, vocab, (rows,), generator=g)
    for j in range(1, seq):
        ids[:, j] = (ids[:, j - 1] * 5 + 3) % vocab
    return ids


def global_batch(w: Workload, micro_step: int, world: int) -> torch.Tensor:
    """Token ids of micro-step `micro_step` for all `world` ranks: [world * batch, seq]."""
    return _global_ids(w.vocab, w.seq, w.batch * world, w.seed, micro_step)


def local_batch(w: Workload, micro_step: int, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s slice of the global batch: [batch, seq]."""
    return global_batch(w, micro_step, world)[rank * w.batch:(rank + 1) * w.batch].contiguous()


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, **ADAMW)


def train_reference(w: Workload, world: int, steps: int, rank_slice: int | None = None,
                    device: str = "cpu") -> list[float]:
    """Plain eager PyTorch in this process, one thread on the CPU: the loss of every optimizer
    step (mean over its micro-steps). `rank_slice=None` trains on the global batch of `world`
    ranks; an int trains on that rank's slice only (the single-process compute bound's own
    data). fp32, or fp32 parameters under bf16 autocast for a bf16 workload."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build_model(w, device)
        opt = make_optimizer(model.parameters())
        amp = torch.autocast(torch.device(device).type, dtype=getattr(torch, w.dtype),
                             enabled=w.dtype != "float32")
        losses = []
        for step in range(steps):
            total = 0.0
            for m in range(w.gas):
                micro = step * w.gas + m
                ids = (global_batch(w, micro, world) if rank_slice is None
                       else local_batch(w, micro, rank_slice, world)).to(device)
                with amp:
                    loss = model(input_ids=ids, labels=ids).loss
                (loss / w.gas).backward()
                total += loss.item()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(total / w.gas)
        return losses
    finally:
        torch.set_num_threads(threads)
