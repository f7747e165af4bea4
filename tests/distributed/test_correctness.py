"""Never silently wrong: the ways a model can train wrong without an error, each trained against
single-process eager (tests/_train.py) or refused on every rank.

1. A parameter with no gradient in an optimizer step (a head used on some steps, a parameter
   never used) is not stepped: its value and optimizer state stay as torch's optimizer leaves
   them (no weight decay, no moment decay, no step count; never used: no state at all), at
   every stage, with gradient accumulation and clipping, under every offload tier, through a
   checkpoint ([Note: steps without a gradient] in runtime/flat.py); the common step (every
   parameter has a gradient) stays one chunk, one inner-optimizer call.
2. ZeRO-3: a parameter first read with gradients disabled (no_grad, inference_mode, .detach(),
   a mean teacher's forward, a VQ codebook's distances) trains through its later uses ([Note:
   gathers with gradients] in compiler/backend.py).
3. A module run on some ranks only (an experts loop that skips an expert no token of this rank
   is routed to): run eagerly at ZeRO-1/2 it trains as under DDP ([Note: eager gradients are
   agreed] in runtime/eager.py); at ZeRO-3 eagerly, or compiled at any stage, every rank raises
   a DivergenceError naming it ([Note: eager gathers are agreed]; the graph agreement and the
   divergence check).
4. The coverage invariant ([Note: gradient coverage] in compiler/coverage.py): a pass that
   drops, repeats or swaps a reduction, or leaves a read without its gather, and a lowering that
   loses one, raise CoverageError naming the pass and the parameter.

Parity: 2 gloo ranks, fx (one Inductor case per fix), losses 1e-5, parameters 1e-5 SGD / 1e-4
AdamW, and the optimizer state of every parameter against torch's (its presence, its step count
exactly, its moments to 1e-5).
"""

from __future__ import annotations

import functools
import operator

import pytest
import torch

import _models
from _train import Jobs, chunk_bytes, compare_to_reference, reference_training, scenario

SGD_LR, ADAMW_LR, CLIP = 0.1, 1e-2, 0.1
STEPS = 6


def _sc(model, stage, optim, gas=1, clip=None, *, compiler="fx", tag="", **kw):
    cid = f"{model}-z{stage}-{optim}-gas{gas}{'-clip' if clip else ''}{tag}"
    if compiler != "fx":
        cid += f"-{compiler}"
    return scenario(cid, model, optim, SGD_LR if optim == "sgd" else ADAMW_LR, gas=gas,
                    clip=clip, compiler=compiler, zero_stage=stage, steps=STEPS,
                    record=("optim_state",), **kw)


# parameters without a gradient in some optimizer steps (odd_head's `aux` is used in micro-steps
# 2, 3, 6, 7, ...: with gas 2 in every other optimizer step, with gas 1 in two of every four)
# (ZeRO-2 beside ZeRO-1 and 3: the full suite's; [Note: the core matrix] in tests/_train.py;
# so is SGD at ZeRO-3: SGD's momentum as torch leaves it is test_no_gradient_no_step_as_torch's,
# ZeRO-3's sharded step without a gradient odd_head-z3-adamw-gas2-clip's)
_UNUSED = [_sc("odd_head", 1, "adamw", 2, CLIP), _sc("odd_head", 2, "adamw", 2, extended=True),
           _sc("odd_head", 3, "adamw", 2, CLIP), _sc("odd_head", 3, "sgd", 1, extended=True)]
# parameters first read without gradients (ZeRO-3; ZeRO-2 once, where nothing is gathered)
_NOGRAD = [_sc("nograd_read", 3, "adamw", 2), _sc("inference_read", 3, "adamw", 1),
           _sc("detach_read", 3, "adamw", 1), _sc("mean_teacher", 3, "adamw", 2, CLIP),
           _sc("mean_teacher_apart", 3, "adamw", 1),
           _sc("vq", 3, "adamw", 2), _sc("nograd_read", 2, "adamw", 1)]
# modules run on some ranks only, eagerly, trained (ZeRO-1/2); the agreement with no
# divergence check rides a reduction of its own
# (ZeRO-2 SGD beside ZeRO-1: the full suite's; ZeRO-2 in the core: the run without the check)
_PER_RANK = [_sc("moe_skip_disabled", 1, "adamw", 2),
             _sc("moe_skip_disabled", 2, "sgd", 1, extended=True),
             _sc("moe_skip_disabled", 2, "adamw", 2, tag="-nocheck", divergence_check_every=0)]
