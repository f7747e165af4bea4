"""Data-parallel layouts past one node ([Note: layouts] in runtime/mesh.py): "shard", "hsdp"
(sharded within groups of G ranks, replicated across them), "hsdp_zero" (hsdp's gathers within
the group, the state sharded over every rank) and "hpz" (sharded over every rank, secondary
shards for the backward's re-gathers within the group).

On 4 gloo ranks laid out as nodes by LOCAL_WORLD_SIZE (2 x 2, 4 x 1, 1 x 4), in one launch:

* parity with single-process eager training (tests/_train.py), at ZeRO-3 with every pass
  (prefetch, bucket_reduce, selective_unshard, offload_optimizer), ZeRO-1 and ZeRO-2 (hsdp),
  activation checkpointing and the eager fallback, gradient accumulation and clipping, fx;
  one Inductor case (marked `inductor`);
* the collectives per group per optimizer step (comm_stats(by_group=True)) against the
  formula: what crosses the group boundary is every collective under "shard", the all-reduce of
  each rank's 1/G slice of the gradients under "hsdp", its reduce-scatter and the refresh's
  all-gather under "hsdp_zero", the forward's gathers and the reduce-scatters under "hpz";
* `layout="auto"` states its choice and every layout's figures in the report; the rule itself
  (compiler/layouts.py) on given figures;
* checkpoints saved at 2 x 2 (hsdp) load at 1 x 4, 4 x 1, under hpz, under hsdp_zero (whose
  save loads under shard, hsdp_zero at 4 x 1 and on 1 rank) and on 1 rank, and
  `save_pretrained` writes the same weights from every layout: a language model with tied
  weights and odd sizes, and (the full suite's) the tied tiny Llama;
* a layout that cannot work is refused on every rank with the same message.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

import _models
from _dist import run_distributed
from _train import FULL, Jobs, compare_to_reference, scenario

ALL = ("prefetch", "bucket_reduce", "selective_unshard")
NODES = {"2x2": {"LOCAL_WORLD_SIZE": "2"}, "4x1": {"LOCAL_WORLD_SIZE": "1"},
         "1x4": {"LOCAL_WORLD_SIZE": "4"}}
STEPS = 4


def _sc(nodes, layout, model, optim="adamw", gas=2, clip=0.1, stage=3, passes=ALL, **kw):
    """A layout scenario; 4 ranks are what a layout needs, so each is in the core matrix unless
    `extended` ([Note: the core matrix] in tests/_train.py)."""
    cid = f"{nodes}-{layout}-z{stage}-{model}-{optim}-gas{gas}" + ("-clip" if clip else "") \
        + "".join(f"-{p}" for p in kw.pop("tags", ()))
    extended = kw.pop("extended", False)
    return scenario(cid, model, optim, 0.1 if optim == "sgd" else 1e-2, gas=gas, clip=clip,
                    steps=kw.pop("steps", STEPS), env=NODES[nodes], layout=layout,
                    zero_stage=stage, passes=passes, core=not extended, extended=extended, **kw)


_COUNTS = [_sc("2x2", lay, "mlp", "sgd", clip=None, passes=(), record=("comm_groups",),
               tags=("counts",)) for lay in ("shard", "hsdp", "hsdp_zero", "hpz")]
# the tiny Llama's hsdp and hpz with every pass: the full suite's; the core runs the layouts
# with the passes on the MLP (4 x 1, 1 x 4, auto at 2 x 2) and their collectives per group
# without passes at 2 x 2 (_COUNTS)
_FX = [
    _sc("2x2", "hsdp", "llama", record=("report", "comm_groups"), extended=True),
    _sc("2x2", "hpz", "llama", record=("report", "comm_groups"), extended=True),
    _sc("2x2", "hpz", "llama_ckpt", "sgd", gas=1, extended=True),
    _sc("2x2", "hsdp_zero", "llama", record=("report", "comm_groups"), extended=True),
    _sc("2x2", "hsdp_zero", "mlp", record=("report", "comm_groups")),
    _sc("2x2", "hsdp", "mlp", stage=1, passes=("bucket_reduce",)),
    _sc("2x2", "hsdp", "llama", stage=2, passes=("bucket_reduce",), extended=True),
    _sc("2x2", "hsdp", "mlp", passes=("offload_optimizer", "prefetch"), warmup_steps=1,
        memory_budget=18000, chunk_bytes=256, record=("report",), tags=("offload",)),
    _sc("2x2", "hsdp", "disabled", "sgd", extended=True),
    _sc("2x2", "hsdp_zero", "disabled", "sgd", extended=True),
    _sc("2x2", "auto", "mlp", record=("report",)),
    _sc("4x1", "hsdp", "mlp", record=("comm_groups",)),
    _sc("4x1", "hpz", "mlp", "sgd", record=("comm_groups",)),
    _sc("4x1", "hsdp_zero", "mlp", "sgd", record=("comm_groups",)),
    # (hsdp_zero's state per rank is about half hsdp's: a lower budget makes it offload)
    _sc("2x2", "hsdp_zero", "mlp", passes=("offload_optimizer", "prefetch"), warmup_steps=1,
        memory_budget=16000, chunk_bytes=256, record=("report",), tags=("offload",),
        extended=True),
    _sc("4x1", "hsdp", "mlp", stage=2, passes=("bucket_reduce",), extended=True),
    _sc("1x4", "hsdp", "mlp", record=("report",)),
] + _COUNTS
# Inductor compiles a layout's collectives as any group's (test_parity's Inductor job): the
# full suite's only
_INDUCTOR = [_sc("2x2", lay, "llama", compiler="inductor", passes=("prefetch", "bucket_reduce"),
                 extended=True) for lay in ("hpz", "hsdp_zero")]

JOBS = Jobs({"fx4": (4, _FX), "inductor4": (4, _INDUCTOR)}, timeout=1500)


@pytest.mark.parametrize("job, sc", JOBS.params())
def test_parity_with_eager_reference(job, sc):
    results = JOBS.results(job, sc["id"])
    compare_to_reference(sc, results, kind=f"{sc['config']['layout']}/{sc['model']}")
    if "report" in sc["record"]:
        lay = results[0]["report"]["layout"]
        want = {"1x4": "shard", "2x2": sc["config"]["layout"]}[sc["id"][:3]]
        if want != "auto":
            assert lay["layout"] == want, lay
        assert lay["group_size"] == int(sc["env"]["LOCAL_WORLD_SIZE"]), lay


def _groups(job: str, sc_id: str) -> dict:
    """The last optimizer step's collectives per group (rank 0; every rank alike)."""
    per_rank = JOBS.results(job, sc_id)
    steps = [r["comm_groups_step"][-1] for r in per_rank]
    assert all(s == steps[0] for s in steps), steps
    return steps[0]


