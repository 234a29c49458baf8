"""The reference pages are the code's: ``docs/reference/*.md`` equal a fresh generation, every config
key is documented, the config keys the pages name exist, and the option tables of the README and of
the docs hold the registry's names, aliases and bytes per parameter as allocated."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pytest

from megatron_lowprec.optim.strategies import MASTER_STORAGES, available_strategies, get_strategy
from megatron_lowprec.train.reference import (
    DISTRIBUTED_DP, GENERATOR, config_groups, config_keys, field_docs, pages,
)

REPOSITORY_ROOT = Path(__file__).resolve().parents[2]
REFERENCE = REPOSITORY_ROOT / "docs" / "reference"
PAGES = pages()
CONFIG_KEY = re.compile(r"`((?:model|precision|optimizer|data|trainer|logging)\.[a-z0-9_]+)`")


@pytest.mark.parametrize("name", sorted(PAGES))
def test_the_committed_reference_page_is_a_fresh_generation(name):
    committed = (REFERENCE / name).read_text(encoding="utf-8")
    assert committed == PAGES[name], f"docs/reference/{name} is not what the code writes; run {GENERATOR}"


def test_every_field_of_every_config_dataclass_has_a_docstring():
    undocumented = []
    for prefix, group in config_groups():
        hints, documented = typing.get_type_hints(group), field_docs(group)
        for field in dataclasses.fields(group):
            if not dataclasses.is_dataclass(hints[field.name]) and not documented.get(field.name):
                undocumented.append(f"{prefix}.{field.name}" if prefix else field.name)
    assert not undocumented


def test_the_config_keys_the_pages_name_exist():
    keys = {key.key for key in config_keys()}
    named = {match for text in PAGES.values() for match in CONFIG_KEY.findall(text)}
    assert named and named <= keys, sorted(named - keys)


def _tables(text: str) -> list[list[list[str]]]:
    """Every Markdown table of ``text`` as rows of stripped cells, header first, rule dropped."""
    tables, current = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if not all(set(cell) <= set("-:") for cell in cells):
                current.append(cells)
        elif current:
            tables.append(current)
            current = []
    return tables


def _table(text: str, header: list[str]) -> list[list[str]]:
    """The one table of ``text`` whose header begins with ``header``, without its header."""
    found = [table for table in _tables(text) if table[0][: len(header)] == header]
    assert len(found) == 1, f"{len(found)} tables with header {header}"
    return found[0][1:]


def _name(cell: str) -> str:
    return re.findall(r"`([^`]+)`", cell)[0]


def _aliases(cell: str) -> tuple[str, ...]:
    return () if cell == "—" else tuple(re.findall(r"`([^`]+)`", cell))


def _bytes(cell: str) -> float:
    return float(re.match(r"\d+(?:\.\d+)?", cell)[0])


def _check_names(rows: list[list[str]]) -> None:
    strategies = available_strategies()
    assert [_name(row[0]) for row in rows] == [strategy.name for strategy in strategies]
    assert [_aliases(row[1]) for row in rows] == [strategy.aliases for strategy in strategies]


def test_the_readme_option_table_holds_the_registry_and_its_bytes_as_allocated():
    """README.md's short table: ``| option | aliases | bytes/param | stores |``, with the bytes per
    parameter that ``lowprec-train`` allocates by default."""
    rows = _table((REPOSITORY_ROOT / "README.md").read_text(encoding="utf-8"), ["option", "aliases", "bytes/param", "stores"])
    _check_names(rows)
    for row in rows:
        assert _bytes(row[2]) == get_strategy(_name(row[0])).bytes_per_param(), row


def test_the_options_page_holds_the_registry_and_its_bytes_as_allocated():
    text = (REFERENCE / "options.md").read_text(encoding="utf-8")
    _check_names(_table(text, ["option", "aliases", "summary"]))
    header = ["option", "master storage", "parameter", "gradient", "moments, corrections", "master", "bytes/param",
              f"distributed, DP={DISTRIBUTED_DP}"]
    rows = _table(text, header)
    expected = {
        (strategy.name, storage if strategy.master_weights else "—")
        for strategy in available_strategies()
        for storage in (MASTER_STORAGES if strategy.master_weights else (None,))
    }
    assert {(_name(row[0]), row[1].strip("`")) for row in rows} == expected
    for row in rows:
        strategy = get_strategy(_name(row[0]))
        if row[1] != "—":
            strategy = strategy.with_master_storage(row[1].strip("`"))
        components = [_bytes(cell) for cell in row[2:6]]
        fp32_gradient = strategy.master_weights and strategy.master_storage != "residual8"
        assert row[3] == ("4 (FP32)" if fp32_gradient else "2 (BF16)"), row
        assert sum(components) == _bytes(row[6]) == strategy.bytes_per_param(), row
        assert _bytes(row[7]) == strategy.bytes_per_param(state_shards=DISTRIBUTED_DP), row
