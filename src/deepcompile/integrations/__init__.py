"""Integrations with other training frameworks (imported on demand: each needs its extra).

- `deepcompile.integrations.hf.DeepCompileTrainer`: a `transformers.Trainer` that trains through
  a deepcompile engine (pip install -c constraints.txt -e '.[hf]').
"""