def _padded(world: int, model: str = "mlp") -> int:
    """Elements of every parameter padded to a multiple of `world` (fp32: 4 bytes each)."""
    return sum(math.ceil(p.numel() / world) * world
               for p in _models.build_model(model).parameters())


def test_bytes_across_the_group_boundary_per_step():
    """Per optimizer step (GAS k = 2, fp32, no pass), per rank, in comm_stats' bytes (each
    collective's full tensor): P_S = every parameter padded to S ranks, B = the backward's
    re-gathered bytes (the same under every layout):
      shard: every collective crosses: k (4 P_4 + 4 P_4) + B on "world";
      hsdp:  only the all-reduce of each rank's 1/G slice crosses: k 4 P_2 / 2 on "inter";
      hpz:   the forward's gathers and the reduce-scatters: k (4 P_4 + 4 P_4) on "world";
             the backward's re-gathers (B) stay on "intra";
      hsdp_zero: the reduce-scatter of each rank's 1/G slice in every micro-step and, once per
             step, the all-gather of the updated pieces into the secondary shards: (k + 1)
             4 P_4 / 2 on "inter" (the same counted bytes as hsdp's k 4 P_2 / 2 plus one refresh;
             on the wire a reduce-scatter moves half an all-reduce's); its gathers, forward
             and backward, stay on "intra"."""
    k, ids = 2, {sc["config"]["layout"]: sc["id"] for sc in _COUNTS}
    shard, hsdp, hpz, hz = (_groups("fx4", ids[n]) for n in ("shard", "hsdp", "hpz", "hsdp_zero"))
    p4, p2 = 4 * _padded(4), 4 * _padded(2)
    n = len(list(_models.build_model("mlp").parameters()))
    assert set(shard) == {"world"} and set(hsdp) == {"intra", "inter"}
    assert set(hpz) == {"world", "intra"}
    back = hpz["intra"]["all_gather"][1]
    assert back > 0
    assert shard["world"]["reduce_scatter"] == (k * n, k * p4)
    assert shard["world"]["all_gather"][1] == k * p4 + back
    assert hsdp["inter"] == {"all_reduce": (k * n, k * p2 // 2)}
    assert hsdp["intra"]["reduce_scatter"] == (k * n, k * p2)
    assert hpz["world"] == {"all_gather": (k * n, k * p4), "reduce_scatter": (k * n, k * p4)}
    assert set(hz) == {"intra", "inter"}
    assert hz["inter"] == {"reduce_scatter": (k * n, k * p4 // 2), "all_gather": (1, p4 // 2)}
    # the gathers shard's run over every rank, in the group
    assert hz["intra"] == {"all_gather": shard["world"]["all_gather"],
                           "reduce_scatter": (k * n, k * p4)}
    crossing = {name: sum(b for g, kinds in st.items() if g in ("world", "inter")
                          for _, b in kinds.values())
                for name, st in (("shard", shard), ("hsdp", hsdp), ("hpz", hpz),
                                 ("hsdp_zero", hz))}
    assert crossing == {"shard": 2 * k * p4 + back, "hsdp": k * p2 // 2, "hpz": 2 * k * p4,
                        "hsdp_zero": (k + 1) * p4 // 2}


def test_one_rank_groups_and_the_hsdp_all_reduce_in_every_step():
    """4 x 1: hsdp shards over one rank (no gather, no reduce-scatter: an all-reduce per
    parameter per micro-step across the 4 groups; clipping's norm is the rank's own, its
    shards being whole parameters); hpz keeps the whole parameter as its secondary shard (no
    backward gather at all), and so does hsdp_zero (no gather in a graph at all)."""
    model = _models.build_model("mlp")
    params, numel = len(list(model.parameters())), sum(p.numel() for p in model.parameters())
    hsdp = _groups("fx4", "4x1-hsdp-z3-mlp-adamw-gas2-clip")
    assert hsdp == {"inter": {"all_reduce": (2 * params, 2 * 4 * numel)}}
    hpz = _groups("fx4", "4x1-hpz-z3-mlp-sgd-gas2-clip")
    padded = 2 * 4 * _padded(4, "mlp")   # 2 micro-steps, fp32
    assert set(hpz) == {"world"}, hpz
    assert hpz["world"]["reduce_scatter"][1] == padded
    assert hpz["world"]["all_gather"][1] == padded   # the forward's only
    # hsdp_zero: its secondary shard is the whole parameter, refreshed across the 4 groups
    # once per step; each micro-step reduce-scatters every gradient across them
    hz = _groups("fx4", "4x1-hsdp_zero-z3-mlp-sgd-gas2-clip")
    assert hz == {"inter": {"reduce_scatter": (2 * params, padded),
                            "all_gather": (1, padded // 2)}}, hz


@pytest.mark.extended   # reads the tiny Llama's layout runs (the full suite's)
def test_hsdp_and_hpz_with_passes_count_per_group():
    """2 x 2 with prefetch, bucket_reduce, selective_unshard: hsdp's gathers and
    reduce-scatters stay in the group and only all-reduces cross; hpz's backward gathers stay
    in the group. The report names the layout and counts per group."""
    hsdp = _groups("fx4", "2x2-hsdp-z3-llama-adamw-gas2-clip")
    assert set(hsdp) == {"intra", "inter"}
    assert set(hsdp["inter"]) == {"all_reduce"}
    hpz = _groups("fx4", "2x2-hpz-z3-llama-adamw-gas2-clip")
    assert set(hpz["intra"]) <= {"all_gather"}
    # hsdp_zero: every gather in the group; across, the reductions' second step and the refresh
    hz = _groups("fx4", "2x2-hsdp_zero-z3-llama-adamw-gas2-clip")
    assert set(hz) == {"intra", "inter"} and set(hz["inter"]) == {"reduce_scatter", "all_gather"}
    assert set(hz["intra"]) == {"all_gather", "reduce_scatter"}
    report = JOBS.results("fx4", "2x2-hsdp-z3-llama-adamw-gas2-clip")[0]["report"]
    assert report["comm_by_group"]["inter"]["all_reduce"]["count"] > 0
    assert report["layout"]["reason"] == "Config.layout"


def test_auto_states_its_choice():
    lay = JOBS.results("fx4", "2x2-auto-z3-mlp-adamw-gas2-clip")[0]["report"]["layout"]
    assert lay["layout"] in ("shard", "hsdp", "hsdp_zero", "hpz")
    assert lay["reason"].startswith("auto: ")
    assert set(lay["alternatives"]) == {"shard", "hsdp", "hsdp_zero", "hpz"}
    figures = lay["alternatives"]
    best = min(f["comm_s"] for f in figures.values())
    assert figures[lay["layout"]]["comm_s"] <= best * 1.02 + 1e-12
    # the budget is unbounded on the CPU: selective_unshard (passes="auto") would keep every
    # parameter under every layout, and the report says what that leaves of each one's figure
    from deepcompile.report.report import Report

    report = JOBS.results("fx4", "2x2-auto-z3-mlp-adamw-gas2-clip")[0]["report"]
    text = str(Report.from_dict(report))
    for name, f in figures.items():
        assert f["spare_used_bytes"] > 0 and f["comm_s"] < f["comm_before_s"], (name, f)
        assert f"  {name}: predicted communication {f['comm_s'] * 1e3:.2f} ms per optimizer " \
               f"step ({f['comm_before_s'] * 1e3:.2f} ms before the passes use" in text, text
    off = JOBS.results("fx4", "2x2-hsdp-z3-mlp-adamw-gas2-clip-offload")[0]["report"]
    offload = next(p for p in off["passes"] if p["pass"] == "offload_optimizer")
    assert offload["kept"] and offload["decisions"]["offloaded_bytes"] > 0, offload
    if FULL:   # hsdp_zero's offload case
        off = JOBS.results("fx4", "2x2-hsdp_zero-z3-mlp-adamw-gas2-clip-offload")[0]["report"]
        offload = next(p for p in off["passes"] if p["pass"] == "offload_optimizer")
        assert offload["kept"] and offload["decisions"]["offloaded_bytes"] > 0, offload
    one = JOBS.results("fx4", "1x4-hsdp-z3-mlp-adamw-gas2-clip")[0]["report"]["layout"]
    assert one["layout"] == "shard" and "same as 'shard'" in one["reason"]


# ----------------------------------------------------------------------- the rule itself
def _rule(nic_s_per_byte, budget=float("inf"), stage=3, gas=1, passes=()):
    """2 nodes of 8, 8 parameters of 1 Mi elements (bf16, fp32 masters). Seconds per byte:
    within a node 1e-11; across the nodes one NIC per rank `nic_s_per_byte`; over every rank
    the slower of the two with the 8 NICs of a node side by side (the planner's ring:
    tools/plan/network.py)."""
    from deepcompile.compiler.layouts import ParamFacts, choose

    params = [ParamFacts(1 << 20, 2, 2, 4)] * 8
    per = {"intra": 1e-11, "inter": nic_s_per_byte, "world": max(1e-11, nic_s_per_byte / 8)}

    def collective_s(label, kind, nbytes):
        return 1e-5 + nbytes * per[label]
    return choose(params, 16, 8, stage, gas, budget, collective_s, passes=passes)


def test_the_auto_rule_on_given_figures():
    # a slow network: hsdp's small all-reduce beats ZeRO-3's collectives across the nodes
    name, why, figures = _rule(1e-9)
    assert name == "hsdp", figures
    assert "shard 6.53 ms" in why and "hpz 4.60 ms" in why, why
    assert figures["hsdp"]["crossing_bytes"] < figures["hpz"]["crossing_bytes"] \
        < figures["shard"]["crossing_bytes"]
    # hsdp's state (1/8 of the model) does not fit in half the budget: hpz (1/16 + 1/8 in bf16)
    state = {n: f["state_bytes"] for n, f in figures.items()}
    name, why, figures = _rule(1e-9, budget=2 * (state["hpz"] + state["hsdp"]) / 2)
    assert name == "hpz" and not figures["hsdp"]["fits"], why
    # hsdp_zero holds what hpz holds (1/16 of the state, 1/8 of the parameters in bf16) and
    # crosses the nodes with 1/8 of the bytes: with accumulation (its refresh once a step,
    # hpz's forward gathers in every micro-step across the nodes) it wins where hsdp does
    # not fit
    assert state["hsdp_zero"] == state["hpz"]
    assert figures["hsdp_zero"]["crossing_bytes"] * 8 == figures["hpz"]["crossing_bytes"]
    name, why, figures = _rule(1e-9, budget=2 * (state["hpz"] + state["hsdp"]) / 2, gas=4)
    assert name == "hsdp_zero" and not figures["hsdp"]["fits"], why
    # nothing fits: shard, the least memory
    name, why, _ = _rule(1e-9, budget=1.0)
    assert name == "shard" and "half the memory budget" in why
    # the network as fast across the nodes as within: a tie goes to the least memory
    name, _, figures = _rule(1e-11)
    assert name == "shard", figures
    # ZeRO-1/2 have no hpz, nor hsdp_zero
    _, _, figures = _rule(1e-9, stage=2)
    assert "hpz" not in figures and "hsdp_zero" not in figures


def test_the_auto_rule_weighs_the_memory_a_layout_takes_by_what_the_passes_make_of_it():
    """Half of a 24 MiB budget: shard's state (8 MiB) leaves 4 MiB, room for two parameters
    kept gathered (2 MiB each), hpz's secondary shards (2 MiB more) room for one; hsdp's state
    does not fit. Over a network 10x slower across the nodes than within, hpz's intra-node
    backward gathers save 5% of shard's communication: it wins on the collectives alone, shard
    once selective_unshard's use of the memory counts."""
    budget = 24 * 2**20
    name, _, figures = _rule(1e-10, budget=budget, gas=4)
    assert name == "hpz" and figures["hpz"]["comm_s"] < figures["shard"]["comm_s"], figures
    name, why, figures = _rule(1e-10, budget=budget, gas=4, passes=("selective_unshard",))
    assert name == "shard", figures
    assert (figures["shard"]["spare_used_bytes"], figures["hpz"]["spare_used_bytes"]) \
        == (4 * 2**20, 2 * 2**20)
    assert figures["shard"]["comm_s"] < figures["hpz"]["comm_s"] < figures["hpz"]["comm_before_s"]
    assert "selective_unshard would make of the memory left (4.0 MiB used)" in why, why
    # across a slow network the layouts that gather within the node win: hsdp_zero (every
    # gather there, hpz's memory) over hpz (its backward's)
    name, _, figures = _rule(1e-9, budget=budget, gas=4, passes=("selective_unshard",))
    assert name == "hsdp_zero" and figures["hpz"]["comm_s"] < figures["shard"]["comm_s"], figures
    # passes that make nothing of memory change nothing
    assert _rule(1e-10, budget=budget, gas=4, passes=("prefetch", "bucket_reduce"))[0] == "hpz"


# ------------------------------------------------------------------------------ checkpoints
class _TiedLM(torch.nn.Module):
    """A language model whose output layer is its embedding table (one parameter under two
    names), with layers no group size divides (each layout pads their shards differently)."""

    def __init__(self, dim: int = 11):
        super().__init__()
        torch.manual_seed(_models.SEED)
        self.embed = torch.nn.Embedding(_models.VOCAB, dim)
        self.norm = torch.nn.LayerNorm(dim)
        self.mix = torch.nn.Linear(dim, dim)
        self.head = torch.nn.Linear(dim, _models.VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, input_ids, labels):
        h = self.embed(input_ids)
        logits = self.head(h + torch.tanh(self.mix(self.norm(h))))
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                 labels[:, 1:].reshape(-1))


# the tied models checkpointed: the tied tiny Llama (its Hugging Face directory) is the full
# suite's; save_pretrained of a Hugging Face model in the default run: test_checkpoint.py's
_CKPT_MODELS = {"tied_lm": _TiedLM, "llama_tied": lambda: _models.build_model("llama_tied")}
CKPT_RUN = list(_CKPT_MODELS) if FULL else ["tied_lm"]


def _engine(model, layout, env, group_size=None):
    import deepcompile
    from _train import environment

    torch._dynamo.reset()
    with environment(env):
        return deepcompile.initialize(
            _CKPT_MODELS[model](),
            functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1),
            deepcompile.Config(compiler="fx", layout=layout, shard_group_size=group_size))


def _state_of(engine) -> dict:
    """Every parameter and Adam moment, gathered over the ranks its shards span; the steps."""
    out = {f"param/{k}": v for k, v in engine.full_state_dict().items()}
    by_shard = {id(e.shard): e for e in engine._registry}
    for p, st in engine.optimizer.state.items():
        e = by_shard[id(p)]
        for k, v in st.items():
            full = e.comm.all_gather(v.detach(), count=False) if v.dim() == 1 else v.detach()
            out[f"{e.name}/{k}"] = full[: e.numel].clone() if v.dim() == 1 else full.clone()
    return out


def _checkpoint_job(rank, world, model, tmp):
    from pathlib import Path

    out = {}
    engine = _engine(model, "hsdp", NODES["2x2"])
    for step in range(2):   # (the tiny Llama's token sequences)
        engine.backward(_models.loss_of(engine(**_models.local_batch("llama", step, rank,
                                                                      world))))
        engine.step()
    engine.save_checkpoint(Path(tmp) / "ckpt")
    out["saved"] = _state_of(engine)
    engine.save_pretrained(Path(tmp) / "hf-2x2-hsdp")
    del engine
    # hsdp_zero's pieces are not in rank order ([Note: pieces in reduction order]): loaded
    # from hsdp, saved again, and that checkpoint loaded under shard and hsdp_zero at 4 x 1
    for name, layout, nodes, src in (("2x2-hsdp_zero", "hsdp_zero", "2x2", "ckpt"),
                                     ("1x4-shard", "shard", "1x4", "ckpt"),
                                     ("4x1-hsdp", "hsdp", "4x1", "ckpt"),
                                     ("2x2-hpz", "hpz", "2x2", "ckpt"),
                                     ("hz-1x4-shard", "shard", "1x4", "ckpt-hz"),
                                     ("hz-4x1-hsdp_zero", "hsdp_zero", "4x1", "ckpt-hz")):
        engine = _engine(model, layout, NODES[nodes])
        assert engine._layout.name == layout
        engine.load_checkpoint(Path(tmp) / src)
        out[name] = _state_of(engine)
        if src == "ckpt":
            engine.save_pretrained(Path(tmp) / f"hf-{name}")
        if name == "2x2-hsdp_zero":
            engine.save_checkpoint(Path(tmp) / "ckpt-hz")
        del engine
    return out


def _one_rank_job(rank, world, model, tmp):
    from pathlib import Path

    engine = _engine(model, "auto", {})
    engine.load_checkpoint(Path(tmp) / "ckpt-hz")
    from_hz = _state_of(engine)
    engine.load_checkpoint(Path(tmp) / "ckpt")
    engine.save_pretrained(Path(tmp) / "hf-1")
    return {**_state_of(engine), "from_hz": from_hz}


def test_checkpoints_across_layouts(tmp_path):
    for model in CKPT_RUN:
        _check_checkpoints(model, tmp_path / model)


def _check_checkpoints(model, tmp_path):
    from safetensors.torch import load_file

    per_rank = run_distributed(_checkpoint_job, 4, model, str(tmp_path), timeout=900)
    one = run_distributed(_one_rank_job, 1, model, str(tmp_path), timeout=300)[0]
    saved = per_rank[0]["saved"]
    for r in per_rank:
        for name in ("saved", "2x2-hsdp_zero", "1x4-shard", "4x1-hsdp", "2x2-hpz",
                     "hz-1x4-shard", "hz-4x1-hsdp_zero"):
            assert set(r[name]) == set(saved)
            for k, v in saved.items():
                assert torch.equal(r[name][k], v), (name, k)
    from_hz = one.pop("from_hz")
    for k, v in saved.items():
        assert torch.equal(one[k], v), k
        assert torch.equal(from_hz[k], v), k
    files = {n: load_file(str(tmp_path / f"hf-{n}" / "model.safetensors"))
             for n in ("2x2-hsdp", "2x2-hsdp_zero", "1x4-shard", "4x1-hsdp", "2x2-hpz", "1")}
    base = files["2x2-hsdp"]
    for n, f in files.items():
        assert set(f) == set(base) and all(torch.equal(f[k], base[k]) for k in base), n


# ---------------------------------------------------------------------------------- refusals
def _refusals_job(rank, world):
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    import deepcompile
    from _train import environment

    def refused(config, env, mesh=None):
        torch._dynamo.reset()
        try:
            with environment(env):
                deepcompile.initialize(_models.build_model("mlp"), config=deepcompile.Config(
                    compiler="fx", **config), mesh=mesh)
        except ValueError as e:
            return str(e)
        return None

    out = {
        "not_dividing": refused({"layout": "hsdp", "shard_group_size": 3}, {}),
        # nodes {0, 2} and {1, 3} (GROUP_RANK): the groups of two consecutive ranks straddle
        "spread": refused({"layout": "hsdp"}, {"LOCAL_WORLD_SIZE": "2",
                                               "GROUP_RANK": str(rank % 2)}),
        "disagree": refused({"layout": "hsdp"}, {"LOCAL_WORLD_SIZE": str(1 + rank // 2)}),
    }
    os.environ.pop("LOCAL_WORLD_SIZE", None)   # (the launcher's: every rank on one node)
    out["no_size"] = refused({"layout": "hpz"}, {})
    # a mesh of one node's ranks (made on each node), and a mesh whose shard groups cross nodes
    nodes = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    out["mesh_ranks"] = refused({"layout": "hsdp"}, {},
                                DeviceMesh.from_group(nodes[rank // 2], "cpu"))
    crossed = DeviceMesh("cpu", torch.tensor([[0, 2], [1, 3]]))
    out["mesh_nodes"] = refused({"layout": "hsdp"}, {"LOCAL_WORLD_SIZE": "2"}, crossed)
    # a user's 2-D mesh that works: its rows are the groups (no LOCAL_WORLD_SIZE needed)
    torch._dynamo.reset()
    engine = deepcompile.initialize(
        _models.build_model("mlp"), functools.partial(torch.optim.SGD, lr=0.1),
        deepcompile.Config(compiler="fx", layout="hsdp", passes=()),
        mesh=DeviceMesh("cpu", torch.tensor([[0, 1], [2, 3]])))
    engine.backward(_models.loss_of(engine(**_models.local_batch("mlp", 0, rank, world))))
    engine.step()
    lay = engine._layout
    accepted = {"layout": lay.name, "group_size": lay.group_size,
                "shard": dist.get_process_group_ranks(lay.shard.user_group),
                "replicate": dist.get_process_group_ranks(lay.replicate.user_group),
                "groups": sorted(engine.comm_stats(by_group=True))}
    dist.barrier()
    return out, accepted


def test_layouts_that_cannot_work_are_refused_on_every_rank_and_a_users_mesh_is_taken():
    import deepcompile

    with pytest.raises(ValueError, match="'hpz' is not allowed with zero_stage=2"):
        deepcompile.Config(layout="hpz", zero_stage=2)
    with pytest.raises(ValueError, match="'hsdp_zero' is not allowed with zero_stage=1"):
        deepcompile.Config(layout="hsdp_zero", zero_stage=1)
    with pytest.raises(ValueError, match="Config.layout"):
        deepcompile.Config(layout="fsdp")
    with pytest.raises(ValueError, match="shard_group_size"):
        deepcompile.Config(shard_group_size=0)
    per_rank, accepted = zip(*run_distributed(_refusals_job, 4, timeout=300))
    for rank, acc in enumerate(accepted):
        row = rank // 2 * 2
        assert acc == {"layout": "hsdp", "group_size": 2, "shard": [row, row + 1],
                       "replicate": [rank % 2, rank % 2 + 2],
                       "groups": ["inter", "intra", "world"]}, (rank, acc)
    for case, text in per_rank[0].items():
        assert text, f"{case}: not refused"
        assert all(r[case] == text for r in per_rank), case   # the same on every rank
    got = per_rank[0]
    assert "does not divide the 4 ranks" in got["not_dividing"]
    assert "spreads over nodes" in got["spread"] and "LOCAL_WORLD_SIZE=2" in got["spread"]
    assert "disagree on LOCAL_WORLD_SIZE" in got["disagree"]
    assert "needs the group size" in got["no_size"]
    assert "holds ranks [0, 1] but the process group holds [0, 1, 2, 3]" in got["mesh_ranks"]
    assert "spreads over nodes" in got["mesh_nodes"]


def test_deepspeed_hpz_and_mics_sizes():
    import deepcompile

    hpz = deepcompile.Config.from_deepspeed(
        {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8}})
    assert (hpz.layout, hpz.shard_group_size) == ("hpz", 8)
    mics = deepcompile.Config.from_deepspeed(
        {"zero_optimization": {"stage": 2, "mics_shard_size": 4}})
    assert (mics.layout, mics.shard_group_size, mics.zero_stage) == ("hsdp", 4, 2)
    off = deepcompile.Config.from_deepspeed(
        {"zero_optimization": {"stage": 3, "mics_shard_size": -1, "zero_hpz_partition_size": 1}})
    assert (off.layout, off.shard_group_size) == ("auto", None)
