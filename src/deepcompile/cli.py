"""The `deepcompile` command line.

    deepcompile demo [--nproc N] [--steps N] [--compiler fx|inductor] [--grad-accum N] [--seed S]
                     [--passes P1,P2]

Each subcommand is a function `_cmd_<name>(args) -> int` plus an `_add_<name>(subparsers)` that
declares its options; add both and list the adder in `_SUBCOMMANDS`. Nothing heavy (torch,
transformers) is imported until a subcommand runs, so `--help` is instant and spawns nothing.
"""

from __future__ import annotations

import argparse
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
    p.add_argument("--passes", default="prefetch,bucket_reduce", metavar="P1,P2",
                   help="optimization passes, comma-separated, in order; '' for insertion only "
                        "(default: %(default)s)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="'auto' (default) uses CUDA GPUs with NCCL when available, else CPU with "
                        "gloo")
    p.set_defaults(func=_cmd_demo)


def _cmd_demo(args: argparse.Namespace) -> int:
    from . import _demo

    _demo.require_transformers()
    import torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "cpu"
    nproc = args.nproc
    if nproc is None:
        nproc = torch.cuda.device_count() if device == "cuda" else 2
    compiler = args.compiler or ("inductor" if device == "cuda" else "fx")
    passes = tuple(p.strip() for p in args.passes.split(",") if p.strip())
    from .passes import known_passes

    unknown = [p for p in passes if p not in known_passes()]
    if unknown:
        raise SystemExit(f"deepcompile demo: unknown pass(es) {', '.join(unknown)}; "
                         f"known: {', '.join(known_passes())}")
    return _demo.run(_demo.DemoArgs(nproc=nproc, steps=args.steps, compiler=compiler,
                                    grad_accum=args.grad_accum, seed=args.seed, device=device,
                                    passes=passes))


# ---- parser ------------------------------------------------------------------------------------

_SUBCOMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (_add_demo,)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deepcompile",
        description="deepcompile: compiler-driven ZeRO-3 data-parallel training on torch.compile.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in _SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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
