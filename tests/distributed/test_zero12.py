"""ZeRO-1 and ZeRO-2 by compilation (gloo, CPU).

Parity with plain eager single-process training (tolerances as tests/distributed/test_parity.py: losses
1e-5, parameters 1e-5 SGD / 1e-4 AdamW; 8 optimizer steps):
  fx, 2 ranks, per stage: MLP (odd sizes) {SGD gas1, SGD gas4 clip, AdamW gas1 clip, AdamW gas4}
      and tiny Llama {SGD gas1, AdamW gas4 clip}; plus Mixtral with the eager experts loop
      (graph breaks; one graph reused for several experts: ZeRO-1's local gradients must
      follow the parameter actually passed), a submodule run eagerly outside the graphs (its
      gradients reach the shards through the eager hook), tied embeddings, a graph break with
      a parameter used in both graphs, and the prefetch pass configured (a no-op without
      gathers);
  fx, 4 ranks: MLP and Llama, both stages;
  inductor (marked): tiny Llama ZeRO-1 (AdamW, gas 2, clip) and MLP ZeRO-2 (SGD, gas 4).
Communication (engine.comm_stats(), exact): no collective in the forward; the backward only
reduce-scatters — ZeRO-1 once per optimizer step (on the last micro-step), ZeRO-2 every
micro-step — the padded model size in the reduce dtype (a parameter used by two graphs is
reduced in each; Mixtral's eager experts: only the experts hit; a submodule run eagerly: at the
optimizer step instead); one all-gather of the padded model
size (compute dtype) after each optimizer step; all-reduce only for the clipping norm (one fp32
scalar). Reduce-scatters are per parameter during warm-up and profiling, then one per bucket
of the `bucket_reduce` pass (on by default at these stages).
Memory: optimizer state per rank is sum(ceil(numel / N)) elements (1/N of the single-process
optimizer's, up to padding); module parameters are materialized replicas and never hold a
`.grad`; ZeRO-2 gradients are shard-sized; ZeRO-1 holds the full gradient only between the
micro-steps of an accumulation window. No graph break caused by deepcompile (Dynamo's counters:
one graph for models without breaks; exactly plain torch.compile's for the graph-break model).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

import _models
from _train import (COMM_KINDS, FULL, Jobs, compare_to_reference, mean_losses,
                    reference_training, scenario, tanh_stack)

SGD_LR, ADAMW_LR, CLIP = 0.1, 1e-2, 0.1
WARMUP_AND_PROFILE = 3     # Config defaults: 2 warm-up steps + 1 profiled step, then the pass
RECORD = ("comm", "memory", "report", "replicas")


def _sc(stage, model, optim, gas=1, clip=None, *, compiler="fx", record=RECORD, tag="", **kw):
    cid = f"z{stage}-{model}-{optim}-gas{gas}-{'clip' if clip else 'noclip'}{tag}"
    if compiler != "fx":
        cid += f"-{compiler}"
    return scenario(cid, model, optim, SGD_LR if optim == "sgd" else ADAMW_LR, gas=gas,
                    clip=clip, compiler=compiler, zero_stage=stage, record=record, **kw)


_FX2 = [s for stage in (1, 2) for s in (
    _sc(stage, "mlp", "sgd", 1, None, extended=True),
    _sc(stage, "mlp", "sgd", 4, CLIP),
    # AdamW on the MLP: the full suite's (the core steps AdamW at ZeRO-1 in the bf16 Llama
    # run below, and ZeRO-2's reductions every micro-step in z2-mlp-sgd-gas4-clip)
    _sc(stage, "mlp", "adamw", 1, CLIP, extended=True),
    _sc(stage, "mlp", "adamw", 4, None, extended=True),
    _sc(stage, "llama", "sgd", 1, None, extended=True),
    # ZeRO-1 on the tiny Llama in the core: the bf16 run below (fp32 with overlap_refresh:
    # the full suite's test_overlap_refresh fx2 pair)
    _sc(stage, "llama", "adamw", 4, CLIP, extended=True),
)] + [
    # Mixtral's eager experts: a graph reused for other experts' parameters at ZeRO-1 (each
    # shard's owner found per call: test_graph_reuse_exercised), the core's one MoE case
    _sc(1, "mixtral_eager", "sgd", 2, None),
    _sc(1, "disabled", "sgd", 3, CLIP),
    _sc(1, "llama_tied", "adamw", 2, None, extended=True),   # tied: test_models
    _sc(2, "graph_break", "sgd", 2, CLIP),
    # the full suite's: the default run configures prefetch at ZeRO-1 (a no-op without gathers,
    # the same checks) in test_composition.py's zero1-all-passes
    _sc(2, "mlp", "sgd", 2, None, tag="-prefetch", passes=("prefetch", "bucket_reduce"),
        extended=True),
]
# 4 ranks: the full suite's (what they add is the shard arithmetic, padded on 2 ranks too)
_FX4 = [_sc(1, "mlp", "adamw", 4, CLIP, extended=True), _sc(2, "mlp", "sgd", 1, None),
        _sc(1, "llama", "sgd", 2, CLIP), _sc(2, "llama", "adamw", 1, None)]
_INDUCTOR = [_sc(1, "llama", "adamw", 2, CLIP, compiler="inductor"),
             _sc(2, "mlp", "sgd", 4, None, compiler="inductor")]
# bf16 compute (fp32 masters): tolerances of tests/distributed/test_mixed_precision.py
_BF16 = [_sc(1, "llama", "adamw", 2, CLIP, tag="-bf16", param_dtype="bfloat16"),
         _sc(2, "llama", "adamw", 1, None, tag="-bf16-rfp32", param_dtype="bfloat16",
             reduce_dtype="float32", extended=True)]

JOBS = Jobs({"fx2": (2, _FX2 + _BF16), "fx4": (4, _FX4), "inductor2": (2, _INDUCTOR)},
            timeout=1200)
_FP32 = [(job, sc) for job, (_w, scs) in JOBS.jobs.items() for sc in scs if sc not in _BF16]
_SINGLE_GRAPH = ("mlp", "llama", "llama_tied")
# every parameter gets a gradient in every micro-step (Mixtral's eager experts: only those hit)
_DENSE = _SINGLE_GRAPH + ("graph_break", "disabled")


def _params(pairs):
    return [pytest.param(job, s, id=f"{job}-{s['id']}",
                         marks=(pytest.mark.inductor,) if job.startswith("inductor") else ())
            for job, s in pairs]


def _world(job):
    return JOBS.jobs[job][0]


def _stage(sc):
    return sc["config"]["zero_stage"]


def _unique_params(sc):
    return list(_models.build_model(sc["model"]).parameters())


def _padded_numel(sc, world):
    return sum(math.ceil(p.numel() / world) * world for p in _unique_params(sc))


# submodules run eagerly, whose gradients are reduced at the optimizer step ([Note: eager
# gradients are agreed] in runtime/eager.py)
_EAGER = {"disabled": "side"}


def _eager_reduce(sc, world):
    """(count, fp32 bytes) reduce-scattered by the optimizer step: the eager submodule's."""
    if sc["model"] not in _EAGER:
        return 0, 0
    params = list(_models.build_model(sc["model"]).get_submodule(_EAGER[sc["model"]]).parameters())
    return len(params), sum(math.ceil(p.numel() / world) * world * 4 for p in params)


