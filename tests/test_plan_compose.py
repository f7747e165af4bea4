"""Composing a model's graphs from its pieces (planner/pieces.py, trace.py, compose.py) and the
roofline's counts (planner/roofline.py), against the whole model traced at once."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from deepcompile.tools.plan import compose, pieces, roofline, shapes, trace  # noqa: E402
from deepcompile.tools.plan.roofline import NodeCost  # noqa: E402

SEQ, BATCH = 32, 2


def _shape(layers: int = 2) -> shapes.ModelShape:
    s = shapes.load("tiny-llama")
    return shapes.ModelShape(s.name, s.arch, dict(s.config, num_hidden_layers=layers))


@pytest.fixture(scope="module")
def traced():
    shape = _shape()
    ps = pieces.build(shape, batch=BATCH, seq=SEQ, dtype=torch.float32, fake=True)
    return shape, ps, trace.trace_all(ps)


def _flops_times(graphs):
    def times(piece, phase):
        gm = getattr(graphs[piece], phase)
        return {n.name: NodeCost(1e-6, roofline.flops(n)[1], 1)
                for n in gm.graph.nodes if n.op == "call_function"}
    return times


@pytest.fixture(scope="module")
def whole(traced):
    """The same model (same config, fake weights) traced in one piece: ids -> loss."""
    shape, ps, _ = traced
    model_cls = pieces._model_class(shape.arch)
    with ps.mode:
        model = model_cls(shape.hf_config(seq=SEQ)).train()
        ids = torch.randint(0, shape.vocab, (BATCH, SEQ))
    named = list(model.named_parameters())
    buffers = list(model.named_buffers())   # inputs, not closed-over fakes
    names = [n for n, _ in named] + [n for n, _ in buffers]

    def fn(*a):
        out = torch.func.functional_call(model, dict(zip(names, a[:-1])), (),
                                         {"input_ids": a[-1], "labels": a[-1]})
        return out.loss

    piece = pieces.Piece("whole", fn, names[:len(named)], [p for _, p in named],
                         [b for _, b in buffers] + [ids], ["buffer"] * len(buffers) + ["ids"],
                         ["loss"])
    from unittest import mock

    from transformers import masking_utils

    # the whole model looks for packed sequences in its position ids (data-dependent): none
    with trace.as_dynamo_sees_it(), mock.patch.object(masking_utils, "find_packed_sequence_indices",
                                                      lambda position_ids: None):
        return trace.trace_piece(piece, ps.mode), sum(p.numel() for _, p in named)


def test_parameters_are_the_models(traced, whole):
    shape, ps, graphs = traced
    m = compose.compose(graphs, shape.layers, _flops_times(graphs), name="t", batch=BATCH,
                        seq=SEQ, dtype=torch.float32)
    _, numel = whole
    assert m.numel == numel == sum(pieces.param_numels(ps).values())
    assert [p.name for p in m.params][:3] == ["model.embed_tokens.weight",
                                              "model.layers.0.self_attn.q_proj.weight",
                                              "model.layers.0.self_attn.k_proj.weight"]
    # every parameter is read in the forward; every one but the embedding in the backward
    # (its gradient needs only the token ids); every one has one gradient
    assert {u.pid for u in m.fw.uses} == {p.pid for p in m.params}
    assert {u.pid for u in m.bw.uses} == {p.pid for p in m.params} - {0}
    assert sorted(g.pid for g in m.bw.grads) == [p.pid for p in m.params]
    assert all(u.first <= u.last for u in m.fw.uses + m.bw.uses)


def test_flops_match_the_whole_model(traced, whole):
    shape, _, graphs = traced
    m = compose.compose(graphs, shape.layers, _flops_times(graphs), name="t", batch=BATCH,
                        seq=SEQ, dtype=torch.float32)
    pg, _ = whole
    fw = roofline.total_model_flops(pg.fw)
    bw = roofline.total_model_flops(pg.bw)
    assert sum(n.flops for n in m.fw.nodes) == pytest.approx(fw, rel=1e-9)
    assert sum(n.flops for n in m.bw.nodes) == pytest.approx(bw, rel=1e-9)
    assert fw > 0 and bw == pytest.approx(2 * fw, rel=0.05)


def test_saved_activations_match_the_whole_model(traced, whole):
    """What the composed forward leaves alive for the backward is what the whole model's
    forward saves (its outputs but the loss), up to what the partitioner chose differently
    at the pieces' seams."""
    shape, _, graphs = traced
    m = compose.compose(graphs, shape.layers, _flops_times(graphs), name="t", batch=BATCH,
                        seq=SEQ, dtype=torch.float32)
    pg, _ = whole
    saved = [v for v in pg.saved() if v is not None]
    params = {n.name for n in list(pg.fw.graph.nodes)[:len(pg.piece.params)]}
    from deepcompile.compiler.graph import is_alias_of_input

    def root(n):
        while n.op == "call_function" and is_alias_of_input(n):
            n = n.args[0]
        return n

    roots = {root(v) for v in saved if root(v).name not in params and root(v).op != "placeholder"}
    whole_bytes = sum(roofline.nbytes(r.meta["val"]) for r in roots)
    composed = m.fw.nodes[-1].live
    # measured: 528,132 vs 530,180 bytes (the whole model also keeps its rotary tables)
    assert composed == pytest.approx(whole_bytes, rel=0.02)


