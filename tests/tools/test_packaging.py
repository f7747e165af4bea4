"""Packaging, README and CI script stay in sync; the command line answers --help. No spawning."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CI_RUN = ROOT / ".ci" / "run"

DEMO_CMD = ("python3 -m venv .venv && .venv/bin/pip install -c constraints.txt -e '.[demo]' "
            "&& .venv/bin/deepcompile demo")
TEST_CMD = ("python3 -m venv .venv && .venv/bin/pip install -c constraints.txt -e '.[test]' "
            "&& .venv/bin/python -m pytest")


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    return subprocess.run(list(args), cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _readme_commands() -> list[str]:
    """The shell commands of the README's opening: fenced code blocks before the first heading
    after the title."""
    text = README.read_text()
    lines = text.splitlines()
    assert lines[0].startswith("# "), "README must start with a '# title' line"
    opening = []
    for line in lines[1:]:
        if line.startswith("#"):
            break
        opening.append(line)
    blocks = re.findall(r"```(?:sh|bash|shell|console)?\n(.*?)```", "\n".join(opening), re.S)
    return [cmd for b in blocks for cmd in b.strip().splitlines()]


# ---- README -----------------------------------------------------------------------------------

def test_readme_opens_with_the_demo_and_test_commands():
    lines = [line for line in README.read_text().splitlines() if line.strip()]
    assert lines[0].startswith("# ")
    # title, one sentence, then the two commands and nothing between them but fences
    assert not lines[1].startswith("```")
    assert lines[2:8] == ["```sh", DEMO_CMD, "```", "```sh", TEST_CMD, "```"]
    assert _readme_commands() == [DEMO_CMD, TEST_CMD]


def test_readme_mentions_the_demo_and_the_public_api():
    text = README.read_text()
    assert "deepcompile demo" in text
    for name in ("deepcompile.initialize(", "deepcompile.Config(", "engine.backward(loss)",
                 "engine.step()", "engine.full_state_dict()", "engine.comm_stats()",
                 "engine.report()", ".ci/run"):
        assert name in text, name


def test_ci_runs_the_readme_test_command():
    """.ci/run takes the README's test line, swaps .venv for its own venv and runs it: check that
    the line it greps for is the README's command, and that the substitution keeps it runnable."""
    script = CI_RUN.read_text()
    assert script.startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in script
    assert os.access(CI_RUN, os.X_OK), ".ci/run must be executable"
    pattern = re.search(r'grep -m1 -E "([^"]+)" README\.md', script)
    assert pattern, ".ci/run no longer greps README.md for the test command"
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    found = subprocess.run([bash, "-c", f'grep -m1 -E "{pattern.group(1)}" README.md'], cwd=ROOT,
                           capture_output=True, text=True, timeout=30)
    assert found.returncode == 0, "the README test command does not match what .ci/run looks for"
    assert found.stdout.strip() == TEST_CMD
    # the split .ci/run makes: install part / test part
    install, _, test = TEST_CMD.rpartition(" && ")
    assert "-c constraints.txt" in install and "'.[test]'" in install
    assert test.endswith("-m pytest")
    for required in ("VENV=build/ci-venv", "OMP_NUM_THREADS=1", "PYTHONUNBUFFERED=1",
                     'TORCHINDUCTOR_CACHE_DIR="$PWD/build/inductor-cache"', "^nvidia",
                     "grep -i torch", "rc -eq 5"):
        assert required in script, required


