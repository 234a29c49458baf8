"""benchmarks/report.py: the stamp names when, where and from what a figure was measured; a benchmark's
``--markdown`` writes a table that parses under that stamp; every result file in docs/results is stamped."""

import datetime
import importlib.util
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"


def _report():
    spec = importlib.util.spec_from_file_location("report", ROOT / "benchmarks" / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _head_commit() -> str:
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()


def _markdown_tables(text: str) -> list[list[list[str]]]:
    """Each table of ``text`` as rows of cells, its separator row left out."""
    tables, current = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|") and line.endswith("|"):
            current.append([cell.strip() for cell in line[1:-1].split("|")])
        elif current:
            tables.append(current)
            current = []
    for table in tables:
        assert set("".join(table[1])) <= {"-", ":"}, f"the second row of a table separates: {table[1]}"
        del table[1]
    return tables


def test_the_stamp_has_every_field_and_names_this_machine_and_commit():
    import torch

    report = _report()
    fields = report.stamp()
    assert list(fields) == ["date", "device", "python", "torch", "triton", "megatron-core", "commit"]
    assert all(fields.values())
    assert fields["date"] == datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    assert fields["python"] == platform.python_version()
    assert fields["torch"] == torch.__version__
    assert fields["commit"].removesuffix("+dirty") == _head_commit()
    assert re.search(r", \d+ cores$", fields["device"])
    assert report.parse_stamp(report.stamp_line(fields)) == fields


def test_a_stamp_without_a_field_is_refused_by_name():
    report = _report()
    fields = report.stamp()
    del fields["triton"]
    with pytest.raises(ValueError, match="stamp lacks triton; a stamp has date, device"):
        report.stamp_line(fields)


def test_a_row_of_the_wrong_width_is_refused():
    with pytest.raises(ValueError, match=r"row \['a'\] has 1 cells; the header has 2"):
        _report().markdown_table(["x", "y"], [["a"]])


def test_write_result_saves_the_plot_beside_the_table(tmp_path):
    pytest.importorskip("matplotlib")
    path = _report().write_result(tmp_path / "figure.md", "A title", ["x", "y"], [[1, 2]], ["a note"],
                                  plot=lambda figure: figure.add_subplot().plot([1, 2], [3, 4]))
    assert path.read_text().split("\n\n")[0] == "### A title"
    assert (tmp_path / "figure.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_benchmark_writes_its_table_stamped_with_this_commit(tmp_path):
    target = tmp_path / "grad_norm.md"
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "grad_norm.py"), "--sizes", "5000", "--dtypes", "float32", "bfloat16",
         "--repeats", "1", "--device", "cpu", "--markdown", str(target), "--note", "a shared machine"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    text = target.read_text()
    stamp_lines = [line for line in text.splitlines() if line.startswith("Measured: ")]
    assert len(stamp_lines) == 1
    assert _report().parse_stamp(stamp_lines[0])["commit"].removesuffix("+dirty") == _head_commit()
    (table,) = _markdown_tables(text)
    assert table[0] == ["elements", "gradients", "layout", "FP32 norm ms", "exact norm ms", "exact / FP32"]
    assert [row[1] for row in table[1:]] == ["float32", "bfloat16"]
    for row in table[1:]:
        assert float(row[0]) == 5000 and all(float(cell) > 0 for cell in row[3:])
    assert "a shared machine" in text


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.md")), ids=lambda path: path.name)
def test_every_result_file_is_stamped(path):
    """A result file written through report.py carries its stamp line with every field; the kernel
    audit's files (tools/kernel_audit) carry theirs as a list: a date, the torch version and a commit."""
    text = path.read_text()
    stamp_lines = [line for line in text.splitlines() if line.startswith("Measured: ")]
    if stamp_lines:
        fields = _report().parse_stamp(stamp_lines[0])
        assert list(fields) == ["date", "device", "python", "torch", "triton", "megatron-core", "commit"]
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", fields["date"])
        assert re.match(r"[0-9a-f]{7,}", fields["commit"])
        assert all(fields.values())
    else:
        head = "\n".join(line for line in text.splitlines()[:12] if line.startswith("- "))
        assert re.search(r"\d{4}-\d{2}-\d{2}", head) and "torch" in head and re.search(r"\b[0-9a-f]{7,}\b", head)
    assert _markdown_tables(text), f"{path.name} holds no table"