def _reduced_bytes(sc, world):
    """fp32 bytes reduce-scattered per reducing micro-step: the padded model size, plus, for the
    graph-break model, `shared` once more (it is used, and reduced, in both graphs), less the
    eager submodule's (reduced at the step)."""
    model = _models.build_model(sc["model"])
    padded = lambda p: math.ceil(p.numel() / world) * world * 4  # noqa: E731
    twice = list(model.shared.parameters()) if sc["model"] == "graph_break" else []
    return sum(padded(p) for p in model.parameters()) + sum(padded(p) for p in twice) - \
        _eager_reduce(sc, world)[1]


def _n_buckets(result):
    passes = {e["pass"]: e for e in result["report"]["passes"]}
    return sum(len(d["buckets"]) for d in passes["bucket_reduce"]["decisions"].values())


# ---------------------------------------------------------------------------------- parity
@pytest.mark.parametrize("job, sc", _params(_FP32))
def test_parity_with_eager_reference(job, sc):
    results = JOBS.results(job, sc["id"])
    if sc["config"]["max_grad_norm"] is not None:  # the threshold really clips
        assert min(reference_training(sc)["grad_norms"]) > sc["config"]["max_grad_norm"]
    compare_to_reference(sc, results, kind=f"zero{_stage(sc)}/{sc['model']}/"
                                           f"{sc['config']['compiler']}")


