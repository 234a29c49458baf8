"""The example of using build_optimizer from a Megatron script runs on CPU and trains."""

from __future__ import annotations

import importlib.util
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "megatron_build_optimizer.py"
STEP_LINE = re.compile(r"step\s+\d+\s+loss ([\d.]+)\s+grad norm [\d.]+\s+EDQ ([-\d.e+]+)\s+imprecision ([\d.]+)%\s+ok=True")


@pytest.mark.skipif(importlib.util.find_spec("megatron.core") is None, reason="megatron-core is not installed")
@pytest.mark.parametrize("option", ["C", "sr"])
def test_example_trains_and_reports_update_quality(option):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    completed = subprocess.run(
        [sys.executable, str(EXAMPLE), "--option", option, "--steps", "20"],
        env={**{key: value for key, value in os.environ.items() if key != "PYTHONWARNINGS"}, "MASTER_PORT": str(port),
             "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    # megatron-core's notices about optional TE/apex fallbacks are filtered once at start-up.
    assert "Warning" not in completed.stderr, completed.stderr[-3000:]
    steps = [STEP_LINE.search(line) for line in completed.stdout.splitlines()]
    losses = [float(match.group(1)) for match in steps if match]
    assert len(losses) == 20
    assert losses[-1] < 0.8 * losses[0]
    assert all(float(match.group(2)) > 0 for match in steps if match)
