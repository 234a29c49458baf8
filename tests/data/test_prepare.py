import os

import numpy
import pytest

from megatron_lowprec.data import build_tokenizer, prepare_dataset, prepare_embedded_default
from megatron_lowprec.data import prepare as prepare_module
from megatron_lowprec.data.prepare import main

PLAY = "First Citizen:\nBefore we proceed any further, hear me speak.\n\n  \nAll:\nSpeak, speak.\n\n\n"
POEM = "Shall I compare thee to a summer's day?\nThou art more lovely and more temperate:\n"


def _read(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    return IndexedDataset(str(prefix))


@pytest.fixture
def two_files(tmp_path):
    play, poem = tmp_path / "play.txt", tmp_path / "poem.txt"
    play.write_text(PLAY, encoding="utf-8")
    poem.write_text(POEM, encoding="utf-8")
    return [play, poem]


def test_paragraph_documents_match_direct_tokenization(tiny_byte_bpe, two_files, tmp_path):
    prefix = prepare_dataset(two_files, tmp_path / "out" / "docs", tiny_byte_bpe)
    dataset = _read(prefix)
    paragraphs = ["First Citizen:\nBefore we proceed any further, hear me speak.", "All:\nSpeak, speak.", POEM.rstrip("\n")]
    expected = [tiny_byte_bpe.tokenize(p) + [tiny_byte_bpe.eod] for p in paragraphs]
    assert len(dataset) == len(paragraphs)
    assert len(dataset.document_indices) == len(paragraphs) + 1
    assert [dataset[i].tolist() for i in range(len(dataset))] == expected
    assert dataset[0].dtype == numpy.uint16
    assert int(dataset.sequence_lengths.sum()) == sum(len(ids) for ids in expected)
    assert not list((tmp_path / "out").glob("*partial*"))


def test_file_documents_without_eod(tiny_byte_bpe, two_files, tmp_path):
    prefix = prepare_dataset(two_files, tmp_path / "files", tiny_byte_bpe, append_eod=False, documents="file")
    dataset = _read(prefix)
    assert [dataset[i].tolist() for i in range(len(dataset))] == [tiny_byte_bpe.tokenize(PLAY), tiny_byte_bpe.tokenize(POEM)]


def test_prepare_dataset_rejects_bad_arguments(tiny_byte_bpe, two_files, tmp_path):
    with pytest.raises(ValueError, match="'sentence'.*paragraph, file"):
        prepare_dataset(two_files, tmp_path / "x", tiny_byte_bpe, documents="sentence")
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        prepare_dataset([tmp_path / "nope.txt"], tmp_path / "x", tiny_byte_bpe)


def test_cli_trains_byte_bpe_then_reuses_it(corpus_slice, tmp_path, capsys):
    prefix = tmp_path / "cli" / "slice"
    argv = ["--input", str(corpus_slice), "--output-prefix", str(prefix), "--vocab-size", "300"]
    main(argv)
    assert "wrote" in capsys.readouterr().out
    tokenizer = build_tokenizer("byte_bpe", tokenizer_dir=f"{prefix}-tokenizer")
    assert tokenizer.vocab_size == 300
    tokenizer_mtime = (tmp_path / "cli" / "slice-tokenizer" / "tokenizer.json").stat().st_mtime_ns
    first = _read(prefix)
    assert len(first) > 1000
    main(argv + ["--documents", "file"])
    assert (tmp_path / "cli" / "slice-tokenizer" / "tokenizer.json").stat().st_mtime_ns == tokenizer_mtime
    whole = _read(prefix)
    assert len(whole) == 1
    text = corpus_slice.read_text(encoding="utf-8")
    assert whole[0].tolist() == tokenizer.tokenize(text) + [tokenizer.eod]


def test_cli_rejects_unknown_tokenizer_type(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--input", "a.txt", "--output-prefix", str(tmp_path / "x"), "--tokenizer-type", "wordpiece"])
    assert "byte_bpe" in capsys.readouterr().err


def test_embedded_default_is_prepared_once(tmp_path, monkeypatch):
    first = prepare_embedded_default(tmp_path, vocab_size=512)
    files = [f"{first.data_prefix}.bin", f"{first.data_prefix}.idx", f"{first.tokenizer_dir}/tokenizer.json"]
    mtimes = [os.stat(path).st_mtime_ns for path in files]

    def must_not_run(*args, **kwargs):
        raise AssertionError("second call must not redo any work")

    monkeypatch.setattr(prepare_module, "train_byte_bpe", must_not_run)
    monkeypatch.setattr(prepare_module, "prepare_dataset", must_not_run)
    second = prepare_embedded_default(tmp_path, vocab_size=512)
    assert second == first
    assert [os.stat(path).st_mtime_ns for path in files] == mtimes
    dataset = _read(first.data_prefix)
    tokenizer = first.tokenizer()
    assert tokenizer.vocab_size == 512
    assert len(dataset) > 10_000
    assert dataset[0].tolist()[-1] == tokenizer.eod
    assert tokenizer.detokenize(dataset[0].tolist()) == "ALL'S WELL THAT ENDS WELL"
