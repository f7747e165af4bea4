"""`deepcompile bench`: a smoke run of the harness (one tiny workload, one launch, two systems;
in the default run one, ours: `SMOKE_SYSTEMS`) and its pieces without spawning. Asserts on
structure and on figures that do not depend on the machine's load (collectives, loss
difference), never on time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("transformers")

from _train import FULL  # noqa: E402
from deepcompile.tools.bench import output, systems  # noqa: E402
from deepcompile.tools.cli import main  # noqa: E402

# the systems of the smoke launch: ours, a peer (DDP) and one that cannot run here; DDP's launch
# and the figures compared with it (its collectives, its optimizer state against ZeRO-3's) in
# the full suite ([Note: the core matrix] in tests/_train.py)
SMOKE_SYSTEMS = ("ours-z3", "ddp", "ds-deepcompile") if FULL else ("ours-z3", "ds-deepcompile")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("bench")
    rc = main(["bench", "--workloads", "tiny-llama", "--systems", *SMOKE_SYSTEMS,
               "--launches", "1", "--steps", "2", "--warmup", "1",
               "--compiler", "fx", "--out", str(out)])
    assert rc == 0
    return json.loads((out / "bench.json").read_text()), out


def _entry(result: dict, system: str) -> dict:
    [e] = [e for e in result["results"] if e["system"] == system]
    return e


def test_smoke_json_structure(smoke):
    result, _ = smoke
    meta = result["meta"]
    for key in ("date", "hardware", "versions", "command", "args", "load_before", "load_after",
                "workloads", "inductor_cache"):
        assert key in meta, key
    assert meta["hardware"]["cpus"] == os.cpu_count()
    assert meta["versions"]["torch"]
    assert meta["command"].startswith("deepcompile bench --workloads tiny-llama")
    assert [e["system"] for e in result["results"]] == list(SMOKE_SYSTEMS)
    for name in [n for n in ("ours-z3", "ddp") if n in SMOKE_SYSTEMS]:
        e = _entry(result, name)
        assert e["status"] == "ok", e.get("reason")
        assert len(e["launches"]) == 1 and e["launches"][0]["ok"]
        assert e["launches"][0]["cpu_sched"] == ("batch" if hasattr(os, "SCHED_BATCH")
                                                 else "normal")
        # the bench's own work per step (token ids), timed apart: plan_validate adds it
        assert 0 < e["launches"][0]["batch_s_median"] < e["step_ms"]["median"] / 1e3
        assert len(e["launches"][0]["step_s"]) == 2
        s = e["step_ms"]
        assert s["min"] <= s["median"] <= s["max"]
        assert e["tokens_per_s"] > 0
        assert e["memory"]["steady_peak_rss"] > e["memory"]["base_rss"] > 0
        assert e["memory"]["step_alloc_peak"] > 0
        assert e["info"]["num_params"] > 0
        # where the timed steps' core time went: cpu_sched.py's [Note: where a step's core
        # time goes]
        t0, t1 = e["launches"][0]["timed_window"]   # [Note: the machine's speed]
        assert t0 < t1 and t1 - t0 < e["launches"][0]["wall_s"]
        ct = e["launches"][0]["core_time"]
        if sys.platform.startswith("linux"):
            assert ct["ranks_run_s"] > 0 and ct["ranks_wait_s"] >= 0
            assert ct["ranks_run_s"] == pytest.approx(
                sum(t["run_s"] for t in ct["threads"].values()))
            if name == "ours-z3":  # a rank's main thread and gloo's
                assert any("gloo" in t for t in ct["threads"]), ct["threads"]
            shares = [ct["machine"][f"{k}_share"] for k in ("busy", "idle", "steal")]
            assert sum(shares) == pytest.approx(1.0) and all(0 <= x <= 1 for x in shares)
    if "ddp" in SMOKE_SYSTEMS:   # one rank's optimizer state: ZeRO-3's half of DDP's at 2
        # ranks (up to padding)
        ours, ddp = (_entry(result, n)["memory"]["optimizer_state"] for n in ("ours-z3", "ddp"))
        assert 0.45 * ddp < ours < 0.55 * ddp
    dc = _entry(result, "ds-deepcompile")
    assert dc["status"] == "unavailable" and "CUDA" in dc["reason"] and not dc["launches"]


def test_smoke_collectives_and_losses(smoke):
    result, _ = smoke
    ours = _entry(result, "ours-z3")
    # ZeRO-3: gathers parameters, reduce-scatters gradients (an all-reduce on gloo)
    assert ours["collectives"]["requested"]["all_gather"] > 0
    assert ours["collectives"]["requested"]["reduce_scatter"] > 0
    assert ours["collectives"]["transport"]["all_gather"]["bytes"] > 0
    # the profiler's count agrees with the engine's own counters over the same step
    own = ours["collectives"]["own_counters"]
    assert own["all_gather"]["count"] == ours["collectives"]["requested"]["all_gather"]
    assert own["reduce_scatter"]["count"] == ours["collectives"]["requested"]["reduce_scatter"]
    assert own["all_gather"]["bytes"] == ours["collectives"]["transport"]["all_gather"]["bytes"]
    compared = [ours]
    if "ddp" in SMOKE_SYSTEMS:   # DDP: the gradients in all-reduce buckets, at least their size
        ddp = _entry(result, "ddp")
        numel = ddp["info"]["num_params"]
        assert ddp["collectives"]["transport"]["all_reduce"]["bytes"] >= 4 * numel
        assert "all_gather" not in ddp["collectives"]["transport"]
        compared.append(ddp)
    for e in compared:
        assert e["collectives"]["count"] > 0
        assert e["collectives"]["same_in_every_launch"]
        assert e["loss"]["max_abs_diff"] < 1e-5, e["loss"]


def test_the_plan_predicts_the_collectives_the_bench_counts(smoke):
    """`deepcompile plan` predicts ours-z3's collectives per step, count and bytes per kind,
    from the model alone: the smoke launch's counted step (tiny-llama, 2 gloo ranks) has exactly
    those. What insertion only issues does not depend on time, so a made-up host profile of
    the same shapes serves."""
    import _host_profile
    from deepcompile.tools import workloads
    from deepcompile.tools.plan import plan as P

    result, _ = smoke
    ours = _entry(result, "ours-z3")
    w, world = workloads.get("tiny-llama"), ours["world"]
    pa = P.PlanArgs(model=w.model, nodes=1, gpus_per_node=world, gpu="cpu", seq=w.seq,
                    batch=w.batch, gas=w.gas, passes=[()], peers=())
    [r] = P.make_plan(pa, host=_host_profile.synthetic(w.model, world, w.batch, w.seq)).results
    predicted = r.schedule.collectives
    counted = ours["collectives"]["own_counters"]
    assert predicted == {k: v for k, v in counted.items() if v["count"]}
    assert predicted["all_gather"]["count"] > 0 and predicted["reduce_scatter"]["count"] > 0


def test_smoke_markdown_and_chart(smoke):
    result, out = smoke
    md = (out / "bench.md").read_text()
    assert md.startswith("# deepcompile bench")
    assert "- command: `deepcompile bench --workloads tiny-llama" in md
    assert "torch " + result["meta"]["versions"]["torch"] in md
    rows = [line for line in md.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| system | step ms")
    assert any(r.startswith("| ours-z3 | ") for r in rows)
    assert any(r.startswith("| ddp | ") for r in rows) == ("ddp" in SMOKE_SYSTEMS)
    assert any(r.startswith("| ds-deepcompile | not available") for r in rows)
    assert "needs CUDA" in md
    try:
        import matplotlib  # noqa: F401
        assert (out / "bench.png").stat().st_size > 0
    except ImportError:
        assert not (out / "bench.png").exists()


def test_results_are_never_overwritten(smoke, tmp_path):
    result, _ = smoke
    first = output.write(result, tmp_path, log=lambda _: None)
    second = output.write(result, tmp_path, log=lambda _: None)
    assert first["json"].name == "bench.json" and second["json"].name == "bench-2.json"
    assert first["md"].read_text() == second["md"].read_text()


# ---- no spawning ------------------------------------------------------------------------------

def test_ours_systems_follow_the_build():
    """A pass that is not registered, or a stage Config rejects, makes a system unavailable, not
    an error; `ours-z3-all` is every registered pass, in the canonical order."""
    from deepcompile.passes import known_passes

    for name, s in systems.SYSTEMS.items():
        reason = systems.unavailable(s, "cpu", "fx")
        if s.kind != "ours":
            continue
        passes = systems.resolved_passes(s)
        if passes == "auto":   # chosen by the pipeline from what is registered: always runs
            assert reason is None, (name, reason)
            continue
        if all(p in known_passes() for p in passes) and s.stage == 3:
            assert reason is None, (name, reason)
        if any(p not in known_passes() for p in passes):
            assert reason.startswith("not available in this build"), name
    all_passes = systems.resolved_passes(systems.get("ours-z3-all"))
    assert set(all_passes) == set(known_passes())
    order = [p for p in systems.CANONICAL_PASS_ORDER if p in all_passes]
    assert list(all_passes[:len(order)]) == order
    bogus = systems.System("x", "ours", "test", passes=("no_such_pass",))
    assert "no_such_pass" in systems.unavailable(bogus, "cpu", "fx")


def test_ours_systems_keep_what_their_stage_promises():
    """A system's passes replace Config's per-stage default: ZeRO-1/2 systems must still name
    bucket_reduce (bucketed, overlapped reduce-scatters are part of those stages), or the
    bench measures them without it (it once did: one reduce-scatter per parameter)."""
    from deepcompile import Config

    for name, s in systems.SYSTEMS.items():
        if s.kind == "ours" and s.stage < 3:
            cfg = systems.ours_config(s, compiler="fx", gas=1, dtype="float32")
            passes = Config(**cfg).passes
            assert passes == "auto" or "bucket_reduce" in passes, (name, cfg["passes"])


def test_deepspeed_systems_say_how_to_install(monkeypatch):
    monkeypatch.setattr(systems, "deepspeed_version", lambda: None)
    reason = systems.unavailable(systems.get("ds-z3"), "cpu", "fx")
    assert reason.startswith("not installed") and "'.[bench]'" in reason
    assert "CUDA" in systems.unavailable(systems.get("ds-deepcompile"), "cpu", "fx")


def test_library_does_not_import_peers():
    code = ("import sys, deepcompile, deepcompile.tools.cli\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('deepspeed', 'matplotlib')"
            " or m.startswith('deepcompile.tools.bench')]\n"
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT / "src")), timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


_SCHED_PROBE = """
import os, threading
from deepcompile.tools import cpu_sched
policy = cpu_sched.apply()
started = []
t = threading.Thread(target=lambda: started.append(os.sched_getscheduler(0)))
t.start(); t.join()
print(policy, os.sched_getscheduler(0) == os.SCHED_BATCH, started[0] == os.SCHED_BATCH)
"""


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling policies")
def test_cpu_ranks_run_batch_and_the_threads_they_start_inherit_it():
    # [Note: gloo's spinning loop]: gloo's threads start after the rank's cpu_sched.apply(),
    # so they must inherit SCHED_BATCH; DEEPCOMPILE_CPU_SCHED=normal leaves Linux's default
    def probe(value):
        env = dict(os.environ)
        env.pop("DEEPCOMPILE_CPU_SCHED", None)
        if value is not None:
            env["DEEPCOMPILE_CPU_SCHED"] = value
        return subprocess.run([sys.executable, "-c", _SCHED_PROBE], env=env,
                              capture_output=True, text=True)

    assert probe(None).stdout.split() == ["batch", "True", "True"]
    assert probe("normal").stdout.split() == ["normal", "False", "False"]
    bad = probe("fifo")
    assert bad.returncode != 0 and "DEEPCOMPILE_CPU_SCHED='fifo'" in bad.stderr


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="Linux /proc")
def test_core_time_counts_each_threads_cpu_and_the_ranks_sum():
    # [Note: where a step's core time goes]: a thread that spins 0.2 s shows that run time,
    # one that sleeps as long shows almost none; a launch's record sums its ranks
    import threading
    import time

    from deepcompile.tools import cpu_sched
    from deepcompile.tools.bench.run import _core_time

    done, leave = threading.Barrier(3), threading.Event()

    def spin():   # 0.2 s of this thread's own CPU time, however busy the machine is
        t = time.thread_time()
        while time.thread_time() - t < 0.2:
            pass
        done.wait()
        leave.wait()

    def sleep():
        time.sleep(0.2)
        done.wait()
        leave.wait()

    before, m0, p0 = cpu_sched.threads(), cpu_sched.machine(), cpu_sched.process()
    threads = [threading.Thread(target=spin), threading.Thread(target=sleep)]
    for t in threads:
        t.start()
    done.wait()  # both have done their part and still live (an ended thread leaves /proc)
    after, m1 = cpu_sched.threads(), cpu_sched.machine()
    fresh = bytearray(64 << 20)  # 64 MiB of fresh pages, touched: 1 page in 4096 bytes
    fresh[::4096] = b"x" * len(range(0, len(fresh), 4096))
    proc = cpu_sched.between(p0, cpu_sched.process())
    del fresh
    leave.set()
    for t in threads:
        t.join()
    spun, slept = (after[str(t.native_id)][1] / 1e9 for t in threads)
    assert 0.15 < spun < 0.5 and slept < 0.05
    between = cpu_sched.threads_between(before, after)
    assert sum(run for run, _ in between.values()) >= spun
    machine = cpu_sched.between(m0, m1)
    assert set(machine) == {"busy", "idle", "steal"} and machine["busy"] >= 0
    assert proc["user"] + proc["sys"] >= 0.1 and proc["minor_faults"] >= 64 * 256 // 2

    rank = {"core_time": {"threads_s": {"main": (0.16, 0.02), "gloo": (0.04, 0.0)},
                          "machine_s": {"busy": 0.3, "idle": 0.1, "steal": 0.0},
                          "process": {"user": 0.18, "sys": 0.02, "minor_faults": 10}}}
    ct = _core_time([rank, rank], [0.1, 0.1])
    assert ct["ranks_run_s"] == pytest.approx(0.2)       # (0.16 + 0.04) x 2 ranks / 2 steps
    assert ct["ranks_wait_s"] == pytest.approx(0.02)
    assert ct["threads"]["main"]["run_s"] == pytest.approx(0.16)
    assert ct["machine"]["idle_share"] == pytest.approx(0.25)
    assert ct["machine"]["busy_s"] == pytest.approx(0.15)
    assert ct["process"] == pytest.approx({"user": 0.18, "sys": 0.02, "minor_faults": 10})
    assert _core_time([rank, {}], [0.1, 0.1]) is None


def test_bench_help_and_list_spawn_nothing(capsys):
    """`--help` through the console entry point; `--list` and an unknown system through
    `cli.main` in this process."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    r = subprocess.run([sys.executable, "-m", "deepcompile", "bench", "--help"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for option in ("--workloads", "--systems", "--launches", "--steps", "--nproc", "--device",
                   "--out", "DS_BUILD_OPS=0"):
        assert option in r.stdout, option
    assert main(["bench", "--list"]) == 0
    listed = capsys.readouterr().out
    for name in list(systems.SYSTEMS) + ["tiny-llama", "llama-1b"]:
        assert name in listed, name
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--systems", "nope"])
    assert "unknown systems nope" in str(exc.value.code)


