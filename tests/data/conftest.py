"""Shared fixtures: a private cache, a slice of the embedded corpus and a tiny byte BPE."""

import pytest

from megatron_lowprec.data import embedded_corpus_text_file, train_byte_bpe

SLICE_BYTES = 300_000
TINY_VOCAB = 512


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("lowprec_cache")


@pytest.fixture(scope="session")
def corpus_slice(session_cache):
    """The first few hundred KB of the embedded corpus, cut at a paragraph break."""
    text = embedded_corpus_text_file(session_cache).read_text(encoding="utf-8")
    cut = text.index("\n\n", SLICE_BYTES)
    path = session_cache / "slice.txt"
    path.write_text(text[:cut] + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def tiny_byte_bpe(corpus_slice, tmp_path_factory):
    return train_byte_bpe([corpus_slice], tmp_path_factory.mktemp("byte_bpe"), vocab_size=TINY_VOCAB)
