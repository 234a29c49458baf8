import lzma
import re
from pathlib import Path

from megatron_lowprec.data import default_cache_dir, embedded_corpus_path, embedded_corpus_text_file
from megatron_lowprec.data.corpus import CACHE_ENV_VAR

BOILERPLATE = (
    "project gutenberg",
    "gutenberg",
    "*** start of",
    "*** end of",
    "small print",
    "e-text",
    "this ebook",
)


def test_cache_dir_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path / "env"))
    assert default_cache_dir() == tmp_path / "env"
    assert default_cache_dir(tmp_path / "arg") == tmp_path / "arg"
    monkeypatch.delenv(CACHE_ENV_VAR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "megatron_lowprec"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/xdg")
    assert default_cache_dir() == Path.home() / ".cache" / "megatron_lowprec"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == Path.home() / ".cache" / "megatron_lowprec"


def test_shipped_archive_is_small_xz():
    archive = embedded_corpus_path()
    assert archive.is_file()
    assert archive.stat().st_size < 2 * 1024 * 1024
    with lzma.open(archive) as handle:
        assert handle.read(32)


def test_corpus_decompresses_once_into_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path))
    path = embedded_corpus_text_file()
    assert path.parent.parent == tmp_path
    first_mtime = path.stat().st_mtime_ns
    again = embedded_corpus_text_file()
    assert again == path
    assert again.stat().st_mtime_ns == first_mtime
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_corpus_is_clean_english_text(session_cache):
    data = embedded_corpus_text_file(session_cache).read_bytes()
    assert 3_000_000 < len(data) < 8_000_000
    assert b"\r" not in data
    text = data.decode("utf-8")
    lowered = text.lower()
    for phrase in BOILERPLATE:
        assert phrase not in lowered, phrase
    assert not re.search(r"\betexts?\b", lowered)
    assert lowered.count(" the ") > 10_000
    for title in ("HAMLET, PRINCE OF DENMARK", "THE TRAGEDY OF KING LEAR", "THE SONNETS"):
        assert title in text
