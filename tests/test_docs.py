"""The documentation a newcomer meets first: README.md stays one screen-ish, its links resolve, and
the quickstart's marked code blocks run as written on the embedded default."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
QUICKSTART = ROOT / "docs" / "tutorials" / "quickstart.md"
README_MAX_LINES = 150
RUN_MARK = re.compile(r"<!-- ci: run(?: with (?P<overrides>[^>]*?))? -->\n```(?P<language>\w+)\n(?P<code>.*?)\n```", re.S)
"""A fenced block that CI runs, marked by the HTML comment right above it (invisible on the site);
``with OVERRIDES`` appends Hydra overrides to each ``lowprec-train`` command to keep the run short."""
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def marked_blocks(page: Path) -> list[tuple[str, str, str]]:
    """(language, code, overrides) of each block of ``page`` marked to run."""
    return [(m["language"], m["code"], m["overrides"] or "") for m in RUN_MARK.finditer(page.read_text(encoding="utf-8"))]


def test_readme_fits_in_150_lines():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; at most {README_MAX_LINES}"


def test_readme_relative_links_point_at_files():
    targets = [link for link in LINK.findall(README.read_text(encoding="utf-8")) if "://" not in link]
    assert targets, "README.md links into the docs"
    missing = [link for link in targets if not (ROOT / link.split("#")[0]).exists()]
    assert not missing, f"README.md links to paths that do not exist: {missing}"


def test_quickstart_marks_a_python_block_and_a_training_command():
    languages = [language for language, _, _ in marked_blocks(QUICKSTART)]
    assert "python" in languages and "bash" in languages, languages


@pytest.mark.parametrize("index", range(len(marked_blocks(QUICKSTART))))
def test_quickstart_block_runs(index, tmp_path):
    language, code, overrides = marked_blocks(QUICKSTART)[index]
    environment = {**os.environ, "WANDB_MODE": "disabled"}
    if language == "python":
        command = [sys.executable, "-c", code]
    else:
        lines = [line.split("#")[0].strip() for line in code.splitlines()]
        commands = [shlex.split(line) + shlex.split(overrides) for line in lines if line]
        assert all(words[0] == "lowprec-train" for words in commands), commands
        command = ["bash", "-c", " && ".join(shlex.join(words) for words in commands)]
    result = subprocess.run(command, cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{language} block {index} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    if language == "bash":
        assert "summary:" in result.stdout, result.stdout[-3000:]