def test_activation_checkpointing_keeps_only_layer_inputs_and_recomputes(traced):
    shape, _, graphs = traced
    times = _flops_times(graphs)
    plain = compose.compose(graphs, shape.layers, times, name="t", batch=BATCH, seq=SEQ,
                            dtype=torch.float32)
    ac = compose.compose(graphs, shape.layers, times, name="t", batch=BATCH, seq=SEQ,
                         dtype=torch.float32, ac=True)
    layer_fw = sum(1 for n in graphs["layer"].fw.graph.nodes if n.op == "call_function")
    assert len(ac.fw.nodes) == len(plain.fw.nodes)
    assert len(ac.bw.nodes) == len(plain.bw.nodes) + shape.layers * layer_fw
    hidden = BATCH * SEQ * shape.hidden * 4
    # after the last layer's forward: each checkpointed layer's input and the last output
    assert _live_after_layers(ac, shape) == (shape.layers + 1) * hidden
    assert _live_after_layers(plain, shape) > 3 * _live_after_layers(ac, shape)
    # recomputation is not useful work, but it takes time
    assert ac.model_flops() == pytest.approx(plain.model_flops(), rel=1e-9)
    assert ac.bw.compute_s() > plain.bw.compute_s()


def _live_after_layers(m, shape):
    last_layer = [i for i, n in enumerate(m.fw.nodes) if n.block == shape.layers]
    return m.fw.nodes[last_layer[-1]].live


def test_layers_repeat_and_blocks_are_tagged(traced):
    shape, _, graphs = traced
    m = compose.compose(graphs, shape.layers, _flops_times(graphs), name="t", batch=BATCH,
                        seq=SEQ, dtype=torch.float32)
    blocks = [n.block for n in m.fw.nodes]
    assert blocks == sorted(blocks) and set(blocks) == set(range(shape.layers + 2))
    per_block = [blocks.count(b) for b in range(1, shape.layers + 1)]
    assert len(set(per_block)) == 1
    bw_blocks = [n.block for n in m.bw.nodes]
    assert bw_blocks == sorted(bw_blocks, reverse=True)


