"""Where the benchmark scripts write their JSON: `--out`, or a dated folder under
benchmarks/results/; a run never overwrites an earlier one (NAME.json, then NAME-1.json, ...)."""

from __future__ import annotations

import datetime
import json
from pathlib import Path


def write_json(record: dict, name: str, out: str | None, folder: str) -> Path:
    """`record` as `out`/NAME.json (or benchmarks/results/<today>-FOLDER/NAME.json; spaces in
    FOLDER become underscores), numbered after the files already there; prints the path."""
    out_dir = Path(out) if out else Path(__file__).parent / "results" / (
        f"{datetime.date.today().isoformat()}-{folder.replace(' ', '_')}")
    out_dir.mkdir(parents=True, exist_ok=True)
    path, i = out_dir / f"{name}.json", 1
    while path.exists():
        path, i = out_dir / f"{name}-{i}.json", i + 1
    path.write_text(json.dumps(record, indent=1, default=str))
    print(f"written: {path}")
    return path
