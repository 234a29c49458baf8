"""The tests' start-up hook for the processes they launch (``tests/subprocess_site/sitecustomize.py``)."""

import subprocess
import sys


def test_processes_the_tests_launch_compile_one_rank_at_a_time():
    """A launched process finds Inductor's ``compile_fx`` wrapped by the lock (a torch that moved it
    would silently drop the serialization and CI would pay every rank's cold compile)."""
    probe = "import torch._inductor.compile_fx as module; print(module.compile_fx.__code__.co_name)"
    name = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
    assert name == "compile_fx_one_rank_at_a_time"
