"""The data-parallel layout of one engine: the ranks a parameter is sharded over, and the groups
its collectives run in.

[Note: layouts] W ranks in W/G groups of G (a group: the ranks of one node, by default):

* "shard": every parameter is sharded over every rank; gathers and reduce-scatters span all W.
* "hsdp": sharded within each group and replicated across the groups. A gather runs in the
  group ("intra"); a gradient is reduce-scattered (summed) in the group, then all-reduced
  (summed) across the groups ("inter": the ranks at the same position of every group) and
  divided by W. Masters, gradients and optimizer state are 1/G of the model per rank; the
  optimizer steps the same shard on every group (redundantly), so the replicas stay equal.
* "hsdp_zero": HSDP's collectives with ZeRO-3's optimizer memory. Masters, gradients and
  optimizer state are 1/W per rank, each rank's piece in the order the reduction leaves it
  ([Note: pieces in reduction order] in runtime/comm.py); every rank also holds block l of G of
  each parameter in the compute dtype (its secondary shard, runtime/secondary.py), which every
  gather reads, forward and backward, within the group ("intra"). A gradient is reduce-scattered
  in the group, then its 1/G block reduce-scattered across the groups ("inter") and divided by
  W; after each optimizer step the updated pieces are all-gathered across the groups into the
  secondary shards. What crosses the groups is a reduce-scatter of the gradients' 1/G slice per
  micro-step (on a ring half the bytes of hsdp's all-reduce of it) and one all-gather of the
  parameters' 1/G block per optimizer step: with one micro-step an all-reduce's bytes, with
  more fewer than hsdp's. The price is the secondary shards: 1/G of the parameters in the
  compute dtype. ZeRO-3 only.
* "hpz": sharded over every rank (the primary shard: masters, gradients and optimizer state
  1/W per rank; the forward's gathers and the reduce-scatters span all W, as "shard"); each
  forward gather also keeps block l of G of the gathered parameter (l: the rank's position in
  its group), in the compute dtype, and the backward re-gathers from these secondary shards
  within the group (runtime/secondary.py). Its price: 1/G of the gathered parameters in the
  compute dtype, held on every rank.

Ranks are numbered as torchrun numbers them: group j holds ranks jG .. jG+G-1, the rows of a
DeviceMesh of shape (W/G, G) with dims ("replicate", "shard"); a user's 2-D mesh is read the
same way (dim 0 replicates, dim 1 shards). The mesh's sub-groups are made once, when the engine
is made (on gloo, each with a serial copy: runtime/comm.py); nothing creates a group later.
A layout with one group (G = W) is "shard" (hsdp would all-reduce over one rank; hpz's
secondary shard would be the primary one).

[Note: layout checks] What does not work is refused on every rank, with the same message,
before anything is sharded: G not dividing W; ranks that disagree on the layout or on
LOCAL_WORLD_SIZE; a group that neither lies within one node nor is made of whole nodes (a node:
GROUP_RANK, or rank // LOCAL_WORLD_SIZE, as torchrun numbers ranks); a mesh whose ranks are not
the process group's, or whose "shard" groups are not the rows its "replicate" groups cross.
Every rank gathers the facts of every rank (one all-gather of objects) and judges them alike.
"""

from __future__ import annotations

import collections

import dataclasses
import os
from typing import Any

import torch
import torch.distributed as dist

from .comm import Comm, Pieces

LAYOUTS = ("auto", "shard", "hsdp", "hsdp_zero", "hpz")


class LayoutError(ValueError):
    """A data-parallel layout that cannot work (the message says what would)."""


