"""Exact checks of a ZeRO-3 run (fx compiler, fp32, no pass), on the per-rank results of
`_train.run_training`: its communication counts (record "comm") and what each rank holds
between steps (record "memory"). test_counts.py and test_memory.py run them on the small
models; test_parity.py and test_models.py on the tiny Llama, its tied variant and Mixtral,
whose engines they train anyway.

Communication (engine.comm_stats(), per micro-step):
  * forward: every parameter is all-gathered once per graph that uses it;
  * backward: re-gathered (never saved) where the backward needs the parameter's value;
    a parameter whose gradient computation does not need its value (a bias; an embedding
    table; the first layer's weight when the input does not require grad) is not re-gathered;
  * every gradient is reduce-scattered once per graph that uses its parameter;
  * optimizer step: nothing (the global gradient norm, also clipping's, rides in the inf/NaN
    check's all-reduce: bookkeeping, not counted);
  * full_state_dict: one all_gather per unique parameter.
bytes = full (unsharded, padded to a multiple of the world size) tensor size x element size.
Without a pass the counts are the same in every phase (a profiled step replays nothing).

The expected backward gathers are derived from the models by hand:
  mlp_nobias   fc1 -> GELU -> fc2 -> fc3, input x does not require grad:
               dL/dx1 is not needed, so W1 is not re-gathered; W2 and W3 are (input grads).
  mlp          the same with biases: biases are never re-gathered.
  graph_break  graph 1: block1.0 (input x: not needed), shared (weight needed);
               graph 2: shared (weight needed), block2.0 (weight), block2.2 (weight).
  llama        every Linear weight and every RMSNorm weight is needed for the input gradient
               (RMSNorm: dx depends on w); the embedding table is not (its backward is an
               index-add of the output gradient).
  llama_tied   the tied table is needed by lm_head's input gradient: re-gathered once.

Memory (between steps each rank holds only its 1/N of parameters, gradients and optimizer
state):
  * the module's parameters keep their shapes but their storage is empty (nbytes == 0) after
    initialize, after every micro-step's backward and after every optimizer step;
  * the optimizer's parameters are 1-D fp32 nn.Parameters of ceil(numel / N) elements, one per
    unique parameter (tied weights: one);
  * AdamW's exp_avg / exp_avg_sq hold sum(ceil(numel / N)) elements on each rank;
  * gradients live on the shards only: shard-sized after backward, None (or shard-sized) after
    the step; the module parameters never hold a .grad.
"""

from __future__ import annotations

import math

import _models
from _train import COMM_KINDS, gas_of

F32 = 4


# ----------------------------------------------------------------------------- communication
def comm_expected(model_name: str):
    """(unique parameters by fqn, forward gathers, backward gathers, reduce-scatters), the
    last three as lists of parameter fqns."""
    model = _models.build_model(model_name)
    params = dict(model.named_parameters())   # unique parameters
    names = list(params)
    if model_name in ("mlp", "mlp_nobias"):
        fwd = names
        bwd = ["fc2.weight", "fc3.weight"]
        rs = names
    elif model_name == "graph_break":
        g1 = ["block1.0.weight", "block1.0.bias", "shared.weight", "shared.bias"]
        g2 = ["shared.weight", "shared.bias", "block2.0.weight", "block2.0.bias",
              "block2.2.weight", "block2.2.bias"]
        fwd = g1 + g2
        bwd = ["shared.weight", "shared.weight", "block2.0.weight", "block2.2.weight"]
        rs = g1 + g2
    elif model_name in ("llama", "llama_tied"):
        fwd = names
        bwd = [n for n in names if n != "model.embed_tokens.weight"]
        if model_name == "llama_tied":
            bwd.append("model.embed_tokens.weight")  # tied to lm_head.weight
        rs = names
    else:  # pragma: no cover
        raise KeyError(model_name)
    for n in fwd + bwd + rs:
        assert n in params, n
    return params, fwd, bwd, rs


def _count(params, names, world):
    return (len(names), sum(math.ceil(params[n].numel() / world) * world * F32 for n in names))


def check_nothing_counted_at_initialize(results: list[dict]) -> None:
    for r in results:
        assert all(r["comm_init"][k] == (0, 0) for k in COMM_KINDS), r["comm_init"]


