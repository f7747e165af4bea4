"""Composing a model's graphs from its pieces (tools/plan/pieces.py, trace.py, compose.py) and
the roofline's counts (tools/plan/roofline.py), against the whole model traced at once."""

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