@dataclasses.dataclass
class Layout:
    name: str                      # as it runs: "shard", "hsdp" or "hpz"
    group_size: int                # G: ranks per group
    world: Comm                    # every rank
    shard: Comm                    # the ranks a parameter's shards span
    replicate: Comm | None = None  # hsdp: the ranks holding the same shard (one per group)
    secondary: Comm | None = None  # hpz: the group the backward re-gathers in; hsdp_zero: the
                                   # group every gather runs in
    # the ranks a parameter's pieces span as the registry and the runtime read them (its rank:
    # this rank's piece); None: `shard`. hsdp_zero: `Pieces` over intra and inter
    primary: Any = None
    reason: str = ""               # why this layout (the report says it)
    mesh: Any = None               # the DeviceMesh of the groups (None: one group)
    alternatives: dict[str, Any] = dataclasses.field(default_factory=dict)   # auto's figures

    @property
    def pieces(self) -> Any:
        """What the registry shards over (`Comm`, or hsdp_zero's `Pieces`)."""
        return self.primary if self.primary is not None else self.shard

    @property
    def replicated(self) -> bool:
        """Every group holds the same shards (hsdp): a sum over every rank counts one group's."""
        return self.replicate is not None and self.primary is None

    @property
    def refreshed_secondary(self) -> bool:
        """The secondary shards are gathered after each optimizer step and every gather reads
        them (hsdp_zero); else (hpz) the forward's gathers write them for the backward."""
        return self.secondary is not None and self.primary is not None

    @property
    def groups(self) -> int:
        return self.world.world // self.group_size

    @property
    def comms(self) -> list[Comm]:
        """Every comm the layout's collectives run on, once each (the cost model calibrates
        each of them)."""
        out: list[Comm] = []
        for c in (self.shard, self.world, self.replicate, self.secondary):
            if c is not None and all(c is not o for o in out):
                out.append(c)
        return out

    def reduce_avg(self, full: torch.Tensor) -> torch.Tensor:
        """The mean over every rank of `full` (flat, padded), this rank's shard slice (new
        memory): reduce-scattered in the shard group, all-reduced (hsdp) or reduce-scattered
        (hsdp_zero) across the groups."""
        out = self.shard.reduce_scatter_sum(full)
        if self.primary is not None:   # hsdp_zero: this rank's piece of the group's block
            out = self.replicate.reduce_scatter_sum(out)
        elif self.replicate is not None:
            self.replicate.all_reduce(out)
        return out.div_(self.world.world)

    def describe(self) -> dict[str, Any]:
        return {"layout": self.name, "group_size": self.group_size, "groups": self.groups,
                "shard_ranks": self.pieces.world, "reason": self.reason,
                "alternatives": self.alternatives}


def node_of(rank: int) -> int | None:
    """This rank's node as torchrun says it (GROUP_RANK, else rank // LOCAL_WORLD_SIZE), or None
    where nothing says."""
    if os.environ.get("GROUP_RANK", "").isdigit():
        return int(os.environ["GROUP_RANK"])
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return rank // int(local) if local.isdigit() and int(local) > 0 else None


def local_world_size() -> int | None:
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(local) if local.isdigit() and int(local) > 0 else None


def _facts(config, mesh) -> dict[str, Any]:
    rank = dist.get_rank()
    facts = {"rank": rank, "layout": config.layout, "group_size": config.shard_group_size,
             "local_world_size": local_world_size(), "node": node_of(rank)}
    if mesh is not None:
        facts["mesh"] = _mesh_facts(mesh)
    return facts


def _mesh_facts(mesh) -> dict[str, Any]:
    """What this rank sees of `mesh`: its shape, device type, and the global ranks of its groups
    along each dim, in group-rank order (none where this rank is not in it)."""
    groups = []
    if mesh.get_coordinate() is not None:
        groups = [dist.get_process_group_ranks(mesh.get_group(d)) for d in range(mesh.ndim)]
    return {"shape": list(mesh.mesh.shape), "device_type": mesh.device_type,
            "ranks": sorted(int(r) for r in mesh.mesh.flatten().tolist()), "groups": groups}