def check_micro_step_counts(sc: dict, results: list[dict]) -> None:
    params, fwd, bwd, rs = comm_expected(sc["model"])
    world = len(results)
    n_micro = sc["steps"] * gas_of(sc)
    for r in results:
        assert len(r["comm_fwd"]) == len(r["comm_bwd"]) == n_micro
        for i, (f, b) in enumerate(zip(r["comm_fwd"], r["comm_bwd"])):
            where = f"{sc['id']} rank {r['rank']} micro-step {i}"
            assert f["all_gather"] == _count(params, fwd, world), (where, "forward all_gather", f)
            assert f["reduce_scatter"] == (0, 0), (where, f)
            assert b["all_gather"] == _count(params, bwd, world), (where, "backward all_gather", b)
            assert b["reduce_scatter"] == _count(params, rs, world), \
                (where, "backward reduce_scatter", b)
            assert f["all_reduce"] == b["all_reduce"] == (0, 0), (where, f, b)


def check_step_counts(sc: dict, results: list[dict]) -> None:
    clip = sc["config"]["max_grad_norm"] is not None
    for r in results:
        assert len(r["comm_step"]) == sc["steps"]
        for s in r["comm_step"]:
            assert s["all_gather"] == s["reduce_scatter"] == (0, 0), s
            # the global norm rides in the inf/NaN check's reduction (uncounted), clip or not
            assert s["all_reduce"] == (0, 0), (clip, s)


def check_full_state_dict_counts(sc: dict, results: list[dict]) -> None:
    params, *_ = comm_expected(sc["model"])
    for r in results:
        assert r["comm_full_state_dict"] == {
            "all_gather": _count(params, list(params), len(results)),
            "reduce_scatter": (0, 0), "all_reduce": (0, 0)}


def check_comm_counts(sc: dict, results: list[dict]) -> None:
    """Every count above: at initialize, per micro-step, per optimizer step, full_state_dict."""
    check_nothing_counted_at_initialize(results)
    check_micro_step_counts(sc, results)
    check_step_counts(sc, results)
    check_full_state_dict_counts(sc, results)


# ------------------------------------------------------------------------------------ memory
def _expected_shards(model_name: str, world: int) -> list[int]:
    model = _models.build_model(model_name)
    return [math.ceil(p.numel() / world) for p in model.parameters()]  # unique parameters


def check_module_parameters_hold_no_storage(sc: dict, results: list[dict]) -> None:
    for r in results:
        snaps = [r["memory_init"]] + r["memory_micro"] + r["memory_step"]
        assert len(r["memory_step"]) == sc["steps"]
        for snap in snaps:
            assert snap["module_shapes"] == list(r["model_shapes"].values())
            assert all(n == 0 for n in snap["module_storage_nbytes"]), snap["module_storage_nbytes"]
            assert all(g is None for g in snap["module_grads"]), snap["module_grads"]


def check_optimizer_holds_flat_fp32_shards(sc: dict, results: list[dict]) -> None:
    expected = _expected_shards(sc["model"], len(results))
    for r in results:
        for snap in [r["memory_init"]] + r["memory_step"]:
            assert sorted(snap["opt_param_numel"]) == sorted(expected)
            assert snap["opt_param_numel"] == expected  # and in the model's parameter order
            assert set(snap["opt_param_dim"]) == {1}
            assert set(snap["opt_param_dtype"]) == {"torch.float32"}
            assert all(snap["opt_param_is_parameter"])


def check_gradients_are_shard_sized(sc: dict, results: list[dict]) -> None:
    expected = _expected_shards(sc["model"], len(results))
    for r in results:
        assert r["memory_init"]["opt_grads"] == [None] * len(expected)
        for snap in r["memory_micro"]:
            # every parameter of these models is used every micro-step (Mixtral: the global
            # batch hits every expert; with a rank's slice an expert may get no token, but its
            # shard still receives the (zero) reduced gradient through the reduce-scatter)
            assert snap["opt_grads"] == expected, snap["opt_grads"]
        for snap in r["memory_step"]:
            assert all(g is None or g == n for g, n in zip(snap["opt_grads"], expected))


def check_adamw_state_is_sharded(sc: dict, results: list[dict]) -> None:
    assert sc["optim"][0] == "adamw", sc["optim"]
    total = sum(_expected_shards(sc["model"], len(results)))
    for r in results:
        assert r["memory_init"]["opt_state_numel"] == {}
        for snap in r["memory_step"]:
            assert snap["opt_state_numel"] == {"exp_avg": total, "exp_avg_sq": total}


def check_memory(sc: dict, results: list[dict]) -> None:
    """Every memory check above (AdamW's state with AdamW only)."""
    check_module_parameters_hold_no_storage(sc, results)
    check_optimizer_holds_flat_fp32_shards(sc, results)
    check_gradients_are_shard_sized(sc, results)
    if sc["optim"][0] == "adamw":
        check_adamw_state_is_sharded(sc, results)
