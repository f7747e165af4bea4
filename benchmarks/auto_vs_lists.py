"""`passes="auto"` against the hand-picked pass lists, from saved bench results (issue 14, item 1).

    python benchmarks/auto_vs_lists.py benchmarks/results/<dir>/bench*.json [--auto SUFFIX]

Per workload: every system of ours in the files, its step time (median of its launches'
medians), and the auto system's ratio to the fastest other list of ours, with a bootstrap
interval: launches are resampled with replacement within each system (10,000 draws, a fixed
seed), and the 5th and 95th percentiles of the ratio of medians are printed. A ratio whose
interval lies within 1.03 shows "auto within 3% of the best list" at that confidence; one
whose interval straddles it does not decide, on this machine's noise. Prints markdown.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

DRAWS = 10_000


def _launch_medians(result: dict) -> list[float]:
    return [L["step_s_median"] for L in result.get("launches", [])
            if L.get("ok") and L.get("step_s_median") is not None]


def _ratio_interval(auto: list[float], best: list[float], rng: random.Random
                    ) -> tuple[float, float]:
    draws = sorted(statistics.median(rng.choices(auto, k=len(auto)))
                   / statistics.median(rng.choices(best, k=len(best))) for _ in range(DRAWS))
    return draws[int(0.05 * DRAWS)], draws[int(0.95 * DRAWS) - 1]


def compare(paths: list[Path], auto_suffix: str = "-auto") -> list[dict]:
    by_workload: dict[str, dict[str, list[float]]] = {}
    for p in paths:
        for r in json.loads(Path(p).read_text())["results"]:
            if r.get("kind") != "ours" or r.get("status") != "ok":
                continue
            meds = _launch_medians(r)
            if meds:   # a later file's (workload, system) supersedes an earlier one's
                by_workload.setdefault(r["workload"], {})[r["system"]] = meds
    rng = random.Random(0)
    rows = []
    for workload, systems in by_workload.items():
        autos = [s for s in systems if s.endswith(auto_suffix)]
        for auto in autos:
            others = {s: m for s, m in systems.items() if not s.endswith(auto_suffix)}
            if not others:
                continue
            best = min(others, key=lambda s: statistics.median(others[s]))
            a, b = statistics.median(systems[auto]), statistics.median(others[best])
            lo, hi = _ratio_interval(systems[auto], others[best], rng)
            rows.append({"workload": workload, "auto": auto, "auto_ms": a * 1e3,
                         "best": best, "best_ms": b * 1e3, "ratio": a / b,
                         "interval": [lo, hi], "launches": [len(systems[auto]), len(others[best])],
                         "systems_ms": {s: statistics.median(m) * 1e3 for s, m in systems.items()},
                         "verdict": ("within 3%" if hi <= 1.03 else
                                     "more than 3% slower" if lo > 1.03 else "undecided")})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--auto", default="-auto", help="suffix of the auto systems' names")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = compare(args.files, args.auto)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print("| workload | auto | ms | best other list | ms | auto / best | 90% interval | "
          "launches | verdict |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        lo, hi = r["interval"]
        print(f"| {r['workload']} | {r['auto']} | {r['auto_ms']:.1f} | {r['best']} | "
              f"{r['best_ms']:.1f} | {r['ratio']:.3f} | [{lo:.3f}, {hi:.3f}] | "
              f"{r['launches'][0]}, {r['launches'][1]} | {r['verdict']} |")


if __name__ == "__main__":
    main()
