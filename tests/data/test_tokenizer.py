import json

import pytest

from megatron_lowprec.data import TOKENIZER_KINDS, build_tokenizer
from megatron_lowprec.data.tokenizer import END_OF_TEXT

from .conftest import TINY_VOCAB

SAMPLE = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer"


def test_byte_bpe_trains_and_round_trips_exactly(tiny_byte_bpe, corpus_slice):
    assert tiny_byte_bpe.vocab_size == TINY_VOCAB
    assert tiny_byte_bpe.eod == tiny_byte_bpe._backend.token_to_id(END_OF_TEXT)
    text = corpus_slice.read_text(encoding="utf-8")[:20_000]
    for sample in (text, SAMPLE, "  odd   spacing\t\tand unicode: naïve café — 日本 🎭\n\n"):
        ids = tiny_byte_bpe.tokenize(sample)
        assert all(0 <= i < TINY_VOCAB for i in ids)
        assert tiny_byte_bpe.detokenize(ids) == sample
    assert len(tiny_byte_bpe.tokenize(text)) < 0.6 * len(text.encode())


def test_byte_bpe_reloads_from_directory(tiny_byte_bpe, tmp_path):
    directory = tiny_byte_bpe.unique_identifiers["files"]
    (tokenizer_file,) = directory
    reloaded = build_tokenizer("byte_bpe", tokenizer_dir=tokenizer_file.rsplit("/", 1)[0])
    assert reloaded.tokenize(SAMPLE) == tiny_byte_bpe.tokenize(SAMPLE)
    assert reloaded.unique_identifiers == tiny_byte_bpe.unique_identifiers
    assert tiny_byte_bpe.tokenize_batch([SAMPLE, "x"]) == [tiny_byte_bpe.tokenize(SAMPLE), tiny_byte_bpe.tokenize("x")]
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        build_tokenizer("byte_bpe", tokenizer_dir=tmp_path)


def _gpt2_files(corpus_slice, directory, special_tokens):
    from tokenizers import ByteLevelBPETokenizer

    trainer = ByteLevelBPETokenizer()
    trainer.train([str(corpus_slice)], vocab_size=400, show_progress=False, special_tokens=special_tokens)
    vocab_file, merge_file = trainer.save_model(str(directory))
    return trainer, vocab_file, merge_file


def test_gpt2_bpe_loads_vocab_and_merges(corpus_slice, tmp_path):
    trainer, vocab_file, merge_file = _gpt2_files(corpus_slice, tmp_path, [END_OF_TEXT])
    tokenizer = build_tokenizer("gpt2_bpe", vocab_file=vocab_file, merge_file=merge_file)
    assert tokenizer.vocab_size == 400
    assert tokenizer.eod == json.loads(open(vocab_file).read())[END_OF_TEXT]
    assert tokenizer.tokenize(SAMPLE) == trainer.encode(SAMPLE).ids
    assert tokenizer.detokenize(tokenizer.tokenize(SAMPLE)) == SAMPLE


def test_gpt2_bpe_without_end_of_text_is_rejected(corpus_slice, tmp_path):
    _, vocab_file, merge_file = _gpt2_files(corpus_slice, tmp_path, [])
    with pytest.raises(ValueError, match="endoftext"):
        build_tokenizer("gpt2_bpe", vocab_file=vocab_file, merge_file=merge_file)
    with pytest.raises(ValueError, match="merge file is required"):
        build_tokenizer("gpt2_bpe", vocab_file=vocab_file)


def test_sentencepiece_model_loads(corpus_slice, tmp_path):
    import sentencepiece

    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus_slice),
        model_prefix=str(tmp_path / "tiny"),
        vocab_size=300,
        model_type="bpe",
        input_sentence_size=5000,
        minloglevel=2,
    )
    tokenizer = build_tokenizer("sentencepiece", sentencepiece_model=tmp_path / "tiny.model")
    processor = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "tiny.model"))
    assert tokenizer.vocab_size == 300
    assert tokenizer.eod == processor.eos_id()
    ids = tokenizer.tokenize(SAMPLE)
    assert ids == processor.encode(SAMPLE)
    assert tokenizer.detokenize(ids) == SAMPLE.replace("\n", " ")
    with pytest.raises(FileNotFoundError, match="missing.model"):
        build_tokenizer("sentencepiece", sentencepiece_model=tmp_path / "missing.model")


def test_unknown_kind_lists_valid_kinds():
    with pytest.raises(ValueError) as error:
        build_tokenizer("wordpiece")
    message = str(error.value)
    assert "'wordpiece'" in message
    for kind in TOKENIZER_KINDS:
        assert kind in message