# ... and refused: eagerly at ZeRO-3, compiled at every stage
_REFUSED = {"moe_skip_disabled-z3-sgd-gas1": ("experts.0.fc", "experts.1.fc"),
            "moe_skip-z3-sgd-gas1": ("experts.",),
            "moe_skip_early-z1-sgd-gas2": ("experts.",),
            "moe_skip_early-z2-sgd-gas1": ("experts.",)}
_REFUSED_SC = [_sc("moe_skip_disabled", 3, "sgd", 1), _sc("moe_skip", 3, "sgd", 1),
               _sc("moe_skip_early", 1, "sgd", 2), _sc("moe_skip_early", 2, "sgd", 1)]
_INDUCTOR = [_sc("odd_head", 2, "adamw", 2, CLIP, compiler="inductor"),
             _sc("nograd_read", 3, "adamw", 2, compiler="inductor"),
             _sc("moe_skip_disabled", 1, "adamw", 2, compiler="inductor")]

JOBS = Jobs({"fx2": (2, _UNUSED + _NOGRAD + _PER_RANK + _REFUSED_SC),
             "inductor2": (2, _INDUCTOR)}, timeout=1200)
_TRAINED = [(job, sc) for job, (_w, scs) in JOBS.jobs.items() for sc in scs
            if sc not in _REFUSED_SC]


def _params(pairs):
    return [pytest.param(job, s, id=f"{job}-{s['id']}",
                         marks=(pytest.mark.inductor,) if job.startswith("inductor") else ())
            for job, s in pairs]


def _check_optim_state(sc, results) -> None:
    """Every parameter's optimizer state as torch's optimizer's: present exactly where torch
    has one, the same step count, the moments within rounding."""
    want = reference_training(sc)["optim_state"]
    for r in results:
        got = r["optim_state"]
        assert sorted(got) == sorted(want), (r["rank"], sorted(got), sorted(want))
        for name, st in want.items():
            assert sorted(got[name]) == sorted(st), (name, sorted(got[name]), sorted(st))
            for k, v in st.items():
                g = got[name][k]
                if isinstance(v, torch.Tensor) and v.dim():
                    assert torch.allclose(g, v, rtol=1e-3, atol=1e-5), (name, k)
                else:
                    assert g == (v.item() if isinstance(v, torch.Tensor) else v), (name, k, g, v)


@pytest.mark.parametrize("job, sc", _params(_TRAINED))
def test_parity_with_eager_reference(job, sc):
    results = JOBS.results(job, sc["id"])
    if sc["config"]["max_grad_norm"] is not None:   # the threshold really clips
        assert min(reference_training(sc)["grad_norms"]) > sc["config"]["max_grad_norm"]
    compare_to_reference(sc, results, kind=f"{sc['model']}/z{sc['config']['zero_stage']}")
    _check_optim_state(sc, results)


def test_the_cases_have_what_they_test():
    """The reference itself: `aux` has a gradient in some optimizer steps only (fewer steps in
    its state), `never` in none (no state); the teacher never gets one; the ranks' halves of the
    MoE batch do go to different experts."""
    st = reference_training(_UNUSED[0])["optim_state"]
    assert "never" not in st and 0 < st["aux.weight"]["step"] < st["fc1.weight"]["step"] == STEPS
    assert "teacher.1.weight" not in reference_training(_NOGRAD[3])["optim_state"]
    x = _models.global_batch("moe_skip", 2)["x"]
    half = _models.GLOBAL_BATCH // 2
    assert (x[:half, 0] > 0).all() and (x[half:, 0] < 0).all()


@pytest.mark.parametrize("sc", _REFUSED_SC, ids=lambda s: s["id"])
def test_a_module_run_on_some_ranks_only_is_refused_on_every_rank(sc):
    """Where such a module cannot train (ZeRO-3 eagerly; compiled: one graph run for different
    experts, or different graphs), every rank raises a DivergenceError naming the experts before
    any optimizer step takes their gradients."""
    per_rank = JOBS.results("fx2")[sc["id"]]
    assert len(per_rank) == 2
    for r in per_rank:
        assert "error" in r, f"rank {r['rank']} trained: {r.get('losses')}"
        assert "DivergenceError" in r["error"], r["error"][-2000:]
        tail = r["error"][r["error"].index("DivergenceError"):]
        assert all(name in tail for name in _REFUSED[sc["id"]]), tail[:2000]


