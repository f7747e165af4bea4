"""Model shapes the planner knows: built-in names, or a Hugging Face `config.json`.

A shape is a Hugging Face causal-LM config (architecture + sizes). The planner never builds the
whole model: it builds a one-layer copy of it (pieces.py) whose embedding, first decoder layer,
final norm and head are the pieces it profiles; the full model is `num_hidden_layers` copies of
the layer between them (compose.py).

Built-ins are the public configs' sizes (Llama-3 8B/70B, Llama-3.1 405B, Mixtral 8x7B/8x22B) and
the bench's workloads' models (`deepcompile bench --list`), so that predictions and the bench's
measurements describe the same model.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

_LLAMA3 = dict(vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5,
               max_position_embeddings=8192, tie_word_embeddings=False)

BUILTIN: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-3-8b": ("llama", dict(_LLAMA3, hidden_size=4096, intermediate_size=14336,
                                 num_hidden_layers=32, num_attention_heads=32,
                                 num_key_value_heads=8)),
    "llama-3-70b": ("llama", dict(_LLAMA3, hidden_size=8192, intermediate_size=28672,
                                  num_hidden_layers=80, num_attention_heads=64,
                                  num_key_value_heads=8)),
    "llama-3.1-405b": ("llama", dict(_LLAMA3, hidden_size=16384, intermediate_size=53248,
                                     num_hidden_layers=126, num_attention_heads=128,
                                     num_key_value_heads=8)),
    "mixtral-8x7b": ("mixtral", dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                                     num_hidden_layers=32, num_attention_heads=32,
                                     num_key_value_heads=8, num_local_experts=8,
                                     num_experts_per_tok=2, rope_theta=1e6,
                                     tie_word_embeddings=False)),
    "mixtral-8x22b": ("mixtral", dict(vocab_size=32768, hidden_size=6144,
                                      intermediate_size=16384, num_hidden_layers=56,
                                      num_attention_heads=48, num_key_value_heads=8,
                                      num_local_experts=8, num_experts_per_tok=2,
                                      rope_theta=1e6, tie_word_embeddings=False)),
}


def _bench_models() -> dict[str, tuple[str, dict[str, Any]]]:
    from ..workloads import MODELS

    return {name: (arch, dict(cfg, tie_word_embeddings=False))
            for name, (arch, cfg) in MODELS.items()}


def builtin_names() -> list[str]:
    return list(BUILTIN) + [n for n in _bench_models() if n not in BUILTIN]


@dataclasses.dataclass(frozen=True)
class ModelShape:
    name: str
    arch: str                    # Hugging Face model_type: "llama", "mixtral", "qwen2", ...
    config: dict[str, Any]       # Hugging Face config keys (sizes, rope, ...)

    @property
    def layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def hidden(self) -> int:
        return int(self.config["hidden_size"])

    @property
    def vocab(self) -> int:
        return int(self.config["vocab_size"])

    @property
    def tied(self) -> bool:
        return bool(self.config.get("tie_word_embeddings", False))

    def hf_config(self, *, layers: int | None = None, seq: int = 2048):
        """The transformers config (sdpa attention, no KV cache), optionally with fewer layers."""
        import transformers

        kw = dict(self.config)
        if layers is not None:
            kw["num_hidden_layers"] = layers
        kw["max_position_embeddings"] = max(int(kw.get("max_position_embeddings", 0)), seq, 128)
        kw.update(use_cache=False, attn_implementation="sdpa")
        return transformers.AutoConfig.for_model(self.arch, **kw)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "arch": self.arch, "config": self.config}


def load(spec: str) -> ModelShape:
    """A built-in name, or the path of a Hugging Face config JSON (its `model_type` is the
    architecture)."""
    if spec in BUILTIN:
        arch, cfg = BUILTIN[spec]
        return ModelShape(spec, arch, dict(cfg))
    bench = _bench_models()
    if spec in bench:
        arch, cfg = bench[spec]
        return ModelShape(spec, arch, dict(cfg))
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"deepcompile plan: --model {spec!r} is neither a built-in shape "
                         f"({', '.join(builtin_names())}) nor a config JSON file")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"deepcompile plan: cannot read {spec}: {e}") from None
    arch = cfg.get("model_type")
    missing = [k for k in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size",
                           "num_attention_heads") if k not in cfg]
    if missing:
        raise ValueError(f"deepcompile plan: {spec} lacks {', '.join(missing)}: not a Hugging "
                         "Face causal-LM config")
    keep = {k: v for k, v in cfg.items()
            if not k.startswith("_") and k not in ("architectures", "model_type",
                                                   "transformers_version", "torch_dtype",
                                                   "dtype", "quantization_config")}
    return ModelShape(path.stem if path.stem != "config" else path.parent.name or "config",
                      arch, keep)
