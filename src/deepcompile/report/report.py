from __future__ import annotations

import dataclasses
import json
from typing import Any


@dataclasses.dataclass
class Report:
    world_size: int
    config: dict[str, Any]
    parameters: int
    parameter_numel: int
    shard_numel: int
    graphs: list[dict[str, Any]]
    comm: dict[str, dict[str, int]]
    eager_fallback_gathers: int

    @classmethod
    def build(cls, engine) -> "Report":
        reg = engine._registry
        return cls(
            world_size=engine._comm.world,
            config=engine.config.to_dict(),
            parameters=len(reg),
            parameter_numel=sum(e.numel for e in reg),
            shard_numel=sum(e.shard.numel() for e in reg),
            graphs=[dataclasses.asdict(r) for r in engine._backend.records],
            comm=engine.comm_stats(),
            eager_fallback_gathers=engine._fallback.materializations,
        )

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(dataclasses.asdict(self)))

    def __str__(self) -> str:
        lines = [
            f"deepcompile: ZeRO-{self.config['zero_stage']} over {self.world_size} ranks, "
            f"compiler={self.config['compiler']}, passes={self.config['passes'] or 'insertion only'}",
            f"parameters: {self.parameters} tensors, {self.parameter_numel:,} elements; "
            f"this rank's shards: {self.shard_numel:,} elements",
            f"{'graph':>5} {'params':>6} {'fw gathers':>10} {'bw gathers':>10} "
            f"{'bw reduce-scatters':>18} {'fw nodes':>8} {'bw nodes':>8}",
        ]
        for g in self.graphs:
            lines.append(f"{g['index']:>5} {len(g['params']):>6} {g['fw_gathers']:>10} "
                         f"{g['bw_gathers']:>10} {g['bw_reduces']:>18} {g['fw_nodes']:>8} "
                         f"{g['bw_nodes']:>8}" + ("  (inference)" if g["inference"] else ""))
        if self.eager_fallback_gathers:
            lines.append(f"eager fallback: {self.eager_fallback_gathers} parameter gathers outside "
                         "compiled graphs")
        lines.append("collectives since initialize: " + (", ".join(
            f"{k} {v['count']} ({v['bytes'] / 2**20:.2f} MiB)" for k, v in self.comm.items()) or "none"))
        return "\n".join(lines)
