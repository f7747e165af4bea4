"""Deterministic model and data builders shared by the distributed tests.

Every builder seeds the global RNG before constructing, so the reference process and every
rank get bit-identical initial weights.  Data is generated per micro-step from a dedicated
`torch.Generator`, as one *global* batch; rank r trains on slice r of the batch dimension and
the reference trains on the whole batch.

Models:
  mlp          Linear(13, 37) -> GELU -> Linear(37, 29) -> Linear(29, 7); sizes are divisible by
               neither 2, 3 nor 4, so every shard is padded.  `mlp_nobias` is the same without biases.
  llama        tiny HF LlamaForCausalLM (vocab 128, hidden 32, 2 layers, 4 heads / 2 kv heads).
  llama4       the same with 4 decoder layers (host work against depth).
  llama_tied   the same with tie_word_embeddings=True (embed_tokens.weight is lm_head.weight).
  llama_ckpt   the same with activation checkpointing (gradient_checkpointing_enable()).
  llama_dropout the same with dropout on the attention weights (attention_dropout=0.1).
  mixtral      tiny HF MixtralForCausalLM (4 experts, top-2, hidden 32, 2 layers), with
               transformers' default experts implementation ("grouped_mm": one graph, a custom
               op with its own autograd); `mixtral_eager` uses experts_implementation="eager"
               (a data-dependent loop over the hit experts: nonzero -> graph breaks).
  graph_break  two blocks with torch._dynamo.graph_break() between them; `shared` is used on
               both sides of the break, i.e. in two compiled graphs.
  disabled     a submodule called from a @torch.compiler.disable method (runs eagerly, outside
               every compiled graph) between compiled Linear layers.
  loop_break   a loop over an nn.ModuleList with a graph break inside the loop body.
  nested_break a graph break inside a submodule's forward, then a loop (with a graph break)
               that uses the submodule's own parameter directly: runs eagerly after Dynamo
               traced the submodule's call (and hooks) into the enclosing graph.
  disabled_forward  a submodule that reads its own parameter directly, whose forward the
               user wrapped with torch.compiler.disable (the way to run a submodule eagerly):
               Dynamo graph-breaks at its call, and it runs eagerly between compiled graphs.
  loop_count   code after a graph break that reads data: a loop run `int(k.max())` times
               (`COUNTS`, the same on every rank, changing from micro-step to micro-step), which
               Dynamo unrolls: one graph per count, over the same parameters.
  branch_count the same code with a branch instead of the loop: one of two paths over the same
               parameters by the parity of the count.
  odd_head     an MLP whose head `aux` is used only on some optimizer steps (the batch's
               `use_aux`), with a parameter `never` that is never used.
  nograd_read  `fc2.weight` first read under no_grad (a statistic), then by `fc2` with
               gradients; `inference_read` under inference_mode, `detach_read` through .detach().
  mean_teacher a teacher forward under no_grad before the student's; they share `stem`
               (`mean_teacher_apart`: they share no parameter).
  vq           a VQ codebook: distances under no_grad, then the lookup of the nearest codes.
  moe_skip     an experts loop over an nn.ModuleList that skips an expert with no token; the
               data routes the two halves of the batch to different experts on some micro-steps
               (then two ranks run different experts; `moe_skip_early`: from the first one);
               `moe_skip_disabled`: each expert's forward wrapped with torch.compiler.disable.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 128
SEQ = 16          # tokens per sequence for the causal LMs
MLP_IN, MLP_OUT = 13, 7
GLOBAL_BATCH = 8  # divisible by 1, 2 and 4 ranks
SEED = 1234


# --------------------------------------------------------------------------------- models
class MLP(nn.Module):
    def __init__(self, bias: bool = True):
        super().__init__()
        self.fc1 = nn.Linear(MLP_IN, 37, bias=bias)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(37, 29, bias=bias)
        self.fc3 = nn.Linear(29, MLP_OUT, bias=bias)

    def forward(self, x, y):
        out = self.fc3(self.fc2(self.act(self.fc1(x))))
        return F.mse_loss(out, y)


class GraphBreakModel(nn.Module):
    """Two compiled regions; `shared` appears in both (so it is used by two graphs)."""

    def __init__(self):
        super().__init__()
        self.block1 = nn.Sequential(nn.Linear(MLP_IN, 23), nn.Tanh())
        self.shared = nn.Linear(23, 23)
        self.block2 = nn.Sequential(nn.Linear(23, 19), nn.Tanh(), nn.Linear(19, MLP_OUT))

    def forward(self, x, y):
        h = torch.tanh(self.shared(self.block1(x)))
        torch._dynamo.graph_break()
        h = self.shared(h) + h
        out = self.block2(h)
        return F.mse_loss(out, y)


class DisabledSubmoduleModel(nn.Module):
    """`side` only ever runs inside a @torch.compiler.disable method (eagerly)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(MLP_IN, 21)
        self.side = nn.Linear(21, 21)
        self.out = nn.Linear(21, MLP_OUT)

    @torch.compiler.disable
    def eager_part(self, h):
        return torch.relu(self.side(h)) + h

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        h = self.eager_part(h)
        out = self.out(h)
        return F.mse_loss(out, y)


