"""Ours against the peers on the same work: the same as `deepcompile bench` (all its options).

    python benchmarks/bench.py --launches 5            # the committed CPU result set
    python benchmarks/bench.py --device cuda           # GPU mode: 1 GPU, ~1B Llama, bf16
    python benchmarks/bench.py --list                  # workloads and systems

The code is in src/deepcompile/tools/bench/; results go to benchmarks/results/<date>-<machine>/.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from deepcompile.tools.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
