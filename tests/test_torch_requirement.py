"""megatron-lowprec refuses a torch older than 2.10 when it is imported, in one line; setup.py's floor
admits NGC's pre-release builds of 2.10 (``2.10.0a0+<commit>``) and nothing older."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from packaging.specifiers import SpecifierSet

import megatron_lowprec
from megatron_lowprec import MINIMUM_TORCH, torch_version_problem

ROOT = Path(__file__).resolve().parents[1]
OLD_NGC_TORCH = "2.8.0a0+5228986c39"
"""torch of NGC's PyTorch 25.06 image, the Dockerfile's former base."""


@pytest.mark.parametrize("version", ["2.10.0", "2.10.0a0+b4e4ee81d3", "2.12.0a0+gitabcdef", "2.13.0+cpu", "3.0.0"])
def test_accepts_torch_2_10_and_later(version):
    assert torch_version_problem(version) is None


@pytest.mark.parametrize("version", ["2.9.1", OLD_NGC_TORCH, "2.4.0+cu121", "1.13.1", "unknown"])
def test_refuses_older_torch_in_one_line(version):
    problem = torch_version_problem(version)
    assert problem is not None and "\n" not in problem
    assert "needs torch >= 2.10" in problem and f"this is torch {version}:" in problem


def test_setup_py_floor_admits_ngc_prereleases_of_the_minimum_and_nothing_older():
    floor = SpecifierSet(re.search(r'"torch(>=[^"]+)"', (ROOT / "setup.py").read_text()).group(1))
    minimum = ".".join(map(str, MINIMUM_TORCH))
    assert floor.contains(f"{minimum}.0a0+b4e4ee81d3") and floor.contains(f"{minimum}.0")
    assert floor.contains(torch.__version__)
    for older in ("2.9.1", "2.9.0a0+145a3a7bda", OLD_NGC_TORCH):
        assert not floor.contains(older, prereleases=True), older


def test_reads_torch_version_from_torch_without_package_metadata(monkeypatch):
    def no_metadata(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", no_metadata)
    assert megatron_lowprec._installed_torch_version() == torch.__version__


def test_the_app_refuses_an_older_torch_before_any_work(tmp_path):
    """An older torch's package metadata first on the path, as in NGC's 25.06 image."""
    metadata = tmp_path / f"torch-{OLD_NGC_TORCH}.dist-info"
    metadata.mkdir()
    (metadata / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {OLD_NGC_TORCH}\n")
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    completed = subprocess.run([sys.executable, "-m", "megatron_lowprec.train", "trainer.max_steps=1"],
                               capture_output=True, text=True, env=environment, cwd=tmp_path, timeout=120)
    assert completed.returncode == 1
    assert completed.stderr.strip().splitlines()[-1] == f"ImportError: {torch_version_problem(OLD_NGC_TORCH)}"
    assert not (tmp_path / "runs").exists()