class LoopBreakModel(nn.Module):
    """A loop over an nn.ModuleList with a graph break in the loop body."""

    def __init__(self, n_layers: int = 3):
        super().__init__()
        self.inp = nn.Linear(MLP_IN, 17)
        self.layers = nn.ModuleList(nn.Linear(17, 17) for _ in range(n_layers))
        self.out = nn.Linear(17, MLP_OUT)

    def forward(self, x, y):
        h = self.inp(x)
        for layer in self.layers:
            h = torch.tanh(layer(h))
            torch._dynamo.graph_break()
            h = h * 0.9
        out = self.out(h)
        return F.mse_loss(out, y)


class _NestedBreakInner(nn.Module):
    """Owns a parameter it uses directly (not through a submodule) after a graph break, in a
    loop with a graph break in its body -- the shape of HF Mixtral's eager experts loop."""

    def __init__(self, dim: int):
        super().__init__()
        self.w = nn.Parameter(torch.randn(dim, dim) / dim ** 0.5)

    def forward(self, h):
        h = torch.tanh(h)
        torch._dynamo.graph_break()
        for _ in range(2):
            h = h @ self.w
            torch._dynamo.graph_break()
        return h


class NestedBreakModel(nn.Module):
    """A graph break inside a submodule's forward (Dynamo inlined the call, so the submodule's
    hooks were traced, then resumes inside it and runs the loop eagerly)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(MLP_IN, 17)
        self.inner = _NestedBreakInner(17)
        self.out = nn.Linear(17, MLP_OUT)

    def forward(self, x, y):
        out = self.out(self.inner(self.inp(x)))
        return F.mse_loss(out, y)


class _OwnWeight(nn.Module):
    """Uses its own parameter directly (not through a submodule)."""

    def __init__(self, dim: int):
        super().__init__()
        self.w = nn.Parameter(torch.randn(dim, dim) / dim ** 0.5)

    def forward(self, h):
        return torch.tanh(h @ self.w) + h


class DisabledForwardModel(nn.Module):
    """`inner`'s forward is wrapped with torch.compiler.disable by the user, on the instance
    (as one would for a third-party class): it always runs eagerly."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(MLP_IN, 19)
        self.inner = _OwnWeight(19)
        self.inner.forward = torch.compiler.disable(self.inner.forward)
        self.out = nn.Linear(19, MLP_OUT)

    def forward(self, x, y):
        out = self.out(self.inner(torch.tanh(self.inp(x))))
        return F.mse_loss(out, y)


class DataDependentModel(nn.Module):
    """`loop_count` / `branch_count` (see the module docstring)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.inp = nn.Linear(MLP_IN, 16)
        self.cell = nn.Linear(32, 16)
        self.out = nn.Linear(16, MLP_OUT)

    def forward(self, x, y, k):
        h = torch.tanh(self.inp(x))
        s = h
        n = int(k.max())   # a graph break: what follows is compiled once per value
        if self.kind == "loop":
            for _ in range(n):
                s = torch.tanh(self.cell(torch.cat([h, s], -1)))
        elif n % 2:
            s = torch.tanh(self.cell(torch.cat([h, s], -1)))
        else:
            s = torch.sigmoid(self.cell(torch.cat([s * h, h], -1))) + s
        return F.mse_loss(self.out(s), y)


class OddHead(nn.Module):
    """`aux` is used only where the batch says `use_aux` (some optimizer steps have no gradient
    for it); `never` is never used. AdamW's weight decay moves a parameter that a step steps."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(MLP_IN, 21)
        self.never = nn.Parameter(torch.randn(5))
        self.fc2 = nn.Linear(21, MLP_OUT)
        self.aux = nn.Linear(21, MLP_OUT)

    def forward(self, x, y, use_aux: bool = False):
        h = torch.tanh(self.fc1(x))
        out = self.fc2(h)
        if use_aux:
            out = out + self.aux(h)
        return F.mse_loss(out, y)