def test_roofline_counts():
    ps = pieces.build(shapes.load("llama-3-8b"), batch=1, seq=512, fake=True)
    g = trace.trace_all(ps)
    mm = [n for n in g["layer"].fw.graph.nodes if roofline.kind_of(n) == "matmul"]
    attn = [n for n in g["layer"].fw.graph.nodes if roofline.kind_of(n) == "attention"]
    assert len(mm) == 7 and len(attn) == 1
    # q_proj: [512, 4096] x [4096, 4096]
    assert roofline.flops(mm[0])[0] == 2 * 512 * 4096 * 4096
    # causal attention: half of 4 * B * H * S^2 * D
    assert roofline.flops(attn[0]) == (2 * 32 * 512 * 512 * 128,) * 2
    gpu = roofline.get_gpu("h100")
    fused = roofline.fused_times(g["layer"].fw, gpu)
    unfused = roofline.unfused_times(g["layer"].fw, gpu)
    assert sum(c.time_s for c in fused.values()) < sum(c.time_s for c in unfused.values())
    assert sum(c.kernels for c in fused.values()) < sum(c.kernels for c in unfused.values())
    for n in mm:   # GEMMs are the same kernels either way
        assert fused[n.name].time_s == unfused[n.name].time_s
    with pytest.raises(ValueError, match="unknown --gpu"):
        roofline.get_gpu("tpu")