def _check(facts: list[dict[str, Any]], world_ranks: list[int], device: torch.device) -> int:
    """[Note: layout checks]: the group size, or LayoutError (the same on every rank)."""
    first = facts[0]
    for f in facts[1:]:
        for key in ("layout", "group_size", "local_world_size"):
            if f[key] != first[key]:
                raise LayoutError(
                    f"deepcompile.initialize: the ranks disagree on "
                    f"{'LOCAL_WORLD_SIZE' if key == 'local_world_size' else 'Config.' + key} "
                    f"(rank {first['rank']}: {first[key]!r}, rank {f['rank']}: {f[key]!r}); give "
                    "every rank the same")
    world = len(facts)
    mesh = first.get("mesh")
    if mesh is not None:
        if any(f.get("mesh", {}).get("shape") != mesh["shape"] for f in facts):
            raise LayoutError("deepcompile.initialize: the ranks passed meshes of different "
                              "shapes; pass the same DeviceMesh on every rank")
        if mesh["ranks"] != sorted(world_ranks):
            raise LayoutError(
                f"deepcompile.initialize: the DeviceMesh holds ranks {mesh['ranks']} but the "
                f"process group holds {sorted(world_ranks)}; the mesh must hold exactly the "
                "process group's ranks")
        if mesh["device_type"] != device.type:
            raise LayoutError(f"deepcompile.initialize: the DeviceMesh is on "
                              f"{mesh['device_type']!r} but the model is on {device.type!r}")
        if len(mesh["shape"]) not in (1, 2):
            raise LayoutError(f"deepcompile.initialize: a DeviceMesh of {len(mesh['shape'])} "
                              "dims; deepcompile takes 1 (shard) or 2 (replicate, shard)")
        group_size = mesh["shape"][-1]
        if len(mesh["shape"]) == 2:
            _check_mesh_groups(facts)
    else:
        group_size = first["group_size"] or _ranks_per_node(facts) or world
        if first["layout"] in ("hsdp", "hsdp_zero", "hpz") and not (first["group_size"]
                                                      or first["local_world_size"]):
            raise LayoutError(
                f"deepcompile.initialize: Config.layout={first['layout']!r} needs the group "
                "size: set Config.shard_group_size, launch with torchrun (LOCAL_WORLD_SIZE), "
                "or pass a 2-D DeviceMesh")
        if group_size < 1 or world % group_size:
            raise LayoutError(
                f"deepcompile.initialize: a group size of {group_size} does not divide the "
                f"{world} ranks; set Config.shard_group_size to a divisor of {world}")
    _check_nodes(facts, group_size, mesh)
    return group_size


def _ranks_per_node(facts: list[dict[str, Any]]) -> int | None:
    """The engine's ranks on each node, where every node holds as many (LOCAL_WORLD_SIZE counts
    every process of the node: an engine on a subgroup has only some of them there); else
    LOCAL_WORLD_SIZE; None where nothing says."""
    local = facts[0]["local_world_size"]
    if local is None:
        return None
    per_node = collections.Counter(f["node"] for f in facts)
    if None not in per_node and len(set(per_node.values())) == 1:
        return next(iter(per_node.values()))
    return local


def _check_mesh_groups(facts: list[dict[str, Any]]) -> None:
    """The shard groups are the rows the replicate groups cross: every rank's replicate group
    holds one rank of each shard group, all at the same position (the shard index)."""
    by_rank = {f["rank"]: f["mesh"]["groups"] for f in facts}
    position = {r: g[1].index(r) for r, g in by_rank.items()}
    rows = {tuple(g[1]) for g in by_rank.values()}
    for r, (rep, shard) in by_rank.items():
        owners = [next(row for row in rows if x in row) for x in rep]
        if len(set(owners)) != len(rep) or len(owners) != len(rows) \
                or len({position[x] for x in rep}) != 1:
            raise LayoutError(
                f"deepcompile.initialize: the DeviceMesh's groups do not form a grid: rank {r}'s "
                f"replicate group {rep} must hold one rank of every shard group "
                f"({sorted(map(list, rows))}) at the same position in it; build the mesh with "
                "init_device_mesh(device, (replicas, shard_size))")