# ---- GPU mode (skipped without CUDA) ----------------------------------------------------------

@pytest.mark.gpu
def test_gpu_mode_smoke(tmp_path):
    """The GPU paths (NCCL, bf16 for every system, CUDA memory figures) on a tiny bf16 Llama,
    before spending an hour on the 1.1B one: `pytest -m gpu tests/tools/test_bench.py`."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    names = ["ours-z3", "ours-z3+overlap", "fsdp2", "compile-1proc", "ds-z3", "ds-deepcompile"]
    rc = main(["bench", "--device", "cuda", "--workloads", "tiny-llama-bf16", "--systems", *names,
               "--launches", "1", "--steps", "2", "--warmup", "1", "--out", str(tmp_path)])
    assert rc == 0
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["meta"]["hardware"]["gpu"]
    for name in names:
        e = _entry(result, name)
        if e["status"] == "unavailable":  # DeepSpeed not installed
            assert name.startswith("ds-") and "not installed" in e["reason"], e["reason"]
            continue
        assert e["status"] == "ok", (name, e.get("reason"))
        assert e["memory"]["cuda_max_allocated"] > 0
        assert e["loss"]["max_abs_diff"] < 0.1, (name, e["loss"])  # bf16 vs the autocast reference
    assert (tmp_path / "bench.md").read_text().count("peak GPU MiB") == 1


def test_paired_ratios_cancel_what_slows_a_round(tmp_path):
    """benchmarks/paired.py: a load that moves every system of a round alike (here x1 to x3)
    leaves the per-round ratio alone; the slowest rank's step counts; a launch's systems are
    keyed by name. benchmarks/auto_vs_lists.py: the best other list of ours per workload, and
    the verdict from the interval."""
    import random

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import auto_vs_lists
    import paired

    rng = random.Random(1)
    launches = []
    for _ in range(3):
        load = [rng.uniform(1.0, 3.0) for _ in range(20)]
        ranks = [{"a": {"step_s": [0.010 * x for x in load], "plan": None, "warmup_steps": 4},
                  "b": {"step_s": [0.011 * x * (1 + 0.01 * r) for x in load], "plan": None,
                        "warmup_steps": 9}} for r in range(2)]
        launches.append(ranks)
    s = paired.summarize(launches, ["a", "b"])
    a, b = s["rows"]
    assert s["reference"] == "a" and a["ratio_to_a"] == 1.0
    assert b["ratio_to_a"] == pytest.approx(1.1 * 1.01)       # rank 1 is the slower one
    lo, hi = b["interval_90"]
    assert lo == pytest.approx(1.111) and hi == pytest.approx(1.111)
    assert b["warmup_steps"] == [9, 9, 9] and b["built_first"] == 0 and a["built_first"] == 3
    # --pool: the launches of saved runs together, for the systems every run measured (a run
    # with a third system contributes a and b only)
    third = [{**r, "c": r["a"]} for r in launches[0]]
    runs = [{"meta": {}, "launches": launches[:2]}, {"meta": {}, "launches": [third]}]
    pooled = paired.pool(runs, ["a", "b"])
    assert len(pooled) == 3 and all(set(r) == {"a", "b"} for L in pooled for r in L)
    assert paired.summarize(pooled, ["a", "b"])["rows"][1]["ratio_to_a"] == b["ratio_to_a"]
    with pytest.raises(ValueError, match="did not measure c"):
        paired.pool(runs, ["a", "c"])

    def result(system, medians):
        return {"workload": "w", "system": system, "kind": "ours", "status": "ok",
                "launches": [{"ok": True, "step_s_median": m} for m in medians]}

    bench = {"results": [result("ours-z3-auto", [0.100, 0.101, 0.099]),
                         result("ours-z3-all", [0.200, 0.201, 0.199]),
                         result("ours-z3+overlap", [0.050, 0.051, 0.049]),
                         {"workload": "w", "system": "fsdp2", "kind": "fsdp2", "status": "ok",
                          "launches": [{"ok": True, "step_s_median": 0.01}]}]}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench))
    [row] = auto_vs_lists.compare([path])
    assert row["best"] == "ours-z3+overlap" and row["ratio"] == pytest.approx(2.0)
    assert row["verdict"] == "more than 3% slower" and row["interval"][0] > 1.9


# benchmarks/host_step.py and opt_step.py run in the full suite ([Note: the core matrix] in
# tests/_train.py); in the default run their command lines parse
# (test_gpu_acceptance_commands_are_valid), and the steps they time train in the engine layer
# (the host step: tests/engine/test_offload_masters.py; the flat step: test_flat.py)
@pytest.mark.extended
def test_host_step_measures_the_cpu_step_without_cuda(tmp_path):
    """benchmarks/host_step.py (issue 16: measure a host optimizer step against streaming
    before building one) runs its CPU part on a machine without CUDA and writes its JSON;
    a second run does not overwrite the first."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "host_step.py"
    for _ in range(2):
        proc = subprocess.run([sys.executable, str(script), "--params", "300000", "--chunk-mib",
                               "0.5", "--repeats", "1", "--out", str(tmp_path)],
                              capture_output=True, text=True, timeout=300,
                              env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["host_step-1.json", "host_step.json"]
    rec = json.loads((tmp_path / "host_step.json").read_text())
    assert rec["params"] == 300_000 and rec["chunks"] == 3 and rec["cuda"] is None
    assert rec["cpu_step"]["seconds"] > 0 and rec["cpu_step"]["ns_per_param"] > 0


@pytest.mark.extended   # with host_step.py's, above
def test_opt_step_times_each_way_of_stepping(tmp_path):
    """benchmarks/opt_step.py (issue 16 item 4: the flat fused step against torch's
    per-parameter AdamW) steps a workload's parameter shapes every way on the CPU and writes
    its JSON: the flat ways step the engine's chunks (one here), torch's ways every tensor."""
    from deepcompile.tools import workloads

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "opt_step.py"
    proc = subprocess.run([sys.executable, str(script), "--workload", "tiny-llama", "--rounds",
                           "2", "--device", "cpu", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    rec = json.loads((tmp_path / "opt_step.json").read_text())
    model = workloads.build_model(workloads.get("tiny-llama"), "meta")
    assert rec["params"] == workloads.num_params(model)
    assert rec["tensors"] == len(list(model.parameters()))
    ways = rec["ways"]
    assert set(ways) == {"torch", "torch-foreach", "torch-fused", "flat", "flat-step"}
    assert ways["flat"]["tensors"] == ways["flat-step"]["tensors"] == 1
    assert ways["torch"]["tensors"] == rec["tensors"]
    assert ways["flat"]["fused"] and ways["torch-fused"]["fused"] and not ways["torch"]["fused"]
    for r in ways.values():
        assert len(r["times_s"]) == 2 and r["median_s"] > 0


def test_gpu_acceptance_commands_are_valid():
    """benchmarks/gpu_acceptance.sh (the GPU runs the open issues ask for, run when a session
    has a GPU): every command it would run parses with the parser of the script or CLI it
    calls, and names known systems and workloads — a renamed option must not cost a GPU
    session its 30 minutes. `DRY_RUN=1` prints the commands without running anything."""
    import importlib
    import shlex

    from deepcompile.tools import workloads
    from deepcompile.tools.cli import build_parser

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(["bash", "benchmarks/gpu_acceptance.sh", "all"], cwd=root,
                          env={**os.environ, "DRY_RUN": "1"}, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = [shlex.split(ln) for ln in proc.stdout.splitlines() if ln.strip()]
    assert len(lines) >= 10, proc.stdout
    checked = set()
    for argv in lines:
        assert argv[0] == "python3", argv
        if argv[1:3] == ["-m", "pytest"] or argv[1] == ".gpu/profile_step.py":
            continue                        # pytest's own options; a script from ../shared/gpu
        if argv[1:3] == ["-m", "deepcompile"]:
            args = build_parser().parse_args(argv[3:])
            name = argv[3]
        else:
            script = root / argv[1]
            name = script.stem
            assert script.is_file(), argv[1]
            sys.path.insert(0, str(script.parent))
            args = importlib.import_module(name).parser().parse_args(argv[2:])
        for s in getattr(args, "systems", None) or ():
            if name in ("bench", "plan_validate"):
                systems.get(s)              # raises on an unknown system
        for w in getattr(args, "workloads", None) or ():
            workloads.get(w)
        checked.add(name)
    assert checked == {"demo", "bench", "offload_gpu", "host_step", "opt_step",
                       "plan_validate", "attention_path", "activation_budget"}, checked
    # the 2-GPU part of issue 43 (not in `all`): paired runs over NCCL
    proc = subprocess.run(["bash", "benchmarks/gpu_acceptance.sh", "z1"], cwd=root,
                          env={**os.environ, "DRY_RUN": "1"}, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = [shlex.split(ln) for ln in proc.stdout.splitlines() if ln.strip()]
    assert len(lines) == 4 and all(argv[1] == "benchmarks/paired.py" for argv in lines), lines
    sys.path.insert(0, str(root / "benchmarks"))
    paired = importlib.import_module("paired")
    for argv in lines:
        args = paired.parser().parse_args(argv[2:])
        assert args.device == "cuda"
        workloads.get(args.workload)
        for s in args.systems:
            systems.get(s)


# the full suite's, as host_step.py's and opt_step.py's above: in the default run its command
# line parses (test_gpu_acceptance_commands_are_valid); what it records is how Dynamo and
# transformers call SDPA, which deepcompile's graphs take as Dynamo gives them
@pytest.mark.extended
def test_attention_path_reports_the_sdpa_calls_and_ops(tmp_path):
    """benchmarks/attention_path.py (stop 32): tiny-llama on the CPU, compiled without
    Inductor (`aot_eager`: the same Dynamo graph, no C++ build). Eager Llama calls SDPA with
    no mask and `is_causal=True`; the compiled graph's calls are recorded as Dynamo has them
    (an explicit mask on torch 2.11-2.14; as eager once pytorch#176499 is in: transformers'
    masking_utils), a mask never with `is_causal`; each way's attention ops ran once per layer, forward and
    backward."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import attention_path

    rec = attention_path.main(["--workload", "tiny-llama", "--device", "cpu", "--backend",
                               "aot_eager", "--out", str(tmp_path)])
    layers = 2
    assert rec["eager"]["sdpa_calls"] == [{"attn_mask": False, "is_causal": True}] * layers
    compiled = rec["compiled"]["sdpa_calls"]
    assert len(compiled) == layers
    assert all(c["attn_mask"] != c["is_causal"] for c in compiled)
    for way in ("eager", "compiled"):
        ops = rec[way]["ops"]
        fw = [k for k in ops if "attention" in k and "backward" not in k
              and not k.startswith("aten::scaled_dot_product_attention")]
        bw = [k for k in ops if "backward" in k]
        assert fw and bw, ops
        assert all(ops[k]["count"] == layers for k in fw + bw), ops
    assert (tmp_path / "attention_path.json").is_file()
