"""Load-independent figures of the runtime data path, per steady optimizer step, on CPU ranks
(gloo): what runs on the host, what is copied, and how well the profile matches the step.

    python benchmarks/runtime_figures.py host    [--layers 2 8] [--stage 3] [--passes ...]
    python benchmarks/runtime_figures.py copies  [--layers 2] [--stage 3] [--passes ...]
    python benchmarks/runtime_figures.py profile [--layers 2 8] [--compiler fx inductor] ...

* host: deepcompile's own Python function calls in one steady optimizer step (sys.setprofile,
  calls whose code is in the deepcompile package; generated code and torch's own Python are
  not counted), and custom-op calls (`deepcompile::` events of torch.profiler), for a tiny
  Llama of each depth.
* copies: bytes written per step by data-movement aten ops (copy_, clone, _to_copy, cat,
  constant_pad_nd, split_with_sizes_copy, casts...) as a dispatch mode sees them, with the fx
  compiler (every aten op runs as such), against plain single-process
  `torch.compile(backend="aot_eager")` of the same model on one rank's batch.
* profile: the sum of the profiled node times of one step (the agreed profiles, weighted by
  how often each graph runs), plus the measured time outside the graphs where the version
  reports it (`outside_graphs_s`), against the measured steady step (median).

Uses only the public API (`deepcompile.initialize`, `engine.report()`), so the same script
measures another version of the project (`PYTHONPATH=<other checkout>/src`). Results: JSON on
stdout (and `--out FILE`).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SEQ, VOCAB, BATCH = 64, 256, 4    # per rank


def _model(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                      max_position_embeddings=SEQ, attn_implementation="eager")
    return LlamaForCausalLM(cfg)


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids}


class _CopyCounter:
    """Bytes written by data-movement ops (a dispatch mode: every aten op the graphs run on the
    CPU, at the op level, with its real output sizes)."""

    NAMES = ("copy_", "clone", "_to_copy", "cat", "constant_pad_nd", "split_with_sizes_copy",
             "convert_element_type", "index_select", "slice_scatter", "select_scatter",
             "contiguous", "_reshape_copy", "repeat", "expand_copy")

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counts: dict[str, list[int]] = {}
        names = self.NAMES

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func.namespace == "deepcompile":   # a Python op: count what its body runs
                    from torch._library.custom_ops import OPDEFS

                    with self:
                        return OPDEFS[func._schema.name]._init_fn(*args, **kwargs)
                out = func(*args, **kwargs)
                name = func._schema.name.split("::")[-1]
                if name in names:
                    written = kwargs.get("out", out)
                    tensors = written if isinstance(written, (list, tuple)) else [written]
                    nbytes = sum(t.numel() * t.element_size() for t in tensors
                                 if isinstance(t, torch.Tensor))
                    c = counts.setdefault(name, [0, 0])
                    c[0] += 1
                    c[1] += nbytes
                return out

        self.counts, self.mode = counts, Mode()

    def wrap(self, fn):
        """`fn` with the mode on inside it: a compiled graph's code, which Dynamo is done with
        (a dispatch mode around a torch.compile'd call would make Dynamo run it eagerly)."""
        def run(*args, **kwargs):
            with self.mode:
                return fn(*args, **kwargs)
        run._boxed_call = getattr(fn, "_boxed_call", False)
        return run


def python_calls(fn) -> dict[str, int]:
    """{"module.py:function": calls} of deepcompile's own Python functions while `fn()` runs
    (sys.setprofile; generated code and torch's own Python are not deepcompile's)."""
    import deepcompile

    root = os.path.dirname(deepcompile.__file__)
    counts: dict[str, int] = {}

    def prof(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(root):
            key = f"{os.path.relpath(frame.f_code.co_filename, root)}:{frame.f_code.co_name}"
            counts[key] = counts.get(key, 0) + 1

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return counts


def _worker(rank: int, world: int, port: int, what: str, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        queue.put((rank, _measure(rank, world, what, args)))
    except BaseException:   # noqa: BLE001 -- reported by the parent
        import traceback
        queue.put((rank, {"error": traceback.format_exc()}))
    finally:
        dist.destroy_process_group()


def _no_ab() -> dict:
    """The passes named are kept without timed A/B steps (the figures are the runtime's); a
    version from before `measure_steps` has none."""
    import dataclasses

    import deepcompile

    names = {f.name for f in dataclasses.fields(deepcompile.Config)}
    return {"measure_steps": 0} if "measure_steps" in names else {}


def _measure(rank: int, world: int, what: str, a) -> dict:
    import deepcompile

    engine = deepcompile.initialize(
        _model(a.layers_now), optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
        config={"zero_stage": a.stage, "compiler": a.compiler_now, "passes": tuple(a.passes),
                "gradient_accumulation_steps": a.gas, "warmup_steps": 1, **_no_ab()})
    n_params = sum(1 for _ in engine.module.parameters())
    step_no = 0

    def step():
        nonlocal step_no
        for m in range(a.gas):
            out = engine(**_batch(step_no * a.gas + m, rank))
            engine.backward(out.loss)
        engine.step()
        step_no += 1

    for _ in range(a.settle):   # warm-up, profiling, planning, first steady steps
        step()
    res = {"layers": a.layers_now, "params": n_params, "compiler": a.compiler_now,
           "phase": engine.report().phase}
    if what == "host":
        counts = python_calls(step)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
            step()
        custom = [e.name for e in p.events() if e.name.startswith("deepcompile::")]
        res.update(python_calls=sum(counts.values()), custom_op_calls=len(custom),
                   custom_ops=sorted(set(custom)))
    elif what == "copies":
        # inside every graph (the slots run the lowered graphs) and around the optimizer step
        # (the runtime's refreshes); autograd's own accumulation is outside both
        counter = _CopyCounter()
        pipe = engine._pipeline
        slots = [s for s in pipe.slots.values() if hasattr(s, "runner")]
        saved = [s.runner for s in slots]
        for s in slots:
            s.runner = counter.wrap(s.runner)
        if not slots:   # an earlier version: slots call their pipeline's run
            pipe.run = counter.wrap(pipe.run)
        step_fn = engine.step
        engine.step = counter.wrap(step_fn)
        try:
            step()
        finally:
            for s, r in zip(slots, saved):
                s.runner = r
            pipe.__dict__.pop("run", None)
            engine.step = step_fn
        res["ours"] = counter.counts
        rep = engine.report().to_dict()
        res["plan"] = {p["pass"]: p.get("after", {}).get("collectives") for p in rep["passes"]}
        res["comm_per_step"] = rep["comm"]
        dist.barrier()   # the plain run below is local: the other ranks wait here
        if rank == 0:
            from torch._dynamo.backends.common import aot_autograd
            from torch._functorch.aot_autograd import make_boxed_func

            torch.manual_seed(0)
            plain = _model(a.layers_now)
            opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
            counter = _CopyCounter()
            counting = [False]

            def graph(gm, _examples):   # aot_eager, counted while `counting`
                run = make_boxed_func(gm.forward)

                def call(args):
                    if not counting[0]:
                        return run(args)
                    with counter.mode:
                        return run(args)
                call._boxed_call = True
                return call

            compiled = torch.compile(plain, backend=aot_autograd(fw_compiler=graph,
                                                                 bw_compiler=graph))

            def plain_step(i):
                for m in range(a.gas):
                    compiled(**_batch(i * a.gas + m, 0)).loss.backward()
                opt.step()
                opt.zero_grad()

            for i in range(3):
                plain_step(i)
            counting[0] = True
            plain_step(3)
            res["plain"] = counter.counts
        dist.barrier()
    elif what == "profile":
        times = []
        for _ in range(a.timed):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        summary = engine.report().to_dict()["step_summary"]
        # node times, and the measured time outside the graphs where the version reports it
        parts = {k: summary.get(k, 0.0) for k in ("compute_s", "comm_s", "outside_graphs_s")}
        profiled = sum(parts.values())
        res.update(step_s=statistics.median(times), profiled_s=profiled, profiled_parts=parts,
                   ratio=profiled / statistics.median(times))
    return res


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("host", "copies", "profile"))
    p.add_argument("--layers", type=int, nargs="+", default=[2, 8])
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--passes", nargs="*", default=["bucket_reduce", "selective_unshard"])
    p.add_argument("--gas", type=int, default=2)
    p.add_argument("--compiler", nargs="+", default=["fx"])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--settle", type=int, default=7)
    p.add_argument("--timed", type=int, default=5)
    p.add_argument("--out")
    a = p.parse_args(argv)
    import deepcompile

    results = []
    ctx = mp.get_context("spawn")
    for compiler in a.compiler:
        for layers in a.layers:
            a.layers_now, a.compiler_now = layers, compiler
            queue = ctx.Queue()
            port = _free_port()
            procs = [ctx.Process(target=_worker, args=(r, a.nproc, port, a.what, a, queue))
                     for r in range(a.nproc)]
            for pr in procs:
                pr.start()
            got = dict(queue.get(timeout=1800) for _ in procs)
            for pr in procs:
                pr.join()
            errors = [r["error"] for r in got.values() if "error" in r]
            if errors:
                raise SystemExit(errors[0])
            results.append(got[0] if a.what != "profile" else
                           {**got[0], "ratio_per_rank": [got[r]["ratio"] for r in sorted(got)]})
    doc = {"what": a.what, "deepcompile": os.path.dirname(deepcompile.__file__),
           "torch": torch.__version__, "stage": a.stage, "passes": a.passes, "gas": a.gas,
           "nproc": a.nproc, "command": " ".join(sys.argv), "results": results}
    text = json.dumps(doc, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