# -------------------------------------------------------- no gradient: offload tiers (in-process)
class _OddHead(torch.nn.Module):
    """In one chunk: `fc1`, `never` (never used), `aux` (used where `use_aux`), `fc2`."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(8, 16)
        self.never = torch.nn.Parameter(torch.ones(6))
        self.aux = torch.nn.Linear(16, 4)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x, use_aux: bool):
        h = torch.tanh(self.fc1(x))
        out = self.fc2(h)
        return out + self.aux(h) if use_aux else out


_ADAMW = functools.partial(torch.optim.AdamW, lr=0.01)
_AUX_STEPS = (2, 3)   # the optimizer steps (of 6) in which `aux` has a gradient


def _odd_engine(config=None):
    import deepcompile

    return deepcompile.initialize(_OddHead(), optimizer=_ADAMW, config={
        "compiler": "fx", "passes": (), "param_dtype": "bfloat16", "gradient_accumulation_steps": 2,
        "max_grad_norm": 0.05, **(config or {})})


def _odd_step(engine, step):
    for micro in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + micro))
        engine.backward(engine(x.bfloat16(), step in _AUX_STEPS).float().square().mean())
    engine.step()


def _optim_state(engine) -> dict:
    """{name: {key: value}} of `engine.optimizer.state_dict()` (a parameter without state:
    absent)."""
    osd = engine.optimizer.state_dict()
    names = [e.name for g in engine.optimizer.param_groups for p in g["params"]
             for e in engine._registry if e.shard is p]
    return {names[i]: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in st.items()}
            for i, st in osd["state"].items()}


def _same_state(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(
        sorted(a[n]) == sorted(b[n]) and all(torch.equal(torch.as_tensor(a[n][k]),
                                                         torch.as_tensor(b[n][k])) for k in a[n])
        for n in a)


_TIER_RUNS: dict = {}   # {0: the resident run's final weights and optimizer state}


def _tier_run(tier):
    """Trains the odd head with every chunk at offload tier `tier`, checking every step; its
    final weights and optimizer state."""
    engine = _odd_engine()
    if tier:
        engine._offload.set_plan({c.index: tier for c in engine._flat.chunks})
    assert len(engine._flat.chunks) == 1
    for step in range(6):
        before, state = engine.full_state_dict(), _optim_state(engine)
        _odd_step(engine, step)
        after, now = engine.full_state_dict(), _optim_state(engine)
        for name in ("aux.weight", "aux.bias"):
            moved = not torch.equal(before[name], after[name])
            assert moved == (step in _AUX_STEPS), (tier, step, name)
            if step not in _AUX_STEPS:
                assert _same_state({name: state.get(name, {})}, {name: now.get(name, {})})
        assert not torch.equal(before["fc1.weight"], after["fc1.weight"])
        assert torch.equal(after["never"], torch.ones(6)) and "never" not in now
    assert now["aux.weight"]["step"] == len(_AUX_STEPS) and now["fc1.weight"]["step"] == 6
    if tier:   # state off the device: the facade shows meta tensors (reading them raises)
        assert {v.device.type for st in engine.optimizer.state.values()
                for v in st.values() if isinstance(v, torch.Tensor) and v.dim()} == {"meta"}
    if tier == 4:
        assert engine._offload.stats["stepped_on_host"] > 0
    return engine.full_state_dict(), now


@pytest.mark.parametrize("tier", [0, 1, 2, 3, 4])
def test_no_gradient_no_step_under_every_offload_tier(group, tier):
    """With clipping and accumulation: in an optimizer step where `aux` has no gradient its
    master and its state stay bitwise as they were, `never` never gets state, the other
    parameters step; every tier trains bitwise as the resident step (clipping: within a
    rounding, as tests/engine/test_offload_masters.py)."""
    if 0 not in _TIER_RUNS:   # the resident run, trained (and checked) once per session
        _TIER_RUNS[0] = _tier_run(0)
    w0, s0 = _TIER_RUNS[0]
    wt, st = (w0, s0) if tier == 0 else _tier_run(tier)
    assert sorted(st) == sorted(s0)
    for k in w0:
        assert torch.allclose(wt[k], w0[k], rtol=0, atol=1e-6), k
    for n in s0:
        for k, v in s0[n].items():
            assert torch.allclose(torch.as_tensor(st[n][k]), torch.as_tensor(v),
                                  rtol=0, atol=1e-6), (n, k)


@pytest.mark.parametrize("chunk", [None, 256], ids=["one-chunk", "small-chunks"])
@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_no_gradient_no_step_as_torch(group, optim, chunk):
    """World size 1, fp32, against torch's optimizer on the unsharded model: `aux` first steps
    at step 2, split off its chunk's other parameters (one chunk) or a chunk of its own stepped
    with chunks that have state (small chunks; torch's fused SGD takes its momentum buffers all
    made or all to make)."""
    import deepcompile

    make = (functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9) if optim == "sgd"
            else functools.partial(torch.optim.AdamW, lr=0.01))
    ref = _OddHead()
    ref_opt = make(ref.parameters())
    with chunk_bytes(chunk):
        engine = deepcompile.initialize(_OddHead(), optimizer=make,
                                        config={"compiler": "fx", "passes": ()})
    assert (len(engine._flat.chunks) == 1) == (chunk is None)
    for step in range(6):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        engine.backward(engine(x, step in _AUX_STEPS).square().mean())
        engine.step()
        ref(x, step in _AUX_STEPS).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    got = engine.full_state_dict()
    for name, p in ref.named_parameters():
        assert torch.allclose(got[name], p.detach(), rtol=0, atol=1e-6), name
    assert torch.equal(got["never"], torch.ones(6))
    state = _optim_state(engine)
    assert sorted(state) == sorted(n for n, p in ref.named_parameters() if ref_opt.state.get(p))


def test_split_units_survive_a_checkpoint(group, tmp_path):
    """A chunk split into units (parameters with other step counts, one without state) saves
    and loads: the resumed run is the uninterrupted one, bitwise."""
    engine = _odd_engine({"max_grad_norm": None})
    for step in range(4):
        _odd_step(engine, step)
    assert len(engine._flat.chunks[0].units) > 1
    engine.save_checkpoint(tmp_path / "ckpt")
    saved = _optim_state(engine)
    for step in range(4, 6):
        _odd_step(engine, step)
    resumed = _odd_engine({"max_grad_norm": None})
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert _same_state(_optim_state(resumed), saved)
    for step in range(4, 6):
        _odd_step(resumed, step)
    a, b = engine.full_state_dict(), resumed.full_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert _same_state(_optim_state(engine), _optim_state(resumed))


def test_the_common_step_is_one_call_over_whole_chunks(group):
    """Every parameter with a gradient in every step: each chunk stays one unit (its flat
    master) and the step is one call of the inner optimizer."""
    import deepcompile

    torch.manual_seed(0)
    with chunk_bytes(256):
        engine = deepcompile.initialize(
            torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)),
            optimizer=_ADAMW, config={"compiler": "fx", "passes": ()})
    flat = engine._flat
    calls = []
    step = flat.inner.step
    flat.inner.step = lambda *a, **k: calls.append(1) or step(*a, **k)
    for i in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
        engine.backward(engine(x).square().mean())
        engine.step()
    assert len(flat.chunks) > 1 and calls == [1, 1, 1]
    assert all(len(c.units) == 1 and c.units[0].param is c.param for c in flat.chunks)


# ----------------------------------------------------------------------- the coverage invariant
def _drop_one_reduction(ctx):
    """A broken pass: the first reduction of every backward graph replaced by zeros."""
    from deepcompile.runtime import ops

    changed = []
    for key, slot in ctx.slots.items():
        node = next((n for n in slot.gm.graph.nodes if n.op == "call_function"
                     and n.target is ops.REDUCE_GRAD), None)
        if node is None:
            continue
        with slot.gm.graph.inserting_before(node):
            zeros = slot.gm.graph.call_function(torch.zeros_like, (node.args[0],))
        node.replace_all_uses_with(zeros)
        slot.gm.graph.erase_node(node)
        changed.append(key)
    return changed


def _register_broken_pass():
    from deepcompile import passes

    if "drop_one_reduction" not in passes.known_passes():
        import deepcompile

        deepcompile.register_pass("drop_one_reduction", plan=lambda ctx: {},
                                  apply=lambda ctx, decisions: _drop_one_reduction(ctx),
                                  description="a test's broken pass")


@pytest.mark.parametrize("stage", [2, 3])
def test_a_pass_that_drops_a_reduction_is_refused(group, stage):
    """A user's pass that loses a gradient's reduction: CoverageError naming the pass, the
    graph and the parameter, at the step where the pass applies; nothing was stepped with it."""
    import deepcompile
    from deepcompile.compiler.coverage import CoverageError

    _register_broken_pass()
    torch.manual_seed(0)
    engine = deepcompile.initialize(_models.build_model("mlp"), optimizer=_ADAMW, config={
        "compiler": "fx", "zero_stage": stage, "passes": ("drop_one_reduction",),
        "warmup_steps": 1, "measure_steps": 0})
    batch = _models.global_batch("mlp", 0)
    with pytest.raises(CoverageError) as info:
        for _ in range(4):
            engine.backward(engine(**batch))
            engine.step()
    text = str(info.value)
    assert "'drop_one_reduction'" in text and "g0.bw" in text, text
    assert "is no longer reduced" in text and "fc3." in text, text


P0 = 10 ** 9   # the synthetic graphs' parameter ids (no engine's)


def _synthetic():
    """A backward graph as compiled: two parameters' gradients reduced, both read gathered."""
    from torch import fx

    from deepcompile.runtime import ops

    g = fx.Graph()
    s0, s1, x = g.placeholder("shard0"), g.placeholder("shard1"), g.placeholder("x")
    w0 = g.call_function(ops.ALLGATHER, (s0, P0, [2, 2], torch.float32))
    w1 = g.call_function(ops.ALLGATHER, (s1, P0 + 1, [2, 2], torch.float32))
    y = g.call_function(torch.mm, (x, w0))
    z = g.call_function(torch.mm, (y, w1))
    r0 = g.call_function(ops.REDUCE_GRAD, (y, P0, 2, torch.float32))
    r1 = g.call_function(ops.REDUCE_GRAD, (z, P0 + 1, 2, torch.float32))
    g.output((r0, r1))
    return fx.GraphModule(torch.nn.Module(), g)


