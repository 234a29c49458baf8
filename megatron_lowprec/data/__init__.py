"""Corpus shipping, tokenizer training and megatron indexed-dataset preparation."""

from megatron_lowprec.data.corpus import default_cache_dir, embedded_corpus_path, embedded_corpus_text_file
from megatron_lowprec.data.datasets import build_gpt_datasets
from megatron_lowprec.data.prepare import EmbeddedDataset, prepare_dataset, prepare_embedded_default
from megatron_lowprec.data.tokenizer import (
    TOKENIZER_KINDS,
    Tokenizer,
    build_tokenizer,
    train_byte_bpe,
)

__all__ = [
    "TOKENIZER_KINDS",
    "EmbeddedDataset",
    "Tokenizer",
    "build_gpt_datasets",
    "build_tokenizer",
    "default_cache_dir",
    "embedded_corpus_path",
    "embedded_corpus_text_file",
    "prepare_dataset",
    "prepare_embedded_default",
    "train_byte_bpe",
]