def test_ci_script_parses():
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    r = subprocess.run([bash, "-n", str(CI_RUN)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr


# ---- pyproject and constraints --------------------------------------------------------------------

def _pyproject() -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomli = pytest.importorskip("tomli")
        return tomli.loads((ROOT / "pyproject.toml").read_text())
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_pyproject_requires_torch_without_upper_pin():
    project = _pyproject()["project"]
    torch_reqs = [r for r in project["dependencies"] if re.match(r"torch\b", r)]
    assert len(torch_reqs) == 1
    spec = torch_reqs[0].replace(" ", "")
    assert spec == "torch>=2.11", spec
    assert project["scripts"]["deepcompile"] == "deepcompile.tools.cli:main"
    extras = project["optional-dependencies"]
    assert any(r.startswith("transformers") for r in extras["demo"])
    assert any(r.startswith("pytest") for r in extras["test"])
    for reqs in extras.values():  # no extra may pull a different torch
        for r in reqs:
            assert not re.match(r"torch\b", r), r


def test_constraints_pin_cpu_torch_and_transformers():
    pins = [line.split("#")[0].strip() for line in (ROOT / "constraints.txt").read_text().splitlines()]
    pins = [p for p in pins if p]
    assert "torch==2.13.0" in pins
    assert "transformers==5.23.0" in pins


# ---- command line ---------------------------------------------------------------------------------

def test_cli_help():
    r = _run(sys.executable, "-m", "deepcompile", "--help")
    assert r.returncode == 0, r.stderr
    assert "demo" in r.stdout


def test_help_describes_the_stages_and_answers_without_importing_torch():
    """`deepcompile --help` names ZeRO stages 1, 2 and 3 and imports neither torch nor the
    compiler: it takes well under a second of CPU time (the process's own: a busy machine
    stretches the wall time, not the work)."""
    import resource

    code = ("import sys; from deepcompile.tools.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('HEAVY', sorted(m for m in ('torch', 'transformers', 'deepcompile.engine') "
            "if m in sys.modules))")
    r = _run(sys.executable, "-c", code)
    assert r.returncode == 0, r.stderr
    assert "HEAVY []" in r.stdout, r.stdout[-300:]
    for stage in ("1  optimizer state sharded", "2  optimizer state and gradients sharded",
                  "3  parameters, gradients and optimizer state sharded"):
        assert stage in r.stdout, stage
    def cpu() -> float:
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        return ru.ru_utime + ru.ru_stime

    times = []
    for _ in range(3):
        t0 = cpu()
        r = _run(sys.executable, "-m", "deepcompile", "--help")
        times.append(cpu() - t0)
        assert r.returncode == 0, r.stderr
    print(f"\n[cli] deepcompile --help: {min(times) * 1000:.0f} ms of CPU (fewest of 3)")
    assert min(times) < 1.0, times


def test_demo_help_spawns_nothing():
    r = _run(sys.executable, "-m", "deepcompile", "demo", "--help")
    assert r.returncode == 0, r.stderr
    for option in ("--nproc", "--steps", "--compiler", "--grad-accum", "--seed", "inductor"):
        assert option in r.stdout, option
    assert "[demo] " not in r.stdout  # no progress line: nothing ran


def test_console_script_help():
    exe = Path(sys.executable).with_name("deepcompile")
    if not exe.exists():
        pytest.skip("the deepcompile console script is not installed next to this python")
    r = _run(str(exe), "--help")
    assert r.returncode == 0, r.stderr
    assert "demo" in r.stdout


def test_cli_without_command_prints_help_and_fails():
    r = _run(sys.executable, "-m", "deepcompile")
    assert r.returncode == 2
    assert "demo" in r.stderr


def test_cli_rejects_bad_values():
    r = _run(sys.executable, "-m", "deepcompile", "demo", "--steps", "0")
    assert r.returncode == 2
    r = _run(sys.executable, "-m", "deepcompile", "demo", "--compiler", "eager")
    assert r.returncode == 2



def test_demo_without_transformers_says_how_to_install():
    code = ("import sys; sys.modules['transformers'] = None\n"
            "from deepcompile.tools.cli import main\n"
            "sys.exit(main(['demo', '--steps', '1']))")
    r = _run(sys.executable, "-c", code)
    assert r.returncode != 0
    assert "transformers" in r.stderr and "pip install -c constraints.txt -e '.[demo]'" in r.stderr
    assert "[demo] " not in r.stdout  # failed before spawning anything

# ---- demo data (in-process, no spawning) ----------------------------------------------------------

def test_demo_data_is_deterministic_and_sliced_by_rank():
    torch = pytest.importorskip("torch")
    from deepcompile.tools import workloads

    windows = workloads.text_windows(32)
    assert windows.dtype == torch.long and windows.shape[1] == 32
    assert int(windows.max()) < 256
    b0 = workloads.text_batch(windows, 0, 8)
    assert torch.equal(b0, workloads.text_batch(windows, 0, 8))
    assert not torch.equal(b0, workloads.text_batch(windows, 1, 8))
    slices = [workloads.rank_slice(b0, r, 4) for r in range(2)]
    assert torch.equal(torch.cat(slices), b0)
    # wraps around the end of the text
    n = windows.shape[0]
    assert torch.equal(workloads.text_batch(windows, n, 1)[0], windows[0])


# ---- optional dependencies ------------------------------------------------------------------------

_WITHOUT_EXTRAS = """\
import contextlib, importlib, io, json, sys


@contextlib.contextmanager
def hidden(*names):   # the packages not installed: their import fails
    saved = {n: sys.modules.get(n) for n in names}
    sys.modules.update(dict.fromkeys(names))
    try:
        yield
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


out = {}
for module, package in (("deepcompile.integrations.hf", "transformers"),
                        ("deepcompile.integrations.accelerate", "accelerate")):
    with hidden(package):
        try:
            importlib.import_module(module)
            out[module] = None
        except ImportError as e:
            out[module] = str(e)
from deepcompile.tools.cli import main

err = io.StringIO()
with hidden("safetensors", "safetensors.torch"), contextlib.redirect_stderr(err):
    rc = main(["consolidate", "nowhere", "out"])
out["consolidate"] = [rc, err.getvalue()]
print(json.dumps(out))
"""


def test_integrations_without_their_extras_say_what_to_install():
    """Each case in turn in one interpreter, the hidden package restored after it."""
    import json

    r = _run(sys.executable, "-c", _WITHOUT_EXTRAS)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for module in ("deepcompile.integrations.hf", "deepcompile.integrations.accelerate"):
        assert out[module] is not None, f"{module} imported without its extra"
        assert "pip install -c constraints.txt -e '.[hf]'" in out[module], out[module]
    rc, err = out["consolidate"]
    assert rc == 1
    assert "safetensors" in err and "'.[hf]'" in err, err[-500:]