def _broken(kind):
    """The synthetic graph after a pass that breaks it one way."""
    from deepcompile.runtime import ops

    gm = _synthetic()
    nodes = {n.name: n for n in gm.graph.nodes}
    if kind == "read without its gather":   # mm reads the shard
        nodes["mm"].replace_input_with(nodes["allgather_param_default"], nodes["shard0"])
    elif kind == "swapped":   # each reduction takes the other's gradient
        nodes["reduce_grad_default"].update_arg(0, nodes["mm_1"])
        nodes["reduce_grad_default_1"].update_arg(0, nodes["mm"])
    elif kind == "twice":
        with gm.graph.inserting_after(nodes["reduce_grad_default_1"]):
            gm.graph.call_function(ops.REDUCE_GRAD, (nodes["mm_1"], P0 + 1, 2, torch.float32))
    elif kind == "outputs swapped":
        nodes["output"].args = ((nodes["reduce_grad_default_1"], nodes["reduce_grad_default"]),)
    elif kind == "bucket":   # bucket_reduce's shape: fine
        with gm.graph.inserting_before(nodes["output"]):
            pids = [P0, P0 + 1]
            start = gm.graph.call_function(ops.REDUCE_START, ([nodes["mm"], nodes["mm_1"]], pids))
            wait = gm.graph.call_function(ops.REDUCE_WAIT, (start, pids))
            parts = [gm.graph.call_function(operator.getitem, (wait, i)) for i in range(2)]
        nodes["output"].args = (tuple(parts),)
        for n in (nodes["reduce_grad_default"], nodes["reduce_grad_default_1"]):
            gm.graph.erase_node(n)
    gm.graph.lint()
    return gm


