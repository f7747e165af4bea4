"""Which attention a Hugging Face model's training step runs, compiled and eager (stop 32;
journal/gpu-readiness.md).

Under Dynamo (as deepcompile's graphs and plain `torch.compile` see the model), with
transformers 5.23 and torch 2.11.0, 2.13.0 and 2.14.1 alike (run on the CPU), Llama builds an
explicit causal mask and calls SDPA with `attn_mask=<bool>, is_causal=False`; run eagerly it
passes no mask (`is_causal=True`). (transformers' masking_utils expects compiled runs to skip it
once pytorch#176499 is in; 2.14.1 does not yet.)
On CUDA a mask rules out the flash kernel, so the compiled systems of the bench could run a
slower attention than the eager peers, and the planner's roofline (causal flash everywhere)
would under-count theirs. For each way, eager and compiled (`--backend`, Inductor by
default), one forward and backward of the workload, reporting:

  * the SDPA calls' `attn_mask` (present or not) and `is_causal`: eager, as the calls are made
    (a TorchFunctionMode); compiled, as Dynamo's graph has them;
  * the attention ops that ran (torch.profiler: `aten::_scaled_dot_product_flash_attention`,
    `..._efficient_attention`, `..._cudnn_attention`, `..._math`, ...), with their time.

    python benchmarks/attention_path.py --workload llama-1b                 # on the GPU
    python benchmarks/attention_path.py --workload tiny-llama --device cpu

Writes JSON (`--out`, default benchmarks/results/<date>-<device>-attention/).
"""

from __future__ import annotations

import argparse
import platform
import sys

from _results import write_json  # benchmarks/_results.py (this script's folder)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="llama-1b", help="a bench workload (deepcompile bench)")
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--backend", default="inductor",
                   help="torch.compile backend of the compiled way (default inductor)")
    p.add_argument("--out", default=None, help="folder for the JSON")
    return p


def _sdpa_calls_eager(model, ids) -> list[dict]:
    import torch
    from torch.overrides import TorchFunctionMode

    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls = []

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is sdpa:
                mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
                calls.append({"attn_mask": mask is not None,
                              "is_causal": bool(kwargs.get("is_causal", False))})
            return func(*args, **kwargs)

    with Watch():
        model(input_ids=ids, labels=ids).loss.backward()
    return calls


def _sdpa_calls_compiled(model, ids) -> list[dict]:
    import torch

    calls = []

    def capture(gm, _example_inputs):   # Dynamo's graph, as deepcompile's backend gets it
        for n in gm.graph.nodes:
            if n.op == "call_function" and "scaled_dot_product" in str(n.target):
                mask = n.kwargs.get("attn_mask", n.args[3] if len(n.args) > 3 else None)
                calls.append({"attn_mask": mask is not None,
                              "is_causal": bool(n.kwargs.get("is_causal", False))})
        return gm.forward

    torch.compiler.reset()
    torch.compile(model, backend=capture)(input_ids=ids, labels=ids)
    return calls


def _attention_ops(fn, cuda: bool) -> dict[str, dict]:
    """The attention ops one call of `fn` ran (the second call: the first compiles)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    if cuda:
        torch.cuda.synchronize()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        if e.key.startswith("aten::") and "attention" in e.key:
            dev = getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0.0))
            out[e.key] = {"count": e.count, "cpu_ms": e.cpu_time_total / 1e3,
                          "device_ms": dev / 1e3}
    return out


def measure(workload: str, device: str, backend: str) -> dict:
    import torch

    from deepcompile.tools import workloads as W

    w = W.get(workload)
    cuda = torch.device(device).type == "cuda"
    torch.manual_seed(w.seed)
    model = W.build_model(w, device)
    ids = W.local_batch(w, 0, 0, 1).to(device)
    autocast = torch.autocast(torch.device(device).type, dtype=torch.bfloat16,
                              enabled=w.dtype == "bfloat16")

    def step(m):
        def run():
            with autocast:
                loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            model.zero_grad(set_to_none=True)
        return run

    with autocast:
        eager_calls = _sdpa_calls_eager(model, ids)
        compiled_calls = _sdpa_calls_compiled(model, ids)
    model.zero_grad(set_to_none=True)
    eager_ops = _attention_ops(step(model), cuda)
    torch.compiler.reset()   # not the capture's graphs: Dynamo compiles afresh for `backend`
    compiled_ops = _attention_ops(step(torch.compile(model, backend=backend)), cuda)
    return {"workload": workload, "device": device, "backend": backend,
            "torch": torch.__version__, "transformers": _version("transformers"),
            "gpu": torch.cuda.get_device_name() if cuda else None,
            "machine": platform.node(), "command": " ".join(sys.argv),
            "eager": {"sdpa_calls": eager_calls, "ops": eager_ops},
            "compiled": {"sdpa_calls": compiled_calls, "ops": compiled_ops}}


def _version(pkg: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(pkg)
    except PackageNotFoundError:
        return None


def _summary(calls: list[dict]) -> str:
    if not calls:
        return "no SDPA call"
    kinds = sorted({(c["attn_mask"], c["is_causal"]) for c in calls})
    return "; ".join(f"{sum(1 for c in calls if (c['attn_mask'], c['is_causal']) == k)} x "
                     f"mask={k[0]} is_causal={k[1]}" for k in kinds)


def main(argv=None) -> dict:
    import torch

    args = parser().parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    rec = measure(args.workload, device, args.backend)
    print(f"torch {rec['torch']}, transformers {rec['transformers']}, {device}, "
          f"{args.workload}")
    for way in ("eager", "compiled"):
        print(f"  {way:9s} SDPA: {_summary(rec[way]['sdpa_calls'])}")
        for op, d in sorted(rec[way]["ops"].items()):
            print(f"  {'':9s} {op}: {d['count']} calls, {d['device_ms'] or d['cpu_ms']:.2f} ms")
    write_json(rec, "attention_path", args.out, f"{'gpu' if device == 'cuda' else 'cpu'}-attention")
    return rec


if __name__ == "__main__":
    main()