class NoGradRead(nn.Module):
    """`fc2.weight` is first read without a gradient (under `no_grad`, `inference_mode`, or
    through `.detach()`), then by `fc2` itself: it trains through the second use."""

    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode
        self.fc1 = nn.Linear(MLP_IN, 19)
        self.fc2 = nn.Linear(19, 19)
        self.fc3 = nn.Linear(19, MLP_OUT)

    def forward(self, x, y):
        h = torch.tanh(self.fc1(x))
        if self.mode == "no_grad":
            with torch.no_grad():
                s = self.fc2.weight.std()
        elif self.mode == "inference_mode":
            with torch.inference_mode():
                s = self.fc2.weight.std()
        else:
            s = self.fc2.weight.detach().std()
        h = torch.tanh(self.fc2(h) / (s * 4.0))
        return F.mse_loss(self.fc3(h), y)


class MeanTeacher(nn.Module):
    """A teacher forward under `no_grad` before the student's: `stem` is shared by both (first
    read by the teacher; `shared=False`: the teacher has a stem of its own), the teacher's own
    layers never get a gradient."""

    def __init__(self, shared: bool = True):
        super().__init__()
        self.stem = nn.Linear(MLP_IN, 17)
        self.teacher_stem = self.stem if shared else nn.Linear(MLP_IN, 17)
        self.student = nn.Sequential(nn.Tanh(), nn.Linear(17, MLP_OUT))
        self.teacher = nn.Sequential(nn.Tanh(), nn.Linear(17, MLP_OUT))

    def forward(self, x, y):
        with torch.no_grad():
            t = self.teacher(self.teacher_stem(x))
        s = self.student(self.stem(x))
        return F.mse_loss(s, y) + 0.5 * F.mse_loss(s, t)


