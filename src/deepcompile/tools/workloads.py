"""The work the tools train: tiny models, their data, and the eager reference they are checked
against.

A bench workload is everything that must be identical across the systems of one comparison.
Models are Hugging Face Llama / Mixtral built from a config (random weights from `seed`, nothing
downloaded); data is a deterministic *global* batch per micro-step (learnable sequences, so the
loss falls within a few steps), of which rank r trains on slice r. The demo trains the smallest
of them on byte-level windows of a built-in text (`text_windows`). `train_reference` is the one
eager training loop of the project (demo, bench and tests): plain PyTorch in one process on the
whole global batch, the oracle every distributed run's losses are compared with.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable

import torch

# AdamW hyper-parameters shared by every system (and the reference).
ADAMW = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01}

# name -> (architecture, HF config kwargs). Sizes are chosen so a launch is short on 2 CPU
# cores (tiny, small) or so the model is "about 1B parameters" (GPU mode).
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
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
    model: str                # a key of MODELS
    seq: int                  # tokens per sequence
    batch: int                # sequences per rank per micro-step
    gas: int = 1              # micro-steps per optimizer step
    dtype: str = "float32"    # compute dtype ("bfloat16": fp32 masters, bf16 compute)
    seed: int = 0

    @property
    def vocab(self) -> int:
        return MODELS[self.model][1]["vocab_size"]

    def tokens_per_step(self, world: int) -> int:
        return self.seq * self.batch * self.gas * world

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["model_config"] = dict(MODELS[self.model][1], arch=MODELS[self.model][0])
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
    # the GPU paths on a tiny model (tests/tools/test_bench.py, marked gpu)
    Workload("tiny-llama-bf16", "tiny-llama", seq=64, batch=4, dtype="bfloat16"),
)}


def get(name: str) -> Workload:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    return WORKLOADS[name]


def build_model(w: Workload, device: str | torch.device = "cpu") -> torch.nn.Module:
    """The workload's model in fp32, initialized on `device` from `w.seed` (identical in every
    process that builds it on the same kind of device)."""
    return build(w.model, seed=w.seed, seq=w.seq, device=device)


def build(model: str, *, seed: int = 0, seq: int = 128,
          device: str | torch.device = "cpu") -> torch.nn.Module:
    """Model `model` of MODELS in fp32, initialized on `device` from `seed`, for sequences up
    to `seq` tokens (at least 128)."""
    import transformers

    arch, kwargs = MODELS[model]
    common = dict(max_position_embeddings=max(seq, 128), use_cache=False,
                  tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(seed)
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


def reference_losses(w: Workload, world: int, steps: int, rank: int | None = None,
                     device: str = "cpu") -> list[float]:
    """The workload trained by `train_reference`: the loss of every optimizer step.
    `rank=None` trains on the global batch of `world` ranks; an int trains on that rank's slice
    only (the single-process compute bound's own data). fp32, or fp32 parameters under bf16
    autocast for a bf16 workload."""
    model = build_model(w, device)

    def batch(micro: int) -> dict[str, torch.Tensor]:
        ids = (global_batch(w, micro, world) if rank is None
               else local_batch(w, micro, rank, world)).to(device)
        return {"input_ids": ids, "labels": ids}

    dtype = getattr(torch, w.dtype)
    return train_reference(model, make_optimizer(model.parameters()), batch, steps=steps,
                           gas=w.gas, autocast=None if dtype == torch.float32 else dtype).losses


# ------------------------------------------------------------------------------ the demo's data
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


def text_windows(seq_len: int, text: str = TEXT) -> torch.Tensor:
    """The text as bytes, cut into non-overlapping windows: int64 tensor [num_windows, seq_len]."""
    data = list(text.encode())
    n = len(data) // seq_len
    if n == 0:
        raise ValueError(f"text of {len(data)} bytes is shorter than one window of {seq_len}")
    return torch.tensor(data[: n * seq_len], dtype=torch.long).view(n, seq_len)


def text_batch(windows: torch.Tensor, micro_step: int, global_size: int) -> torch.Tensor:
    """The `micro_step`-th global batch: `global_size` consecutive windows, wrapping around."""
    n = windows.shape[0]
    idx = [(micro_step * global_size + i) % n for i in range(global_size)]
    return windows[idx]


def rank_slice(batch: torch.Tensor, rank: int, per_rank: int) -> torch.Tensor:
    return batch[rank * per_rank:(rank + 1) * per_rank]


# ------------------------------------------------------------------------------------ batches
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


# --------------------------------------------------------------------- the eager reference loop
@dataclasses.dataclass
class Reference:
    """What `train_reference` measured: the loss of every micro-step (the mean over its
    slices), the global gradient norm of every optimizer step (before clipping), and the
    trainable parameters autograd gave no gradient in each optimizer step."""
    micro_losses: list[float]
    grad_norms: list[float]
    gas: int
    no_grad: list[list[str]] = dataclasses.field(default_factory=list)

    @property
    def losses(self) -> list[float]:
        """The loss of every optimizer step: the mean over its micro-steps."""
        g = self.gas
        return [sum(self.micro_losses[i:i + g]) / g for i in range(0, len(self.micro_losses), g)]


def _lm_loss(output, batch=None) -> torch.Tensor:
    return output.loss


def train_reference(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    batch: Callable[[int], Any], *, steps: int, gas: int = 1,
                    loss_of: Callable[..., torch.Tensor] = _lm_loss, slices: int = 1,
                    max_grad_norm: float | None = None,
                    autocast: torch.dtype | None = None,
                    after_step: Callable[[int, torch.nn.Module], None] | None = None) -> Reference:
    """Train `model` with plain eager PyTorch in this process, on one CPU thread: `steps`
    optimizer steps of `gas` micro-steps; micro-step m on the global batch `batch(m)` (a
    tensor, or a dict / list / tuple of them, passed as `call` passes it), its loss `loss_of(
    output, batch)` (a Hugging Face model's `.loss` by default) divided by `gas` before its
    backward; the gradients clipped to `max_grad_norm` where given; under autocast to
    `autocast` where given; `after_step(step, model)` after each optimizer step.

    [Note: the reference of data parallelism] With `slices` > 1 each global batch is forwarded
    as that many equal parts (`split_batch`), each loss divided by slices x gas before its
    backward: the gradient of the mean loss over the parts, which is what data parallelism
    over `slices` ranks computes (a batch-coupled module such as BatchNorm normalizes each part
    apart, as it does on each rank). Each distributed run of the tools and the tests is
    compared with this."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        params = [p for _, p in named]
        device = params[0].device.type
        amp = contextlib.nullcontext() if autocast is None else \
            torch.autocast(device, dtype=autocast)
        parts = slices * gas
        losses, norms, no_grad = [], [], []
        for step in range(steps):
            for m in range(gas):
                whole = batch(step * gas + m)
                total = 0.0
                for part in (split_batch(whole, slices) if slices > 1 else [whole]):
                    with amp:
                        loss = loss_of(call(model, part), part)
                    (loss / parts if parts > 1 else loss).backward()
                    total += loss.item()
                losses.append(total / slices)
            no_grad.append([n for n, p in named if p.grad is None])
            if max_grad_norm is not None:
                norms.append(float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm)))
            else:
                norms.append(float(torch.nn.utils.get_total_norm(
                    [p.grad for p in params if p.grad is not None])))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if after_step is not None:
                after_step(step, model)
        return Reference(losses, norms, gas, no_grad)
    finally:
        torch.set_num_threads(threads)
