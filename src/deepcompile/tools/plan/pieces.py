"""The pieces of a model the planner profiles: embedding, one decoder layer, head (with the loss).

A one-layer copy of the model is built from its Hugging Face config — under a `FakeTensorMode`
for a shape too large to hold (a Llama-3-70B layer is 0.86 G parameters: 1.7 GB in bf16,
3.4 GB in fp32, plus its activations), or with real random weights for a shape small enough to
run here (then its graphs can be timed: a host profile, host.py). Each piece is a pure function of its
parameters and inputs, called through `torch.func.functional_call`, so that AOTAutograd can
trace it (trace.py):

    embed(wte, ids)                       -> hidden
    layer(*layer_params, hidden, cos, sin) -> hidden
    head(norm, lm_head, hidden, labels)    -> loss               (Hugging Face's causal-LM loss)

Parameter names are the full model's (`model.layers.{i}....` for the layer's, with `{i}` the
layer index filled in by compose.py); a tied head uses the embedding's parameter by name.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import torch

from ... import _compat
from .shapes import ModelShape

LAYER = "model.layers.{i}."


@dataclasses.dataclass
class Piece:
    name: str                       # "embed", "layer", "head"
    fn: Callable[..., Any]          # fn(*params, *inputs) -> output or tuple of outputs
    param_names: list[str]          # full-model names; a layer's contain "{i}"
    params: list[torch.Tensor]
    inputs: list[torch.Tensor]
    input_roles: list[str]          # "ids", "labels", "hidden", "cos", "sin"
    output_roles: list[str]


@dataclasses.dataclass
class Pieces:
    shape: ModelShape
    batch: int
    seq: int
    dtype: torch.dtype
    fake: bool
    mode: Any                       # the FakeTensorMode (fake) or None
    embed: Piece
    layer: Piece
    head: Piece
    model: Any = None               # the one-layer model the pieces are parts of

    def all(self) -> list[Piece]:
        return [self.embed, self.layer, self.head]

    def context(self):
        return self.mode if self.mode is not None else contextlib.nullcontext()


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _model_class(arch: str):
    import transformers

    return transformers.AutoModelForCausalLM._model_mapping[
        type(transformers.AutoConfig.for_model(arch))]


def build(shape: ModelShape, *, batch: int, seq: int, dtype: torch.dtype = torch.bfloat16,
          fake: bool = True, seed: int = 0) -> Pieces:
    """The three pieces of `shape` at `batch` x `seq` tokens, parameters in `dtype`."""
    config = shape.hf_config(layers=1, seq=seq)
    mode = _compat.fake_tensor_mode() if fake else None
    with (mode if fake else contextlib.nullcontext()), _default_dtype(dtype):
        torch.manual_seed(seed)
        model = _model_class(shape.arch)(config)
        if not fake:
            model = model.to(dtype)
        model.train()
        ids = torch.randint(0, shape.vocab, (batch, seq))
        labels = ids.clone()
        position_ids = torch.arange(seq).unsqueeze(0)
        hidden = torch.randn(batch, seq, shape.hidden, dtype=dtype, requires_grad=True)
    inner, layer = model.model, model.model.layers[0]

    def named(module, prefix):
        return [(prefix + n, p) for n, p in module.named_parameters()]

    def call(module, names, values, *args, **kwargs):
        return torch.func.functional_call(module, dict(zip(names, values)), args, kwargs)

    # embedding; the rotary tables every layer reads are computed once, here (not traced:
    # a few KiB, alive over the whole step, like the token ids)
    e_named = named(inner.embed_tokens, "")
    e_names = [n for n, _ in e_named]

    def embed_fn(*a):
        return call(inner.embed_tokens, e_names, a[:-1], a[-1])

    with (mode if fake else contextlib.nullcontext()), torch.no_grad():
        cos, sin = inner.rotary_emb(hidden, position_ids)
    embed = Piece("embed", embed_fn, ["model.embed_tokens." + n for n in e_names],
                  [p for _, p in e_named], [ids], ["ids"], ["hidden"])

    # one decoder layer
    l_named = named(layer, "")
    l_names = [n for n, _ in l_named]

    def layer_fn(*a):
        k = len(l_names)
        h, c, s = a[k:]
        out = call(layer, l_names, a[:k], h, position_embeddings=(c, s), attention_mask=None)
        return out[0] if isinstance(out, tuple) else out

    lp = Piece("layer", layer_fn, [LAYER + n for n in l_names], [p for _, p in l_named],
               [hidden, cos, sin], ["hidden", "cos", "sin"], ["hidden"])

    # final norm, head and the loss
    tied = shape.tied
    norm_w = inner.norm.weight
    head_w = model.lm_head.weight
    loss_fn = model.loss_function

    def head_fn(nw, hw, h, lab):
        x = call(inner.norm, ["weight"], [nw], h)
        logits = torch.nn.functional.linear(x, hw)
        return loss_fn(logits=logits, labels=lab, vocab_size=shape.vocab)

    head = Piece("head", head_fn,
                 ["model.norm.weight", "model.embed_tokens.weight" if tied else "lm_head.weight"],
                 [norm_w, head_w], [hidden, labels], ["hidden", "labels"], ["loss"])
    return Pieces(shape, batch, seq, dtype, fake, mode, embed, lp, head, model)


def param_numels(pieces: Pieces) -> dict[str, int]:
    """Every parameter of the full model (`{i}` expanded) and its number of elements."""
    out: dict[str, int] = {}
    for piece in pieces.all():
        for name, p in zip(piece.param_names, piece.params):
            if "{i}" in name:
                for i in range(pieces.shape.layers):
                    out[name.format(i=i)] = p.numel()
            else:
                out[name] = p.numel()
    return out