@pytest.mark.parametrize("kind, message", [
    ("read without its gather", f"reads parameter id {P0} without its gather"),
    ("swapped", "is reduced as the gradient of"),
    ("twice", "is reduced twice"),
    ("outputs swapped", "is not that parameter's reduction"),
])
def test_coverage_on_synthetic_graphs(kind, message):
    from deepcompile.compiler.coverage import Coverage, CoverageError

    want = Coverage.of(_synthetic())
    want.check(_synthetic(), "nothing", "g")
    want.check(_broken("bucket"), "a bucketing pass", "g")
    with pytest.raises(CoverageError, match=message) as info:
        want.check(_broken(kind), "the pass 'x'", "g9.bw")
    assert "the pass 'x' broke graph g9.bw" in str(info.value)


def test_a_lowering_that_loses_a_reduction_is_refused(group, monkeypatch):
    """The lowering's own check: a reduction that became no collective."""
    import deepcompile
    from deepcompile.compiler import lower
    from deepcompile.compiler.coverage import CoverageError

    def lossy(self, node, accumulated):   # the shard gradient as zeros, nothing reduced
        return self.zeros(lower.lookup(int(node.args[1])))

    monkeypatch.setattr(lower._Lowering, "reduce_sync", lossy)
    engine = deepcompile.initialize(_models.build_model("mlp"), optimizer=_ADAMW,
                                    config={"compiler": "fx", "passes": ()})
    with pytest.raises(CoverageError, match=r"the lowering broke graph g0\.bw: its reductions "
                                            r"of fc\d\.\w+ \(lost\)"):
        engine.backward(engine(**_models.global_batch("mlp", 0)))
