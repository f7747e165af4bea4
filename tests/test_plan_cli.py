"""`deepcompile plan` (tools/cli.py, tools/plan/plan.py, tools/plan/report.py) end to end, in
process."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from deepcompile.tools import cli  # noqa: E402

TINY = ["plan", "--model", "tiny-llama", "--gpu", "h100", "--nodes", "1", "--gpus-per-node", "2",
        "--seq", "64", "--batch", "2"]


def _plan(capsys, argv):
    code = cli.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_has_every_system_and_consistent_figures(capsys):
    code, out, _ = _plan(capsys, TINY + ["--json"])
    assert code == 0
    d = json.loads(out)
    names = [r["system"] for r in d["systems"]]
    assert names == ["ours-z3", "ours-z3+prefetch", "ours-z3+overlap", "ours-z3+overlap+unshard",
                     "ours-z3-all", "ours-z3-auto", "fsdp2", "fsdp2-compile", "ds-z3"]
    auto = next(r for r in d["systems"] if r["system"] == "ours-z3-auto")["decisions"]["auto"]
    # the runtime's order, each pass with its verdict on the prediction
    assert auto["chosen"] == ["selective_unshard", "prefetch", "bucket_reduce"]
    assert set(auto["verdicts"]) == set(auto["chosen"])
    assert set(auto["passes"]) <= set(auto["chosen"])
    assert d["tokens_per_step"] == 2 * 64 * 2
    for r in d["systems"]:
        assert r["step_s"] > 0 and r["fits"]
        assert r["tokens_per_s"] == pytest.approx(d["tokens_per_step"] / r["step_s"])
        assert r["tflops_per_gpu"] == pytest.approx(
            d["model_flops_per_step_per_gpu"] / r["step_s"] / 1e12)
        assert r["exposed_comm_s"] <= r["comm_s"] + 1e-12
    assert d["assumed"]["net"]["world"] == 2
    assert d["command"].startswith("deepcompile plan --model tiny-llama")


def test_table_picture_and_gas_sweep(capsys, tmp_path):
    code, out, _ = _plan(capsys, TINY + ["--gas", "1", "2", "--passes", "", "--passes",
                                         "prefetch,bucket_reduce", "--peers", "ds-z3",
                                         "--out", str(tmp_path)])
    assert code == 0
    assert out.count("| ours-z3 |") == 2 and "| ours-z3+prefetch+bucket_reduce |" in out
    assert "| ds-z3 |" in out and "Assumed figures" in out
    for gas in (1, 2):
        d = json.loads((tmp_path / f"plan-gas{gas}.json").read_text())
        assert d["args"]["gas"] == gas
        assert (tmp_path / f"plan-gas{gas}.md").read_text().startswith("command: `deepcompile plan")
        has_mpl = importlib.util.find_spec("matplotlib") is not None
        assert (tmp_path / f"plan-gas{gas}.png").exists() == has_mpl


def test_assumptions_are_applied_and_bad_ones_rejected(capsys):
    code, out, _ = _plan(capsys, TINY + ["--json", "--peers", "", "--passes", "",
                                         "--assume", "net.nic_bw=1e9",
                                         "--assume", "net.launch_host_s=1e-3"])
    assert code == 0
    d = json.loads(out)
    assert d["assumed"]["net"]["nic_bw"] == 1e9 and d["assumed"]["net"]["launch_host_s"] == 1e-3
    code, _, err = _plan(capsys, TINY + ["--assume", "net.warp_speed=9"])
    assert code == 2 and "has no field 'warp_speed'" in err
    code, _, err = _plan(capsys, TINY + ["--assume", "cpu.x=1"])
    assert code == 2 and "keys are gpu.<field>" in err
    code, _, err = _plan(capsys, TINY + ["--passes", "prefetch,warp"])
    assert code == 2 and "unknown pass(es) warp" in err


def test_a_model_that_cannot_fit_says_how_many_gpus_would(capsys):
    argv = ["plan", "--model", "llama-3-70b", "--gpu", "h100", "--nodes", "1",
            "--gpus-per-node", "1", "--seq", "1024", "--activation-checkpointing", "--json",
            "--peers", "", "--passes", ""]
    code, _, err = _plan(capsys, argv)
    assert code == 2
    m = re.search(r"at least (\d+) GPUs, or (\d+) with optimizer state and gradients on the host "
                  r"and the masters' compute-dtype copies on the device", err)
    assert m, err
    need, need_off = int(m.group(1)), int(m.group(2))
    assert need_off < need
    # the count it names is enough (the fit check passes there), one fewer is not
    ok = argv[:]
    ok[ok.index("--gpus-per-node") + 1] = str(need_off)
    assert _plan(capsys, ok)[0] == 0
    short = argv[:]
    short[short.index("--gpus-per-node") + 1] = str(need_off - 1)
    assert _plan(capsys, short)[0] == 2
    # activations alone too large: no number of GPUs helps
    code, _, err = _plan(capsys, ["plan", "--model", "llama-3-70b", "--gpu", "a100-40gb",
                                  "--seq", "65536", "--batch", "8", "--peers", "", "--passes", ""])
    assert code == 2 and "at any number of GPUs" in err


def test_help_imports_nothing_heavy():
    code = ("import sys; from deepcompile.tools import cli; p = cli.build_parser(); "
            "p.parse_args(['plan', '--model', 'x']); "
            "print('deepcompile.tools.plan.plan' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_planning_for_gloo_ranks_needs_a_host_profile_and_says_how_to_measure_one(capsys):
    argv = ["plan", "--model", "tiny-llama", "--gpu", "cpu", "--gpus-per-node", "2", "--seq", "16",
            "--batch", "1", "--json"]
    code, out, err = _plan(capsys, argv)
    assert code == 2 and not out
    assert ("python benchmarks/validation/host_profile.py --model tiny-llama --world 2 "
            "--batch 1 --seq 16 --out host.json") in err and "--host-profile" in err


def test_planning_for_gloo_ranks_reads_a_saved_host_profile(capsys, tmp_path):
    """--gpu cpu --host-profile FILE plans from the profile's figures alone (nothing is
    measured); a profile of another world size, or not a profile, is refused with the command
    that measures the right one."""
    import _host_profile

    profile = _host_profile.synthetic("tiny-llama", 1, batch=1, seq=16)
    path = tmp_path / "host.json"
    path.write_text(json.dumps(profile.to_dict()))
    argv = ["plan", "--model", "tiny-llama", "--gpu", "cpu", "--gpus-per-node", "1", "--seq", "16",
            "--batch", "1", "--peers", "", "--passes", "", "--json", "--host-profile", str(path)]
    code, out, _ = _plan(capsys, argv)
    assert code == 0
    d = json.loads(out)
    host = d["assumed"]["host"]
    assert host["record"] == {"made_up": True} and host["copy_bw"] == 1e10
    (r,) = d["systems"]
    # the step: both layers' graphs, the embedding's and the head's, the framework's time per
    # micro-step and the optimizer, one after the other on one thread; at world size 1 nothing
    # is communicated
    graphs = sum(host["graph_s"][f"{p}.{ph}"] * (2 if p == "layer" else 1)
                 for p in ("embed", "layer", "head") for ph in ("fw", "bw"))
    assert r["step_s"] == pytest.approx(graphs + 5e-4 + 1e-3, rel=0.05)
    assert r["collectives"] == {}
    again = json.loads(_plan(capsys, argv)[1])
    assert {k: v for k, v in again.items() if k != "machine"} == \
        {k: v for k, v in d.items() if k != "machine"}   # the same figures: nothing measured
    other = [a if a != "1" or argv[i - 1] != "--gpus-per-node" else "2"
             for i, a in enumerate(argv)]
    code, _, err = _plan(capsys, other)
    assert code == 2 and "measured for tiny-llama at 1 rank(s)" in err
    assert "host_profile.py --model tiny-llama --world 2 --batch 1 --seq 16" in err
    code, _, err = _plan(capsys, TINY + ["--host-profile", str(path)])
    assert code == 2 and "--host-profile times gloo ranks (--gpu cpu)" in err
    path.write_text("{}")
    code, _, err = _plan(capsys, argv)
    assert code == 2 and "is not a host profile" in err