class VQ(nn.Module):
    """Vector quantization: distances to the codebook under `no_grad`, then the lookup of the
    nearest codes (their gradient trains the codebook), straight-through to the decoder."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(MLP_IN, 6)
        self.codebook = nn.Embedding(11, 6)
        self.dec = nn.Linear(6, MLP_OUT)

    def forward(self, x, y):
        z = self.enc(x)
        with torch.no_grad():
            idx = torch.cdist(z, self.codebook.weight).argmin(-1)
        q = self.codebook(idx)
        out = self.dec(z + (q - z).detach())
        return F.mse_loss(out, y) + F.mse_loss(q, z.detach()) + 0.25 * F.mse_loss(z, q.detach())


class _Expert(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, h):
        return torch.tanh(self.fc(h))


class MoESkip(nn.Module):
    """The classic loop over an `nn.ModuleList` of experts that skips an expert no token is
    routed to. The route is the sign of the first feature (the data gives the two halves of a
    batch opposite signs on some micro-steps: then two ranks run different experts); the gate
    weights train the router. `disabled`: each expert's forward wrapped with
    `torch.compiler.disable` (it runs eagerly)."""

    def __init__(self, disabled: bool = False):
        super().__init__()
        self.inp = nn.Linear(MLP_IN, 12)
        self.router = nn.Linear(12, 2)
        self.experts = nn.ModuleList(_Expert(12) for _ in range(2))
        if disabled:
            for e in self.experts:
                e.forward = torch.compiler.disable(e.forward)
        self.out = nn.Linear(12, MLP_OUT)

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        gate = torch.softmax(self.router(h), -1)
        choice = (x[:, 0] > 0).long()
        mixed = h
        for i, expert in enumerate(self.experts):
            idx = (choice == i).nonzero().squeeze(-1)
            if idx.numel() == 0:
                continue
            mixed = mixed.index_add(0, idx, expert(h[idx]) * gate[idx, i:i + 1])
        return F.mse_loss(self.out(mixed), y)


def _llama(tie: bool, layers: int = 2, checkpointed: bool = False,
           dropout: float = 0.0) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
        tie_word_embeddings=tie, attn_implementation="eager", attention_dropout=dropout,
    )
    model = LlamaForCausalLM(cfg)
    if checkpointed:   # every decoder layer's activations recomputed in the backward
        # (use_cache=True would make HF log a warning in the forward: a graph break)
        model.config.use_cache = False
        enable = getattr(model, "activation_checkpointing_enable", None)   # transformers >= 5.2x
        (enable or model.gradient_checkpointing_enable)()
    if tie:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def _mixtral(experts: str) -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=48, max_position_embeddings=64,
        num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
        attn_implementation="eager", experts_implementation=experts,
    )
    model = MixtralForCausalLM(cfg)
    assert model.config._experts_implementation == experts
    return model


_BUILDERS = {
    "mlp": lambda: MLP(bias=True),
    "mlp_nobias": lambda: MLP(bias=False),
    "llama": lambda: _llama(tie=False),
    "llama4": lambda: _llama(tie=False, layers=4),
    "llama_tied": lambda: _llama(tie=True),
    "llama_ckpt": lambda: _llama(tie=False, checkpointed=True),
    "llama_dropout": lambda: _llama(tie=False, dropout=0.1),
    "mixtral": lambda: _mixtral("grouped_mm"),       # transformers' default; one graph
    "mixtral_eager": lambda: _mixtral("eager"),      # loop over hit experts: graph breaks
    "graph_break": GraphBreakModel,
    "disabled": DisabledSubmoduleModel,
    "loop_break": LoopBreakModel,
    "nested_break": NestedBreakModel,
    "disabled_forward": DisabledForwardModel,
    "loop_count": lambda: DataDependentModel("loop"),
    "branch_count": lambda: DataDependentModel("branch"),
    "odd_head": OddHead,
    "nograd_read": lambda: NoGradRead("no_grad"),
    "inference_read": lambda: NoGradRead("inference_mode"),
    "detach_read": lambda: NoGradRead("detach"),
    "mean_teacher": MeanTeacher,
    "mean_teacher_apart": lambda: MeanTeacher(shared=False),
    "vq": VQ,
    "moe_skip": MoESkip,
    "moe_skip_disabled": lambda: MoESkip(disabled=True),
    "moe_skip_early": MoESkip,
}

# the count `loop_count` and `branch_count` read at each micro-step (cycled): 4 and 5 first come
# late, after the passes planned (the steady state, with the tests' schedules)
COUNTS = (1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 4, 3, 2, 1, 4, 2, 1, 3, 2, 5, 1, 5, 2, 3)

MODEL_NAMES = tuple(_BUILDERS)
LM_MODELS = ("llama", "llama4", "llama_tied", "llama_ckpt", "llama_dropout", "mixtral",
             "mixtral_eager")


def build_model(name: str, seed: int = SEED) -> nn.Module:
    """A freshly initialised fp32 CPU model; the same `seed` gives bit-identical weights."""
    torch.manual_seed(seed)
    model = _BUILDERS[name]()
    return model.float().train()


# ----------------------------------------------------------------------------------- data
def global_batch(name: str, micro_step: int, seed: int = SEED) -> dict[str, torch.Tensor]:
    """The global batch (GLOBAL_BATCH rows) of micro-step `micro_step`, as model kwargs."""
    g = torch.Generator().manual_seed(seed * 1000 + micro_step)
    if name in LM_MODELS:
        # learnable sequences (so that losses fall within a few steps): a random first token,
        # then t -> (5 t + 3) mod VOCAB (a bijection: the next token is a function of this one)
        ids = torch.empty(GLOBAL_BATCH, SEQ, dtype=torch.long)
        ids[:, 0] = torch.randint(0, VOCAB, (GLOBAL_BATCH,), generator=g)
        for j in range(1, SEQ):
            ids[:, j] = (ids[:, j - 1] * 5 + 3) % VOCAB
        return {"input_ids": ids, "labels": ids.clone()}
    x = torch.randn(GLOBAL_BATCH, MLP_IN, generator=g)
    y = torch.randn(GLOBAL_BATCH, MLP_OUT, generator=g)
    if name in ("loop_count", "branch_count"):   # every row (so every rank) reads one count
        return {"x": x, "y": y,
                "k": torch.full((GLOBAL_BATCH,), COUNTS[micro_step % len(COUNTS)])}
    if name.startswith("moe_skip"):
        # every rank's rows go to both experts, but in micro-steps 2, 6, 10, ... (`early`: also
        # 0, 4, 8, ...) the first half of the batch goes to expert 1 only and the second half to
        # expert 0 only
        sign = torch.ones(GLOBAL_BATCH)
        if micro_step % 4 == 2 or (name == "moe_skip_early" and micro_step % 4 == 0):
            sign[GLOBAL_BATCH // 2:] = -1
        else:
            sign[1::2] = -1
        x[:, 0] = sign * (x[:, 0].abs() + 0.1)
    if name == "odd_head":   # `aux` used in micro-steps 2, 3, 6, 7, ...
        return {"x": x, "y": y, "use_aux": (micro_step // 2) % 2 == 1}
    return {"x": x, "y": y}


def local_batch(name: str, micro_step: int, rank: int, world: int,
                seed: int = SEED) -> dict[str, torch.Tensor]:
    """Rank `rank`'s slice (GLOBAL_BATCH / world rows) of the global batch."""
    assert GLOBAL_BATCH % world == 0, (GLOBAL_BATCH, world)
    per = GLOBAL_BATCH // world
    return {k: v[rank * per:(rank + 1) * per].contiguous() if isinstance(v, torch.Tensor) else v
            for k, v in global_batch(name, micro_step, seed).items()}


def loss_of(output, batch=None) -> torch.Tensor:
    """The scalar loss of a model output (a tensor for ours, `.loss` for HF models); `batch`
    is unused (the reference loop's `loss_of(output, batch)`)."""
    if isinstance(output, torch.Tensor):
        return output
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, (tuple, list)):
        loss = output[0]
    if loss is None and isinstance(output, dict):
        loss = output["loss"]
    return loss
