"""The `deepcompile` command line.

    deepcompile demo [--nproc N] [--steps N] [--compiler fx|inductor] [--grad-accum N] [--seed S]
                     [--passes P1,P2]
    deepcompile verify FILE [--steps N] [--ranks N] [--device auto|cpu|cuda] [--rtol X] [--seed S]
                       [--zero-stage 1|2|3] [--compiler fx|inductor] [--grad-accum N]
    deepcompile report FILE [--plot DIR] [--json]
    deepcompile bench --replot JSON [JSON ...] [--out PNG]
    deepcompile consolidate CKPT OUT [--dtype float32|bfloat16|float16] [--max-shard-size SIZE]
    deepcompile bench [--workloads W ...] [--systems S ...] [--launches N] [--steps N]
                      [--warmup N] [--nproc N] [--device cpu|cuda] [--compiler inductor|fx]
                      [--out DIR] [--timeout S] [--list]
    deepcompile plan --model M [--nodes N] [--gpus-per-node G] [--gpu h100|h200|...|cpu]
                     [--seq S] [--batch B] [--gas K ...] [--stage 1|2|3] [--passes P1,P2 ...]
                     [--memory-budget X] [--activation-checkpointing] [--assume K=V ...]
                     [--host-profile FILE] [--json] [--out DIR]

Each subcommand is a function `_cmd_<name>(args) -> int` plus an `_add_<name>(subparsers)` that
declares its options; add both and list the adder in `_SUBCOMMANDS`. Nothing heavy (torch,
transformers) is imported until a subcommand runs, so `--help` is instant and spawns nothing.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Callable, Sequence


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("deepcompile")
    except Exception:
        return "unknown"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


# ---- demo --------------------------------------------------------------------------------------

def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="train a tiny Llama on local ranks and check it against plain PyTorch",
        description=(
            "Spawn N local ranks (NCCL on CUDA GPUs, gloo on CPU), train a tiny Hugging Face "
            "Llama (random weights, nothing downloaded) with deepcompile.initialize on a built-in "
            "text, print what the compiler did and the communication counters, then train the same "
            "model with eager PyTorch in one process on the same global batch and compare. "
            "Exit status 0 when the losses agree (max |Δloss| < 1e-4), 1 otherwise. "
            "Needs transformers: pip install -c constraints.txt -e '.[demo]'"),
    )
    p.add_argument("--nproc", type=_positive_int, default=None,
                   help="number of ranks (default: the number of CUDA GPUs if CUDA is available, "
                        "else 2 CPU ranks on gloo)")
    p.add_argument("--steps", type=_positive_int, default=30,
                   help="optimizer steps (default: %(default)s)")
    p.add_argument("--compiler", choices=("fx", "inductor"), default=None,
                   help="'inductor' generates code (default on GPU; also available on CPU, "
                        "slower to compile); 'fx' runs the partitioned FX graphs as Python "
                        "(default on CPU, quick to start)")
    p.add_argument("--grad-accum", type=_positive_int, default=1, metavar="N",
                   help="micro-steps per optimizer step (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the model's random weights (default: %(default)s)")
    p.add_argument("--passes", default="auto", metavar="P1,P2",
                   help="'auto' (chosen from the profile, as Config's default) or optimization "
                        "passes, comma-separated, in order; '' for insertion only "
                        "(default: %(default)s)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="'auto' (default) uses CUDA GPUs with NCCL when available, else CPU with "
                        "gloo")
    p.set_defaults(func=_cmd_demo)


def _cmd_demo(args: argparse.Namespace) -> int:
    from . import demo as _demo

    _demo.require_transformers()
    import torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "cpu"
    nproc = args.nproc
    if nproc is None:
        nproc = torch.cuda.device_count() if device == "cuda" else 2
    compiler = args.compiler or ("inductor" if device == "cuda" else "fx")
    passes = "auto" if args.passes.strip() == "auto" else \
        tuple(p.strip() for p in args.passes.split(",") if p.strip())
    from ..passes import known_passes

    unknown = [p for p in passes if p not in known_passes()] if passes != "auto" else []
    if unknown:
        raise SystemExit(f"deepcompile demo: unknown pass(es) {', '.join(unknown)}; "
                         f"known: {', '.join(known_passes())}")
    return _demo.run(_demo.DemoArgs(nproc=nproc, steps=args.steps, compiler=compiler,
                                    grad_accum=args.grad_accum, seed=args.seed, device=device,
                                    passes=passes))


# ---- verify ------------------------------------------------------------------------------------

def _add_verify(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify",
        help="check your own model: train it with deepcompile and with plain PyTorch, compare",
        description=(
            "Train the model FILE defines with deepcompile on N local ranks (gloo on the CPU, or "
            "one GPU per rank when CUDA has enough), then with plain eager PyTorch in one "
            "process on the same global batches, and compare after every optimizer step. Per "
            "step: the loss difference, the largest parameter difference and its parameter, "
            "parameters without a gradient, graph breaks, modules that ran eagerly, collectives "
            "per micro-step. Exit status 1 on a difference beyond the tolerance (relative to the "
            "eager loss and to each parameter's largest eager value) or an error. FILE defines "
            "build_model() (a fresh fp32 model; torch is seeded before the call) and "
            "make_batch(step) (the global batch of micro-step `step`: a tensor or a dict, list "
            "or tuple of them, cut along dim 0 into one slice per rank); optionally "
            "loss_fn(output, batch) (default: the output if it is a scalar, else output.loss), "
            "optimizer(params) (default: AdamW, lr 1e-3) and CONFIG (a deepcompile.Config or "
            "dict; default: ZeRO-3, fx on the CPU, one warm-up step). Runs in fp32. Guide: "
            "docs/guide/verify.md"),
    )
    p.add_argument("file", metavar="FILE", help="a Python file defining build_model and make_batch")
    p.add_argument("--steps", type=_positive_int, default=4,
                   help="optimizer steps (default: %(default)s)")
    p.add_argument("--ranks", type=_positive_int, default=2,
                   help="local processes (default: %(default)s)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="'auto' (default): one CUDA GPU per rank if there are enough, else CPU "
                        "ranks over gloo")
    p.add_argument("--rtol", type=float, default=None, metavar="X",
                   help="tolerance, relative (default: 1e-5)")
    p.add_argument("--seed", type=int, default=0, help="seed of build_model and make_batch")
    p.add_argument("--zero-stage", type=int, choices=(1, 2, 3), default=None,
                   help="override CONFIG's zero_stage")
    p.add_argument("--compiler", choices=("fx", "inductor"), default=None,
                   help="override CONFIG's compiler")
    p.add_argument("--grad-accum", type=_positive_int, default=None, metavar="N",
                   help="override CONFIG's gradient_accumulation_steps")
    p.set_defaults(func=_cmd_verify)


def _cmd_verify(args: argparse.Namespace) -> int:
    from .verify import RTOL, verify_file

    overrides = {k: v for k, v in (("zero_stage", args.zero_stage),
                                   ("compiler", args.compiler),
                                   ("gradient_accumulation_steps", args.grad_accum))
                 if v is not None}
    try:
        res = verify_file(args.file, steps=args.steps, ranks=args.ranks, device=args.device,
                          rtol=RTOL if args.rtol is None else args.rtol, seed=args.seed,
                          overrides=overrides)
    except ValueError as e:   # VerifyError, or an invalid Config
        print(f"deepcompile verify: {e}", file=sys.stderr)
        return 2
    print(res, flush=True)
    return 0 if res.ok else 1


# ---- bench -------------------------------------------------------------------------------------

def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmark ours against FSDP2, DDP, DeepSpeed and torch.compile on the same work",
        description=(
            "Train the same model (same seed, data, AdamW, batch, accumulation, dtype) with each "
            "system in fresh local processes, several launches per system interleaved, and write "
            "a JSON, a markdown table and a PNG chart (step time; collectives per step; peak "
            "memory per rank; first-step and one-time cost; loss difference against plain eager "
            "PyTorch in one process). A system that cannot run here is listed with the reason. "
            "Needs transformers; DeepSpeed and matplotlib are optional: "
            "DS_BUILD_OPS=0 pip install -c constraints.txt -e '.[bench]'"),
    )
    p.add_argument("--workloads", nargs="+", metavar="W", default=None,
                   help="workloads (default: those of the committed CPU or CUDA set; --list "
                        "shows them)")
    p.add_argument("--systems", nargs="+", metavar="S", default=None,
                   help="systems, run on every workload (default: the committed set's systems "
                        "for each workload; --list shows them)")
    p.add_argument("--launches", type=_positive_int, default=5,
                   help="launches per system, interleaved (default: %(default)s)")
    p.add_argument("--steps", type=_positive_int, default=5,
                   help="timed optimizer steps per launch (default: %(default)s)")
    p.add_argument("--warmup", type=_positive_int, default=2,
                   help="warm-up steps, not timed; ours also waits for its passes and final "
                        "compile (default: %(default)s)")
    p.add_argument("--nproc", type=_positive_int, default=None,
                   help="ranks (default: 2 on the CPU over gloo, 1 GPU with --device cuda)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="'cpu' (gloo ranks, fp32) or 'cuda' (NCCL, bf16, ~1B-parameter Llama) "
                        "(default: %(default)s)")
    p.add_argument("--compiler", choices=("inductor", "fx"), default="inductor",
                   help="ours' compiler (default: %(default)s, like the peers' torch.compile)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="directory for the results (default: "
                        "benchmarks/results/<date>-<machine>/); nothing is overwritten")
    p.add_argument("--timeout", type=_positive_int, default=1200, metavar="S",
                   help="seconds one launch may take before it is stopped and reported as "
                        "failed (default: %(default)s)")
    p.add_argument("--list", action="store_true", help="list workloads and systems, and exit")
    p.add_argument("--replot", nargs="+", metavar="JSON", default=None,
                   help="redraw the chart of saved results (bench.json) and exit; with several "
                        "files a later run's (workload, system) supersedes an earlier one's "
                        "(drawn hatched); written next to the last file as <stem>.png, or to "
                        "--out")
    p.set_defaults(func=_cmd_bench)


def _cmd_bench(args: argparse.Namespace) -> int:
    from . import workloads
    from .bench import output, systems

    if args.replot:
        import json
        from pathlib import Path

        results = [json.loads(Path(f).read_text()) for f in args.replot]
        last = Path(args.replot[-1])
        png = Path(args.out) if args.out else last.with_suffix(".png")
        reason = output.chart(output.supersede(results) if len(results) > 1 else results[0], png)
        if reason is not None:
            print(f"deepcompile bench --replot: {reason}", file=sys.stderr)
            return 1
        print(f"[bench] wrote {png}")
        return 0
    if args.list:
        print("workloads:")
        for name, w in workloads.WORKLOADS.items():
            print(f"  {name:<20} {w.model}, {w.batch} x {w.seq} tokens per rank, gas {w.gas}, "
                  f"{w.dtype}")
        print("systems:")
        for name, s in systems.SYSTEMS.items():
            print(f"  {name:<26} {s.description}")
        for device in ("cpu", "cuda"):
            print(f"committed {device} set (the default):")
            for w, names in systems.matrix(device, None, None).items():
                print(f"  {w:<20} {' '.join(names)}")
        return 0
    from .demo import require_transformers

    require_transformers("bench")
    cuda = args.device == "cuda"
    for kind, given, known in (("workloads", args.workloads, workloads.WORKLOADS),
                               ("systems", args.systems, systems.SYSTEMS)):
        unknown = [n for n in given or () if n not in known]
        if unknown:
            raise SystemExit(f"deepcompile bench: unknown {kind} {', '.join(unknown)}; "
                             f"known: {', '.join(known)}")
    if cuda:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("deepcompile bench: --device cuda but CUDA is not available")
    from pathlib import Path

    from .bench import BenchArgs, run

    bench_args = BenchArgs(
        matrix=systems.matrix(args.device, args.workloads, args.systems),
        launches=args.launches, steps=args.steps, warmup=args.warmup,
        nproc=args.nproc or (1 if cuda else 2), device=args.device, compiler=args.compiler,
        out=args.out, timeout_s=float(args.timeout),
        command=shlex.join(["deepcompile", *args.argv]))
    result = run(bench_args)
    directory = Path(args.out) if args.out else output.default_dir(result)
    paths = output.write(result, directory)
    print(output.markdown(result))
    for path in paths.values():
        print(f"[bench] wrote {path}")
    return 0


# ---- plan --------------------------------------------------------------------------------------

def _memory(text: str) -> float:
    """Bytes ("80e9", "72GiB", "70GB") or a fraction of GPU memory ("0.85")."""
    t = text.strip()
    for suffix, mult in (("GiB", 2**30), ("GB", 1e9), ("MiB", 2**20), ("MB", 1e6)):
        if t.endswith(suffix):
            t, scale = t[: -len(suffix)], mult
            break
    else:
        scale = 1.0
    try:
        value = float(t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected bytes (80e9, 72GiB) or a fraction (0.85), "
                                         f"got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive budget, got {text!r}")
    return value


def _assumption(text: str) -> tuple[str, float]:
    key, sep, value = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return key.strip(), float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected KEY=NUMBER (e.g. net.nic_bw=25e9), got "
                                         f"{text!r}") from None


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="predict step time, throughput and memory of a model on a cluster we don't have",
        description=(
            "Profile one decoder layer, the embedding and the head of the model's shape "
            "(traced on fake tensors and timed by a roofline of the target GPU; with --gpu cpu, "
            "built for real and timed by a measured host profile), compose the full model's "
            "graphs, plan deepcompile's passes with their own planners at the given scale, "
            "and simulate one optimizer step of each system (ours with each pass set; FSDP2; "
            "DeepSpeed ZeRO-3 eager) on a compute lane and communication lanes, with memory. "
            "Prints a table; --json prints JSON; --out writes the table, the JSON and a "
            "picture (needs matplotlib). Needs transformers."),
    )
    p.add_argument("--model", required=True,
                   help="a built-in shape (llama-3-8b, llama-3-70b, llama-3.1-405b, mixtral-8x7b, "
                        "mixtral-8x22b, and the bench's models: tiny-llama, small-llama, "
                        "tiny-mixtral, llama-1b) or a Hugging Face config.json")
    p.add_argument("--nodes", type=_positive_int, default=1, help="nodes (default: %(default)s)")
    p.add_argument("--gpus-per-node", type=_positive_int, default=8,
                   help="GPUs per node, or gloo ranks with --gpu cpu (default: %(default)s)")
    p.add_argument("--gpu", default="h100",
                   help="h100, h200, a100, a100-40gb, b200, or cpu (gloo ranks of a machine "
                        "measured in --host-profile) (default: %(default)s)")
    p.add_argument("--seq", type=_positive_int, default=1024, help="tokens per sequence")
    p.add_argument("--batch", type=_positive_int, default=1, help="sequences per GPU per "
                   "micro-step")
    p.add_argument("--gas", type=_positive_int, nargs="+", default=[1], metavar="K",
                   help="micro-steps per optimizer step; several values plan each "
                        "(default: %(default)s)")
    p.add_argument("--stage", type=int, choices=(1, 2, 3), default=3, help="ZeRO stage")
    p.add_argument("--passes", action="append", default=None, metavar="P1,P2",
                   help="a pass set of ours, comma-separated ('' for insertion only, 'auto' for "
                        "the runtime's own choice); repeat for several (default: the ladder '', "
                        "prefetch, prefetch,bucket_reduce, +selective_unshard, "
                        "+offload_optimizer, auto)")
    p.add_argument("--layouts", default=None, metavar="L1,L2",
                   help="data-parallel layouts side by side: shard (the ladder of pass sets), "
                        "hsdp, hsdp_zero, hpz (passes='auto', or the --passes given), auto "
                        "(which one Config.layout='auto' picks) (default: all of them past one "
                        "node, shard on one)")
    p.add_argument("--peers", default="fsdp2,fsdp2-compile,ds-z3", metavar="S1,S2",
                   help="peer schedules to compare ('' for none) (default: %(default)s)")
    p.add_argument("--memory-budget", type=_memory, default=None, metavar="X",
                   help="the passes' budget per GPU: bytes (72GiB) or a fraction of GPU memory "
                        "(default: 0.9, as the runtime)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="checkpoint every decoder layer (the paper's runs did)")
    p.add_argument("--assume", type=_assumption, action="append", default=[], metavar="K=V",
                   help="override an assumed figure, e.g. net.nic_bw=25e9, gpu.mm_eff=0.6, "
                        "net.launch_host_s=15e-6, peer.ds_hook_s=5e-4 (repeatable)")
    p.add_argument("--host-profile", default=None, metavar="FILE",
                   help="with --gpu cpu: the host profile to plan with (JSON written by "
                        "benchmarks/validation/host_profile.py in a source checkout)")
    p.add_argument("--json", action="store_true", help="print the plan(s) as JSON only")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="write plan.md, plan.json and plan.png (per GAS) into DIR")
    p.set_defaults(func=_cmd_plan)


def _cmd_plan(args: argparse.Namespace) -> int:
    from .demo import require_transformers

    require_transformers("plan")
    import json
    from pathlib import Path

    from .plan import plan as P
    from .plan import report

    passes = None if args.passes is None else [
        tuple(x.strip() for x in s.split(",") if x.strip()) for s in args.passes]
    log = (lambda *a, **k: print(*a, file=sys.stderr, **k)) if args.json else print
    plans = []
    try:
        for gas in args.gas:
            pa = P.PlanArgs(model=args.model, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                            gpu=args.gpu, seq=args.seq, batch=args.batch, gas=gas,
                            stage=args.stage, passes=passes,
                            peers=tuple(x.strip() for x in args.peers.split(",") if x.strip()),
                            memory_budget=args.memory_budget, ac=args.activation_checkpointing,
                            assume=dict(args.assume), host_profile=args.host_profile,
                            layouts=None if args.layouts is None else tuple(
                                x.strip() for x in args.layouts.split(",") if x.strip()))
            plans.append(P.make_plan(pa))
    except P.PlanError as e:
        print(str(e), file=sys.stderr)
        return 2
    command = shlex.join(["deepcompile", *args.argv])
    if args.json:
        out = [dict(p.to_dict(), command=command) for p in plans]
        print(json.dumps(out[0] if len(out) == 1 else out, indent=1, default=report._default))
    else:
        for p in plans:
            print(report.table(p))
            print()
    if args.out:
        directory = Path(args.out)
        directory.mkdir(parents=True, exist_ok=True)
        for p in plans:
            stem = f"plan-gas{p.args.gas}" if len(plans) > 1 else "plan"
            (directory / f"{stem}.md").write_text(
                f"command: `{command}`\n\n{report.table(p)}\n")
            report.write_json(p, directory / f"{stem}.json")
            png = report.picture(p, directory / f"{stem}.png")
            log(f"[plan] wrote {directory / stem}.md, .json" + (", .png" if png else
                                                                 " (no picture: matplotlib is "
                                                                 "not installed)"))
    return 0


# ---- report -------------------------------------------------------------------------------------

def _add_report(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report",
        help="print a saved report (engine.save_report) and draw its pictures",
        description=(
            "Read a report saved by engine.save_report(path) (or engine.plot(dir)'s "
            "report.json), print its tables (the passes chosen and why, each pass kept or "
            "reverted, every collective of a step where it runs, asynchronous time explained), "
            "and with --plot DIR draw its pictures (memory over the step per rank with the "
            "budget, the traced step's compute/communication timeline, each pass before and "
            "after, step time through warm-up, profiling and the final compile). Drawing "
            "needs matplotlib: pip install -c constraints.txt -e '.[plot]'"),
    )
    p.add_argument("file", metavar="FILE", help="the report JSON")
    p.add_argument("--plot", metavar="DIR", default=None, help="write the PNGs into DIR")
    p.add_argument("--json", action="store_true", help="print the JSON instead of the tables")
    p.set_defaults(func=_cmd_report)


def _cmd_report(args: argparse.Namespace) -> int:
    import json

    from ..report import Report

    with open(args.file) as f:
        data = json.load(f)
    report = Report.from_dict(data)
    print(json.dumps(report.to_dict(), indent=1) if args.json else str(report))
    if args.plot:
        from ..report.figures import MissingPlotting, plot_report

        try:
            paths = plot_report(report, args.plot)
        except MissingPlotting as e:
            print(str(e), file=sys.stderr)
            return 1
        for path in paths:
            print(f"[report] wrote {path}")
    return 0


# ---- consolidate -------------------------------------------------------------------------------

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "KIB": 2 ** 10,
               "MIB": 2 ** 20, "GIB": 2 ** 30}


def _size(text: str) -> int:
    import re

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", text.upper())
    if not m or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"expected a size such as 5GB or 500MB, got {text!r}")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2) or ""])


def _add_consolidate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "consolidate",
        help="write a checkpoint's full model as a Hugging Face model directory (safetensors)",
        description=(
            "Read a checkpoint written by engine.save_checkpoint (any number of ranks, any ZeRO "
            "stage) in this one process and write its full model to OUT as a Hugging Face model "
            "directory: model.safetensors (or shards with an index) and, when the model was a "
            "transformers PreTrainedModel, config.json and generation_config.json, loadable with "
            "from_pretrained(OUT). Optimizer state is not written. Needs safetensors: "
            "pip install -c constraints.txt -e '.[hf]'"),
    )
    p.add_argument("checkpoint", metavar="CKPT", help="the checkpoint directory")
    p.add_argument("out", metavar="OUT", help="the model directory to write (created)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="cast floating-point weights (default: as saved, the fp32 masters)")
    p.add_argument("--max-shard-size", type=_size, default="5GB", metavar="SIZE",
                   help="largest safetensors file (default: %(default)s)")
    p.set_defaults(func=_cmd_consolidate)


def _cmd_consolidate(args: argparse.Namespace) -> int:
    import torch

    from ..checkpoint import CheckpointError
    from ..export import consolidate

    try:
        files = consolidate(args.checkpoint, args.out,
                            dtype=getattr(torch, args.dtype) if args.dtype else None,
                            max_shard_bytes=args.max_shard_size)
    except (CheckpointError, ImportError) as e:
        print(f"deepcompile consolidate: {e}", file=sys.stderr)
        return 1
    for f in files:
        print(f"[consolidate] wrote {f}")
    return 0


# ---- parser ------------------------------------------------------------------------------------

_DESCRIPTION = """\
deepcompile: data-parallel training of an unmodified PyTorch model by compiling it
(a torch.compile backend rewrites the training graph for ZeRO sharding).

ZeRO stages (deepcompile.Config(zero_stage=...)):
  1  optimizer state sharded over the ranks; parameters and gradients replicated,
     gradients reduce-scattered once per optimizer step (after the last micro-step)
  2  optimizer state and gradients sharded (gradients reduce-scattered every micro-step);
     parameters replicated
  3  parameters, gradients and optimizer state sharded (default): each parameter is
     all-gathered inside the compiled graph just before use and freed after
"""

_EPILOG = """\
In a training script:
  engine = deepcompile.initialize(model, optimizer=..., config=deepcompile.Config(zero_stage=3))
  loss = engine(**batch).loss; engine.backward(loss); engine.step()
launched with e.g. `torchrun --nproc-per-node 8 train.py` (README: "Launching").
"""

_SUBCOMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    _add_demo, _add_verify, _add_bench, _add_report, _add_consolidate, _add_plan)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deepcompile",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in _SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the command, for the records
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
