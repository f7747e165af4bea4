"""Runs a script as `__main__` (`python _exit_probe.py SCRIPT ARGS...`) and, in the last exit
handler before the interpreter finalizes, writes the number of gloo threads still alive in the
process to `$EXIT_PROBE.<rank>` ([Note: engines freed before finalization] in
src/deepcompile/_assemble.py)."""

import atexit
import glob
import os
import runpy
import sys


def _record() -> None:
    names = []
    for path in glob.glob("/proc/self/task/*/comm"):
        try:
            with open(path) as f:
                names.append(f.read().strip())
        except OSError:   # a thread that ended meanwhile
            pass
    alive = sum(n.startswith(("pt_gloo", "gloo_tcp")) for n in names)
    with open(f"{os.environ['EXIT_PROBE']}.{os.environ['RANK']}", "w") as f:
        f.write(str(alive))


atexit.register(_record)   # the first registered: the last to run
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