@pytest.mark.parametrize("job, sc", _params(_FP32))
def test_replicas_equal_the_masters_on_every_rank(job, sc):
    """After training, every rank's module parameters are the gathered masters, exactly."""
    for r in JOBS.results(job, sc["id"]):
        assert set(r["replicas"]) == set(r["state"])
        for k, v in r["state"].items():
            assert torch.equal(r["replicas"][k], v), (r["rank"], k)


def _plain_compile_graphs(name: str) -> dict:
    """Dynamo's counters for plain torch.compile of the model (one training micro-step)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = _models.build_model(name)
    _models.loss_of(torch.compile(model, backend="aot_eager")(**_models.global_batch(name, 0)))\
        .backward()
    out = {"unique_graphs": int(counters["stats"].get("unique_graphs", 0)),
           "graph_breaks": int(sum(counters["graph_break"].values()))}
    torch._dynamo.reset()
    return out


@pytest.mark.parametrize("job, sc", _params(_FP32))
def test_no_graph_breaks(job, sc):
    """deepcompile adds no graph break and no recompilation: one graph for the models without
    breaks; the graph-break model has exactly what plain torch.compile has."""
    if sc["model"] in _SINGLE_GRAPH:
        expected = {"unique_graphs": 1, "graph_breaks": 0}
    elif sc["model"] == "graph_break":
        expected = _plain_compile_graphs("graph_break")
        assert expected["graph_breaks"] >= 1
    else:
        pytest.skip("data-dependent graphs (mixtral_eager) or eager submodule: parity only")
    for r in JOBS.results(job, sc["id"]):
        assert r["graphs"] == expected, r["graphs"]


def test_graph_reuse_exercised():
    """The Mixtral scenario really runs a graph for other parameters than it was compiled for
    (the case where ZeRO-1 must find the owner of a gradient by its shard)."""
    for r in JOBS.results("fx2", "z1-mixtral_eager-sgd-gas2-noclip"):
        assert r["report"]["graph_reuse"], "no graph was reused"


@pytest.mark.parametrize("sc", _BF16, ids=lambda s: s["id"])
def test_bf16_compute_fp32_masters(sc):
    results = JOBS.results("fx2", sc["id"])
    ref = reference_training(sc)
    losses = mean_losses(results)
    dev = max(abs(a - b) for a, b in zip(losses, ref["losses"]))
    print(f"\n[deviation] {sc['id']}: |loss - fp32 loss| max {dev:.3g}")
    assert dev < 2e-2 and losses[-1] < losses[0] - 0.3, (losses, ref["losses"])
    numel = _padded_numel(sc, 2)
    reduce_size = 4 if sc["config"].get("reduce_dtype") == "float32" else 2
    for r in results:
        assert r["opt_param_dtypes"] == ["torch.float32"]
        assert {str(v.dtype) for v in r["replicas"].values()} == {"torch.bfloat16"}
        for k, v in r["state"].items():   # the replica is the master rounded to bf16
            assert torch.equal(r["replicas"][k], v.to(torch.bfloat16)), k
        for s in r["comm_step"]:
            assert s["all_gather"] == (1, numel * 2), s       # replicas refreshed in bf16
        per_step = _per_step_reduce(r, sc)
        assert all(b == numel * reduce_size for _c, b in per_step), per_step


# ---------------------------------------------------------------------------- communication
def _per_step_reduce(r, sc):
    """(count, bytes) of reduce-scatters per optimizer step (summed over its micro-steps)."""
    gas = sc["config"]["gradient_accumulation_steps"]
    bwd = r["comm_bwd"]
    return [tuple(map(sum, zip(*(b["reduce_scatter"] for b in bwd[i:i + gas]))))
            for i in range(0, len(bwd), gas)]


@pytest.mark.parametrize("job, sc", _params(_FP32))
def test_comm_reduce_scatter_only_model_size(job, sc):
    """Forward: nothing. Backward: reduce-scatters of the padded model size, once per optimizer
    step (ZeRO-1, on the last micro-step) or per micro-step (ZeRO-2); no all-gather, no
    all-reduce. Per parameter before the pass, one per bucket after it."""
    world, stage = _world(job), _stage(sc)
    gas = sc["config"]["gradient_accumulation_steps"]
    padded_bytes = _reduced_bytes(sc, world)
    n_params = len(_unique_params(sc))
    graphs = 1 if sc["model"] in _SINGLE_GRAPH else None
    for r in JOBS.results(job, sc["id"]):
        n_buckets = _n_buckets(r)
        assert 1 <= n_buckets <= n_params
        assert len(r["comm_bwd"]) == sc["steps"] * gas
        for i, (f, b) in enumerate(zip(r["comm_fwd"], r["comm_bwd"])):
            where = f"{sc['id']} rank {r['rank']} micro-step {i}"
            assert all(f[k] == (0, 0) for k in COMM_KINDS), (where, f)
            assert b["all_gather"] == b["all_reduce"] == (0, 0), (where, b)
            if sc["model"] not in _DENSE:
                continue
            reduces = stage == 2 or i % gas == gas - 1
            if not reduces:
                assert b["reduce_scatter"] == (0, 0), (where, "ZeRO-1 reduced early", b)
                continue
            count, nbytes = b["reduce_scatter"]
            assert nbytes == padded_bytes, (where, b, padded_bytes)
            if graphs == 1:
                bucketed = i // gas >= WARMUP_AND_PROFILE
                assert count == (n_buckets if bucketed else n_params), (where, b, n_buckets)


@pytest.mark.parametrize("job, sc", _params(_FP32))
def test_comm_after_step_one_allgather(job, sc):
    """engine.step(): one all-gather of the padded model (fp32 here) into the replicas; no
    counted all-reduce in the whole run (the clipping norm rides in the inf/NaN check's
    reduction, bookkeeping)."""
    world = _world(job)
    padded_bytes = _padded_numel(sc, world) * 4
    for r in JOBS.results(job, sc["id"]):
        assert len(r["comm_step"]) == sc["steps"]
        for s in r["comm_step"]:
            assert s["all_gather"] == (1, padded_bytes), s
            if sc["model"] in _DENSE:   # (ZeRO-1 flushes a gradient not reduced on the last
                # micro-step: an expert hit earlier); eager submodules' gradients
                assert s["reduce_scatter"] == _eager_reduce(sc, world), s
            assert s["all_reduce"] == (0, 0), s
        total_all_reduce = sum(x["all_reduce"][1] for x in r["comm_fwd"] + r["comm_bwd"]
                               + r["comm_step"])
        assert total_all_reduce == 0


@pytest.mark.parametrize("job, sc", _params(_FP32))
def test_report_shows_stage_and_passes(job, sc):
    from deepcompile.report import Report

    for r in JOBS.results(job, sc["id"]):
        rep = r["report"]
        assert rep["config"]["zero_stage"] == _stage(sc)
        assert rep["parameters"]["replicated"] is True
        assert f"ZeRO-{_stage(sc)} over {_world(job)} ranks" in str(Report(**rep))
        passes = {e["pass"]: e for e in rep["passes"]}
        assert passes["bucket_reduce"]["changed"], "bucket_reduce (the default) did nothing"
        if "prefetch" in passes:   # nothing to prefetch without gathers: a no-op
            assert passes["prefetch"]["changed"] == []
        for g in rep["graphs"]:
            assert all(s["all_gathers"] == 0 for s in g["slots"]), g


# ----------------------------------------------------------------------------------- memory
@pytest.mark.parametrize("job, sc", _params(_FP32))
def test_memory_per_rank(job, sc):
    world, stage = _world(job), _stage(sc)
    params = _unique_params(sc)
    shards = [math.ceil(p.numel() / world) for p in params]
    full_bytes = sum(p.numel() for p in params) * 4
    gas = sc["config"]["gradient_accumulation_steps"]
    for r in JOBS.results(job, sc["id"]):
        snaps = [r["memory_init"]] + r["memory_micro"] + r["memory_step"]
        for snap in snaps:
            # replicas: materialized, full size (at the head of a padded buffer: the refresh
            # copies every rank's shard into it); never a replicated .grad
            assert snap["module_storage_nbytes"] == [s * world * 4 for s in shards]
            assert all(g is None for g in snap["module_grads"]), snap["module_grads"]
            # the optimizer steps flat fp32 shards
            assert snap["opt_param_numel"] == shards
            assert set(snap["opt_param_dim"]) == {1}
        # ZeRO-1 with accumulation keeps one full gradient accumulator per parameter (master
        # dtype), holding a gradient only inside an accumulation window
        accumulates = stage == 1 and gas > 1
        for i, snap in enumerate(r["memory_micro"]):
            if not accumulates:
                assert snap["local_grad_bytes"] == 0 and not snap["local_grad_held"]
            elif sc["model"] in _SINGLE_GRAPH:
                assert snap["local_grad_bytes"] == full_bytes, (i, snap["local_grad_bytes"])
                assert snap["local_grad_held"] == (i % gas != gas - 1), i
            if sc["model"] in _SINGLE_GRAPH:   # every parameter gets a gradient every step
                assert snap["opt_grads"] == shards   # shard-sized (ZeRO-2: gradient memory 1/N)
        for snap in r["memory_step"]:
            assert not snap["local_grad_held"]
        if sc["optim"][0] == "adamw":
            total = sum(shards)
            for snap in r["memory_step"]:
                assert snap["opt_state_numel"] == {"exp_avg": total, "exp_avg_sq": total}


# ----------------------------------------------------------------------------------- config
def test_config_stages_and_default_passes():
    from deepcompile import Config

    for stage in (1, 2, 3):   # the passes are chosen from the profile at every stage
        assert Config(zero_stage=stage).passes == "auto" == Config(zero_stage=stage, passes=None).passes
    assert Config(zero_stage=1, passes=()).passes == ()
    assert Config(zero_stage=2, profile_steps=0).passes == "auto"   # then nothing is chosen
    assert Config.from_dict(Config(zero_stage=1).to_dict()) == Config(zero_stage=1)
    with pytest.raises(ValueError, match="profile_steps"):
        Config(zero_stage=1, passes=("bucket_reduce",), profile_steps=0)


# ------------------------------------------------------------------- insertion (in-process)
# the 8-layer tanh stack (16 parameters: a backward long enough to spread the reduces through);
# the tiny Llama's graphs in the full suite too
_INSERTION_MODELS = ("tanh_stack", "llama") if FULL else ("tanh_stack",)


def _loss(engine, name):
    if name == "tanh_stack":
        return engine(torch.randn(8, 8, generator=torch.Generator().manual_seed(0))).square().mean()
    return _models.loss_of(engine(**_models.global_batch(name, 0)))


# ZeRO-2's insertion (reduces without a shard): the full suite's; its graphs train in the core's
# ZeRO-2 parity cells
@pytest.mark.parametrize("stage", [1, pytest.param(2, marks=pytest.mark.extended)])
def test_reduces_follow_their_gradients(group, stage):
    """The forward has no collective; in the backward each gradient's reduce-scatter comes
    right after the node that completes the gradient, so the reduces are spread through the
    backward (what lets bucket_reduce start them while the rest of the backward runs).
    ZeRO-1's reduces also take their shard (the owner of a locally kept gradient)."""
    import deepcompile
    from deepcompile.runtime import ops

    for name in _INSERTION_MODELS:
        torch._dynamo.reset()
        model = tanh_stack() if name == "tanh_stack" else _models.build_model(name)
        n_params = len(list(model.parameters()))
        engine = deepcompile.initialize(
            model, optimizer=functools.partial(torch.optim.SGD, lr=0.1),
            config={"zero_stage": stage, "compiler": "fx", "passes": ()})
        engine.backward(_loss(engine, name))
        engine.step()
        slots = engine._pipeline.slots
        assert sorted(slots) == ["g0.bw", "g0.fw"]
        fw = [n for n in slots["g0.fw"].gm.graph.nodes if n.op == "call_function"]
        assert not [n for n in fw if n.target in ops.COMM_KINDS]
        bw = [n for n in slots["g0.bw"].gm.graph.nodes if n.op == "call_function"]
        reduces = [i for i, n in enumerate(bw) if n.target in ops.COMM_KINDS]
        assert len(reduces) == n_params and all(bw[i].target is ops.REDUCE_GRAD for i in reduces)
        for i in reduces:
            assert bw[i - 1] is bw[i].args[0], (name, bw[i - 1], bw[i])
            shard = ops.reduce_grad_shard(bw[i])
            assert (shard is not None and shard.op == "placeholder") if stage == 1 \
                else shard is None
        assert reduces[0] < len(bw) // 4 and reduces[-1] == len(bw) - 1, (name, reduces)
        del engine
        torch._dynamo.reset()
