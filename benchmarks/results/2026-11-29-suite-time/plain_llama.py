"""A plain-PyTorch Llama of the tests' tiny HF Llama's shape (same module names), for compile_cost.py."""
import math, torch, torch.nn as nn, torch.nn.functional as F

class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__(); self.weight = nn.Parameter(torch.ones(d)); self.eps = eps
    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)

class Attn(nn.Module):
    def __init__(self, d, h, kv, dropout):
        super().__init__()
        self.h, self.kv, self.hd = h, kv, d // h
        self.q_proj = nn.Linear(d, h * self.hd, bias=False)
        self.k_proj = nn.Linear(d, kv * self.hd, bias=False)
        self.v_proj = nn.Linear(d, kv * self.hd, bias=False)
        self.o_proj = nn.Linear(h * self.hd, d, bias=False)
        self.dropout = dropout
    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.h, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv, self.hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = self.h // self.kv
        k = k.repeat_interleave(rep, dim=1); v = v.repeat_interleave(rep, dim=1)
        w = (q @ k.transpose(-1, -2)) / math.sqrt(self.hd)
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        w = w.masked_fill(mask, float("-inf")).softmax(-1)
        w = F.dropout(w, self.dropout, self.training)
        return self.o_proj((w @ v).transpose(1, 2).reshape(b, s, -1))

class MLPb(nn.Module):
    def __init__(self, d, i):
        super().__init__()
        self.gate_proj = nn.Linear(d, i, bias=False); self.up_proj = nn.Linear(d, i, bias=False)
        self.down_proj = nn.Linear(i, d, bias=False)
    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

class Layer(nn.Module):
    def __init__(self, d, h, kv, i, dropout):
        super().__init__()
        self.self_attn = Attn(d, h, kv, dropout); self.mlp = MLPb(d, i)
        self.input_layernorm = RMSNorm(d); self.post_attention_layernorm = RMSNorm(d)
    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))

class Body(nn.Module):
    def __init__(self, vocab, d, layers, h, kv, i, dropout):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Layer(d, h, kv, i, dropout) for _ in range(layers))
        self.norm = RMSNorm(d)
        hd = d // h
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        self.register_buffer("inv_freq", inv, persistent=False)

class Llama(nn.Module):
    def __init__(self, vocab=128, d=32, layers=2, h=4, kv=2, i=64, tie=False, dropout=0.0):
        super().__init__()
        self.model = Body(vocab, d, layers, h, kv, i, dropout)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tie: self.lm_head.weight = self.model.embed_tokens.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)): nn.init.normal_(m.weight, std=0.02)
    def forward(self, input_ids, labels=None):
        x = self.model.embed_tokens(input_ids)
        s = input_ids.shape[1]
        t = torch.arange(s, device=x.device, dtype=torch.float32)
        f = torch.outer(t, self.model.inv_freq); emb = torch.cat((f, f), -1)
        cos, sin = emb.cos(), emb.sin()
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.model.norm(x))
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
