"""The release metadata a user cites and pins: one version everywhere, the licence, the changelog, the
citation file and the console scripts."""
import re
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

import megatron_lowprec

ROOT = Path(__file__).resolve().parents[1]


def test_setup_reads_the_version_from_the_package():
    built = subprocess.run(
        [sys.executable, "setup.py", "--version"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()[-1]
    assert built == megatron_lowprec.__version__
    assert not re.search(r'version\s*=\s*"\d', (ROOT / "setup.py").read_text(encoding="utf-8"))


def test_the_changelog_and_citation_name_the_package_version():
    version = megatron_lowprec.__version__
    assert re.search(rf"^## \[{re.escape(version)}\] - \d{{4}}-\d{{2}}-\d{{2}}$", (ROOT / "CHANGELOG.md").read_text(encoding="utf-8"), re.M)
    assert re.search(rf"^version: {re.escape(version)}$", (ROOT / "CITATION.cff").read_text(encoding="utf-8"), re.M)


def test_the_licence_is_apache_2():
    assert "Apache License" in (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Version 2.0" in (ROOT / "LICENSE").read_text(encoding="utf-8")


def test_every_console_script_resolves_to_a_callable():
    scripts = {entry.name: entry for entry in metadata.entry_points(group="console_scripts") if entry.value.startswith("megatron_lowprec.")}
    assert {"lowprec-train", "lowprec-prepare-data", "lowprec-megatron-lm"} <= set(scripts)
    for entry in scripts.values():
        assert callable(entry.load()), entry.value


def test_the_megatron_lm_console_script_prints_its_usage():
    script = Path(sysconfig.get_path("scripts")) / "lowprec-megatron-lm"
    result = subprocess.run([str(script)], capture_output=True, text=True)
    assert result.returncode == 1
    assert result.stderr.startswith("usage: lowprec-megatron-lm PRETRAIN_SCRIPT")


def test_setup_declares_lowprec_convert_and_its_entry_point_is_callable():
    import importlib

    declared = re.search(r'"lowprec-convert=([\w.]+):(\w+)"', (ROOT / "setup.py").read_text(encoding="utf-8"))
    assert declared is not None
    assert callable(getattr(importlib.import_module(declared[1]), declared[2]))