def _check_nodes(facts: list[dict[str, Any]], group_size: int, mesh) -> None:
    """Every shard group lies within one node or is made of whole nodes, where the ranks say
    which node they are on."""
    nodes = {f["rank"]: f["node"] for f in facts}
    if any(n is None for n in nodes.values()) or len(set(nodes.values())) == 1:
        return
    if mesh is not None and len(mesh["shape"]) == 2:
        groups = {tuple(f["mesh"]["groups"][1]) for f in facts}
    else:
        ranks = sorted(nodes)
        groups = {tuple(ranks[i:i + group_size]) for i in range(0, len(ranks), group_size)}
    size_of: dict[int, int] = {}
    for n in nodes.values():
        size_of[n] = size_of.get(n, 0) + 1
    for g in sorted(groups):
        on = sorted({nodes[r] for r in g})
        whole = sum(size_of[n] for n in on) == len(g)
        if len(on) > 1 and not whole:
            local = facts[0]["local_world_size"]
            raise LayoutError(
                f"deepcompile.initialize: the shard group of ranks {list(g)} spreads over nodes "
                f"{on} without holding them whole"
                + (f" (LOCAL_WORLD_SIZE={local})" if local else "")
                + "; a group must lie within one node or be made of whole nodes: set "
                  "Config.shard_group_size to a divisor or a multiple of the ranks per node, "
                  "or build the mesh's shard dimension from the ranks of one node")


def build(config, world: Comm, device: torch.device, mesh=None, choose=None) -> Layout:
    """The engine's layout (collective: every rank of `world`). `choose(candidates)`, for
    Config.layout="auto" with more than one group: picks one of the layouts built over the
    groups (compiler/layouts.py) and says why."""
    if world.world == 1 or (config.layout == "shard" and mesh is None):
        return Layout("shard", world.world, world, world, reason=_why(config, "one rank"
                                                                    if world.world == 1 else None))
    ranks = dist.get_process_group_ranks(world.user_group)
    facts = world.all_gather_object(_facts(config, mesh))
    group_size = _check(facts, ranks, device)   # raises the same on every rank
    if group_size == world.world:
        return Layout("shard", group_size, world, world, mesh=mesh,
                      reason=_why(config, "one group of every rank"))
    if mesh is None:   # (a 1-D mesh is one group: "shard" above)
        mesh = _make_mesh(device, world, group_size)
    intra = world.sub(mesh.get_group(1), "intra")
    inter = world.sub(mesh.get_group(0), "inter")
    candidates = {
        "shard": Layout("shard", group_size, world, world, mesh=mesh),
        "hsdp": Layout("hsdp", group_size, world, intra, replicate=inter, mesh=mesh),
        "hpz": Layout("hpz", group_size, world, world, secondary=intra, mesh=mesh),
    }
    if config.zero_stage == 3:
        candidates["hsdp_zero"] = Layout("hsdp_zero", group_size, world, intra, replicate=inter,
                                         secondary=intra, primary=Pieces(intra, inter), mesh=mesh)
    if config.layout != "auto":
        layout = candidates[config.layout]
        layout.reason = "Config.layout"
        return layout
    name, reason, figures = choose(candidates)
    layout = candidates[name]
    layout.reason, layout.alternatives = reason, figures
    return layout


def _why(config, what: str | None) -> str:
    if config.layout == "shard":
        return "Config.layout"
    return f"{what}: {config.layout!r} is the same as 'shard'" if what else "Config.layout"


_MESHES: dict[tuple, Any] = {}   # made once per process, shape and device type


def _make_mesh(device: torch.device, world: Comm, group_size: int):
    from torch.distributed.device_mesh import init_device_mesh

    if world.user_group is not dist.group.WORLD and dist.get_world_size() != world.world:
        raise LayoutError("deepcompile.initialize: a hierarchical layout over a process group "
                          "other than the default one needs its DeviceMesh: pass mesh=")
    key = (device.type, world.world // group_size, group_size)
    pg, mesh = _MESHES.get(key, (None, None))
    if pg is not world.user_group:   # (a process group made again: its meshes are new)
        mesh = init_device_mesh(device.type, (world.world // group_size, group_size),
                                mesh_dim_names=("replicate", "shard"))
        _MESHES[key] = (world.user_group, mesh)
    return mesh