def test_config_json_shapes(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text('{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, '
                   '"num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, '
                   '"vocab_size": 256, "torch_dtype": "bfloat16"}')
    s = shapes.load(str(cfg))
    assert (s.arch, s.layers, s.hidden, s.vocab) == ("llama", 3, 64, 256)
    bad = tmp_path / "bad.json"
    bad.write_text('{"hidden_size": 64}')
    with pytest.raises(ValueError, match="lacks model_type"):
        shapes.load(str(bad))
    with pytest.raises(ValueError, match="neither a built-in shape"):
        shapes.load("no-such-model")


def test_profiled_pieces_keep_the_preemptions_a_run_has(monkeypatch):
    """planner/measure.py: per node the median over the repeats (the graph's shape), scaled so
    the nodes sum to the mean run (its level: a step's wall time is many runs'). A median per
    node drops the preemptions the runs keep: with more ranks than cores runs are interrupted
    (here: once in `a`, once in `b`) while each node's median is the quiet time."""
    from types import SimpleNamespace

    import deepcompile.compiler.profiler as profiler
    from deepcompile.tools.plan.measure import profile_pieces

    # (a, b) per run: the warm-up, then the 3 timed repeats
    fw_runs = iter([(9.0, 9.0), (5.0, 1.0), (1.0, 5.0), (1.0, 1.0)])

    def fake_run(graph, args, **kw):
        times = next(fw_runs) if graph == "fw" else (2.0,)
        names = "ab" if graph == "fw" else "c"
        prof = SimpleNamespace(nodes=[SimpleNamespace(name=n, time_s=t)
                                      for n, t in zip(names, times)])
        return [torch.ones(1)], prof

    monkeypatch.setattr(profiler, "profile_run", fake_run)
    pg = SimpleNamespace(piece=SimpleNamespace(params=[], inputs=[]), fw="fw", bw="bw",
                         n_outputs=1, tangent_of=[0])
    got = profile_pieces({"layer": pg}, repeats=3)
    # medians 1 + 1; runs 6, 6, 2: mean 14/3
    assert got["layer.fw"] == pytest.approx({"a": 7 / 3, "b": 7 / 3}, rel=1e-12)
    assert got["layer.bw"] == {"c": 2.0}             # no preemption: as measured


def test_the_pieces_level_is_a_window_of_runs_back_to_back(monkeypatch):
    """[Note: measuring on the CPU] (planner/measure.py): each graph's level is the mean of its
    runs over a window of the pieces' graphs run back to back (`window_runs`), and the nodes'
    medians are scaled to it. With more ranks than cores a rank runs for a turn and then waits
    for one: imitated by a forward that takes 1 ms and every fourth call 9 ms. The window's mean
    keeps the waits (3 ms a call); the profiler's few runs (the level until stop 39) saw either
    none of them or all, depending on where the turns fell."""
    import time
    from types import SimpleNamespace

    import deepcompile.compiler.profiler as profiler
    from deepcompile.tools.plan.measure import profile_pieces, window_runs

    calls = [0]

    def fw(*args):
        calls[0] += 1
        time.sleep(0.009 if calls[0] % 4 == 0 else 0.001)
        return (torch.ones(1), torch.ones(1))

    def bw(*args):
        return (torch.ones(1),)

    pg = SimpleNamespace(piece=SimpleNamespace(params=[], inputs=[]), fw=fw, bw=bw,
                         n_outputs=1, tangent_of=[0])
    level = window_runs({"layer": pg}, window_s=0.3)
    assert level["layer.fw"] == pytest.approx(0.003, rel=0.25)
    assert level["layer.bw"] < 0.0005

    def fake_run(graph, args, **kw):   # the profiler: nodes a and b, 1 and 3 ms each run
        names, times = ("ab", (1e-3, 3e-3)) if graph is fw else ("c", (1e-4,))
        prof = SimpleNamespace(nodes=[SimpleNamespace(name=n, time_s=t)
                                      for n, t in zip(names, times)])
        return [torch.ones(1), torch.ones(1)], prof

    monkeypatch.setattr(profiler, "profile_run", fake_run)
    got = profile_pieces({"layer": pg}, repeats=3, level={"layer.fw": 8e-3, "layer.bw": 1e-4})
    assert got["layer.fw"] == pytest.approx({"a": 2e-3, "b": 6e-3}, rel=1e-12)
    assert got["layer.bw"] == pytest.approx({"c": 1e-4}, rel=1e-12)


def test_the_optimizer_is_timed_as_the_engine_steps_and_counted_once(monkeypatch, group):
    """planner/measure.py: ours' optimizer figure is the engine's flat step over the whole
    model (`time_optimizer(flat=True)`), the peers' torch's per-parameter AdamW, and the
    framework's per-step overhead (a deepcompile run of the one-layer model) leaves the flat
    step out. Made slow (20 ms a call), the flat step shows in the first only; it used to be
    counted in the overhead as well (and ours was timed per parameter)."""
    import time

    from deepcompile.tools.plan import measure
    from deepcompile.runtime.flat import FlatState

    step = FlatState.step

    def slow_step(self, chunks):
        time.sleep(0.02)
        return step(self, chunks)

    monkeypatch.setattr(FlatState, "step", slow_step)
    numels = [1000, 300, 64]
    assert measure.time_optimizer(numels, 1, 3, flat=True) >= 0.02
    assert measure.time_optimizer(numels, 1, 3) < 0.02
    ps = pieces.build(_shape(1), batch=BATCH, seq=SEQ, dtype=torch.float32, fake=False, seed=0)
    fo = measure.framework_overhead(ps.model, ps.embed.inputs[0], repeats=3)
    assert fo.step_s < 0.01
    assert fo.missed_s == 0.0   # not asked for (no pieces' time given)


def test_what_the_pieces_miss_is_measured_on_the_one_layer_model(group):
    """[Note: what the pieces miss] (planner/measure.py): at world size 1, `framework_overhead`
    also gives what the one-layer model's graphs take beyond its composed pieces per
    micro-step. Work the pieces never trace (a forward hook on the rotary embedding: the
    pieces compute the rotary tables outside their traces, like the model's prelude) shows
    there, by about its own time; without it the figure is far smaller."""
    import time

    from deepcompile.tools.plan import measure

    def one_layer():
        ps = pieces.build(_shape(1), batch=BATCH, seq=SEQ, dtype=torch.float32, fake=False,
                          seed=0)
        return ps, measure.pieces_once(trace.trace_all(ps))

    w = torch.randn(192, 192)

    def heavy(mod, args, out):   # traced into the model's forward graph by Dynamo
        extra = torch.mm(w, w)
        for _ in range(15):
            extra = torch.mm(extra, w).tanh()
        return out[0] + 0.0 * extra.sum(), out[1]

    t0 = time.perf_counter()
    for _ in range(5):
        heavy(None, None, (torch.zeros(1), torch.zeros(1)))
    cost = (time.perf_counter() - t0) / 5

    ps, one = one_layer()
    plain = measure.framework_overhead(ps.model, ps.embed.inputs[0], 5, pieces=one).missed_s
    ps, one = one_layer()
    ps.model.model.rotary_emb.register_forward_hook(heavy)
    hooked = measure.framework_overhead(ps.model, ps.embed.inputs[0], 5, pieces=one).missed_s
    assert hooked - plain > 0.5 * cost, (plain, hooked, cost)
    assert plain < cost, (plain, cost)


def test_the_graphs_runs_are_read_past_their_recent_window(group):
    """`framework_overhead` reads each step's graph runs off the graphs' recent run times (a
    window of 64): far more steps than that (repeats 40: 160 steps) still read every step's runs.
    Until stop 38 it counted from the window's length before the step, which stops growing
    once it is full: the runs read 0, and the framework's time was the whole micro-step."""
    from deepcompile.tools.plan import measure

    ps = pieces.build(_shape(1), batch=BATCH, seq=SEQ, dtype=torch.float32, fake=False, seed=0)
    few = measure.framework_overhead(ps.model, ps.embed.inputs[0], repeats=3)
    ps = pieces.build(_shape(1), batch=BATCH, seq=SEQ, dtype=torch.float32, fake=False, seed=0)
    many = measure.framework_overhead(ps.model, ps.embed.inputs[0], repeats=40)
    assert few.runs_s > 0 and many.runs_s > 0.5 * few.runs_s, (few, many)
    # the bug put the graphs' runs into the framework's time: far above noise in the mean
    assert many.micro_s < few.micro_s + 0.5 * few.runs_s, (few, many)
    assert many.comm == {}   # one rank: nothing communicated


def test_the_steps_time_outside_the_optimizer_keeps_its_stalls(monkeypatch, group):
    """[Note: gloo's stalls] (planner/measure.py): the engine's per-step time outside its
    optimizer holds the step's gloo all-reduces, which stall for a scheduler tick in some
    calls. Made to stall 40 ms in one step of four, the figure is the mean (~10 ms); the
    median of the steps, as before, said ~0."""
    import time

    from deepcompile.compiler.pipeline import Pipeline
    from deepcompile.tools.plan import measure

    end_step = Pipeline.end_step
    calls = [0]

    def stalling(self, *a, **k):
        calls[0] += 1
        if calls[0] % 4 == 0:
            time.sleep(0.04)
        return end_step(self, *a, **k)

    monkeypatch.setattr(Pipeline, "end_step", stalling)
    ps = pieces.build(_shape(1), batch=BATCH, seq=SEQ, dtype=torch.float32, fake=False, seed=0)
    per_step = measure.framework_overhead(ps.model, ps.embed.inputs[0], repeats=3).step_s
    assert 0.007 < per_step < 0.02, per_step


def test_the_asynchronous_collectives_are_scaled_to_a_steps(monkeypatch):
    """[Note: the asynchronous collectives checked in a step] (planner/plan.py): the
    asynchronous kinds' sweep is scaled so that the planner's schedules of the one-layer model
    (ZeRO-3 with prefetch + bucket_reduce against insertion only) differ by what the runs
    measured; the network found gives that difference back. A difference no factor in
    [1/64, 64] gives is recorded at the range's end, and a host profile without the run is an
    error; the passes plan with the host's own cost model. (A synthetic host: 10 us a node, a
    2-rank network of fixed figures.)"""
    import dataclasses

    from deepcompile.tools.plan import measure, ours, plan, simulate
    from deepcompile.tools.plan.network import Fitted, fit
    from deepcompile.tools.plan.schedule import Setting

    ps = pieces.build(_shape(1), batch=BATCH, seq=SEQ, dtype=torch.float32, fake=False, seed=0)
    graphs = trace.trace_all(ps)
    node_s = {f"{k}.{ph}": {n.name: 1e-5 for n in getattr(pg, ph).graph.nodes
                            if n.op == "call_function"}
              for k, pg in graphs.items() for ph in ("fw", "bw")}
    us = 1e-6
    samples = {"all_gather": [(1 << 10, 100 * us), (1 << 20, 600 * us)],
               "reduce_scatter": [(1 << 10, 150 * us), (1 << 20, 900 * us)],
               "all_gather_async": [(1 << 10, 120 * us), (1 << 20, 700 * us)],
               "reduce_scatter_async": [(1 << 10, 170 * us), (1 << 20, 1000 * us)]}
    net = Fitted(2, {k: fit(v) for k, v in samples.items()}, samples=samples, overlap=0.0)
    args = plan.PlanArgs("tiny", nodes=1, gpus_per_node=2, gpu="cpu", seq=SEQ, batch=BATCH)

    def setting(model, network=net):
        return Setting(model, 2, network, float("inf"), 1, 1e10, 0.0, 0.0,
                       host_is_compute=True, optimizer_s=1e-4, framework_s=1e-4,
                       fusion="cap")

    def host(diff_s):
        return measure.HostProfile(2, node_s, 1e-4, 1e-4, net, [0.0], in_step={
            "z3_runs_s": 0.02, "overlap_runs_s": 0.02 + diff_s})

    def simulated_diff(network):
        one = compose.compose(graphs, 1, host(0.0).times, name="one", batch=BATCH, seq=SEQ,
                              dtype=torch.float32)
        s = dataclasses.replace(setting(one, network), plan_cost=net)

        def step(passes):
            sch = ours.schedule(s, passes, "t", "")
            return simulate.simulate(sch.events, host_is_compute=True).step_s
        return step(ours.ASYNC_PASSES) - step(())

    _, rec = plan.check_async_in_step(host(0.0), graphs, args, setting, log=lambda _: None)
    lo, hi = rec["range_s"]
    assert lo < rec["sweep_s"] < hi
    assert rec["sweep_s"] == pytest.approx(simulated_diff(net))
    for want in (lo + 0.2 * (hi - lo), rec["sweep_s"] * 0.8 + lo * 0.2):
        got, rec = plan.check_async_in_step(host(want), graphs, args, setting,
                                            log=lambda _: None)
        assert rec["bound"] is None and rec["measured_s"] == pytest.approx(want)
        assert simulated_diff(got) == pytest.approx(want, rel=1e-3)
        assert got.samples["all_gather"] == samples["all_gather"]        # sync kinds kept
        assert got.samples["all_gather_async"][1][1] == pytest.approx(700 * us * rec["factor"])
    got, rec = plan.check_async_in_step(host(hi + 1.0), graphs, args, setting,
                                        log=lambda _: None)
    assert rec["bound"] == "high" and rec["factor"] == plan.ASYNC_FACTOR_RANGE[1]
    got, rec = plan.check_async_in_step(host(lo - 1.0), graphs, args, setting,
                                        log=lambda _: None)
    assert rec["bound"] == "low" and rec["factor"] == plan.ASYNC_FACTOR_RANGE[0]
    # the schedules plan with the cost model the measuring ranks calibrated (the host's), not
    # a run's given to the plan (the setting's)
    seen = []
    schedule = ours.schedule

    def spy(s, passes, name, description):
        seen.append(s.plan_cost)
        return schedule(s, passes, name, description)

    own = dataclasses.replace(net, overlap=0.5)
    monkeypatch.setattr(ours, "schedule", spy)
    plan.check_async_in_step(dataclasses.replace(host(0.0), plan_cost=own), graphs, args,
                             setting, log=lambda _: None)
    assert seen and all(c is own for c in seen)
    # the runs compared hold the graphs only: the schedules take one framework time, whatever
    # the one with asynchronous collectives ([Note: the framework's time with async
    # collectives] in planner/measure.py), so the factor does not move with it
    monkeypatch.setattr(ours, "schedule", schedule)
    want = lo + 0.2 * (hi - lo)
    _, plain = plan.check_async_in_step(host(want), graphs, args, setting, log=lambda _: None)

    def slow_framework(model, network=net):
        return dataclasses.replace(setting(model, network), framework_async_s=5e-3)

    _, other = plan.check_async_in_step(host(want), graphs, args, slow_framework,
                                        log=lambda _: None)
    assert other["factor"] == pytest.approx(plain["factor"])
    with pytest.raises(plan.PlanError, match="no one-layer run"):
        plan.check_async_in_step(dataclasses.replace(host(0.0), in_step={"s": 1.0}), graphs,
                                 args, setting)
