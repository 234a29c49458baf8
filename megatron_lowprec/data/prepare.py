"""Tokenize text files into megatron's indexed ``.bin``/``.idx`` format (``lowprec-prepare-data``).

Documents: by default each paragraph (a run of non-blank lines, split at blank lines) of every
input file is one document, so that a 980:10:10 document split leaves enough documents in the
validation and test splits even for a handful of files; ``documents="file"`` makes each whole
file one document. Each document is followed by the tokenizer's EOD id when ``append_eod``.
"""

import argparse
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Union

from megatron_lowprec.data.corpus import default_cache_dir, embedded_corpus_text_file, file_sha256
from megatron_lowprec.data.tokenizer import (
    BYTE_BPE_FILE,
    TOKENIZER_KINDS,
    Tokenizer,
    build_tokenizer,
    train_byte_bpe,
)

DOCUMENT_UNITS = ("paragraph", "file")
EMBEDDED_DEFAULT_VOCAB_SIZE = 4096
_BATCH_DOCUMENTS = 4096
_PARAGRAPH_BREAK = re.compile(r"\n(?:[ \t]*\n)+")

PathLike = Union[str, os.PathLike]


def _documents(text: str, documents: str) -> List[str]:
    if documents == "file":
        return [text] if text.strip() else []
    blocks = (block.strip("\n") for block in _PARAGRAPH_BREAK.split(text.replace("\r\n", "\n")))
    return [block for block in blocks if block.strip()]


def _document_batches(text_files: Sequence[Path], documents: str) -> Iterator[List[str]]:
    batch: List[str] = []
    for path in text_files:
        batch.extend(_documents(path.read_text(encoding="utf-8"), documents))
        while len(batch) >= _BATCH_DOCUMENTS:
            yield batch[:_BATCH_DOCUMENTS]
            batch = batch[_BATCH_DOCUMENTS:]
    if batch:
        yield batch


def token_dtype(vocab_size: int):
    """The on-disk token dtype megatron's ``GPTDatasetConfig`` expects for this vocabulary size."""
    import numpy

    return numpy.uint16 if vocab_size <= numpy.iinfo(numpy.uint16).max + 1 else numpy.int32


def prepare_dataset(
    text_files: Sequence[PathLike],
    output_prefix: PathLike,
    tokenizer: Tokenizer,
    append_eod: bool = True,
    documents: str = "paragraph",
) -> str:
    """Write ``<output_prefix>.bin/.idx`` with megatron's ``IndexedDatasetBuilder``; return the prefix.

    The files are written under temporary names and renamed at the end, so an interrupted run
    leaves no half-written dataset behind.
    """
    import numpy
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path

    if documents not in DOCUMENT_UNITS:
        raise ValueError(f"unknown documents={documents!r}; valid choices: {', '.join(DOCUMENT_UNITS)}")
    if not text_files:
        raise ValueError("prepare_dataset needs at least one text file")
    paths = [Path(path) for path in text_files]
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"input text file {str(path)!r} does not exist")
    prefix = str(output_prefix)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    partial_prefix = f"{prefix}.{os.getpid()}.partial"
    dtype = token_dtype(tokenizer.vocab_size)
    builder = IndexedDatasetBuilder(get_bin_path(partial_prefix), dtype=dtype)
    document_count = 0
    for batch in _document_batches(paths, documents):
        for ids in tokenizer.tokenize_batch(batch):
            if append_eod:
                ids = ids + [tokenizer.eod]
            if not ids:
                continue
            builder.add_document(numpy.asarray(ids, dtype=dtype), [len(ids)])
            document_count += 1
    builder.finalize(get_idx_path(partial_prefix))
    if document_count == 0:
        os.remove(get_bin_path(partial_prefix))
        os.remove(get_idx_path(partial_prefix))
        raise ValueError(f"no non-empty documents in {[str(p) for p in paths]}")
    os.replace(get_bin_path(partial_prefix), get_bin_path(prefix))
    os.replace(get_idx_path(partial_prefix), get_idx_path(prefix))
    return prefix


@dataclass(frozen=True)
class EmbeddedDataset:
    """Where the prepared embedded corpus lives."""

    data_prefix: str
    tokenizer_dir: str

    def tokenizer(self) -> Tokenizer:
        """Load the byte BPE the corpus was tokenized with."""
        return build_tokenizer("byte_bpe", tokenizer_dir=self.tokenizer_dir)


def prepare_embedded_default(
    cache_dir: Optional[PathLike] = None, vocab_size: int = EMBEDDED_DEFAULT_VOCAB_SIZE
) -> EmbeddedDataset:
    """Train a byte BPE on the shipped corpus and tokenize it into the cache, once.

    A ``complete.json`` marker holding the corpus hash and vocabulary size is written last;
    when it is present and matches, the call returns the cached paths without doing any work.
    """
    text_file = embedded_corpus_text_file(cache_dir)
    corpus_hash = file_sha256(text_file)
    root = default_cache_dir(cache_dir) / f"shakespeare-{corpus_hash[:12]}-bpe{vocab_size}"
    embedded = EmbeddedDataset(
        data_prefix=str(root / "shakespeare_text_document"), tokenizer_dir=str(root / "tokenizer")
    )
    marker = root / "complete.json"
    expected = {"corpus_sha256": corpus_hash, "vocab_size": vocab_size}
    if marker.is_file() and json.loads(marker.read_text()) == expected:
        return embedded
    tokenizer = train_byte_bpe([text_file], embedded.tokenizer_dir, vocab_size=vocab_size)
    prepare_dataset([text_file], embedded.data_prefix, tokenizer)
    marker.write_text(json.dumps(expected))
    return embedded


def _tokenizer_from_args(args: argparse.Namespace) -> Tokenizer:
    if args.tokenizer_type != "byte_bpe":
        return build_tokenizer(
            args.tokenizer_type,
            vocab_file=args.vocab_file,
            merge_file=args.merge_file,
            sentencepiece_model=args.sentencepiece_model,
        )
    tokenizer_dir = Path(args.tokenizer_dir or f"{args.output_prefix}-tokenizer")
    if (tokenizer_dir / BYTE_BPE_FILE).is_file():
        return build_tokenizer("byte_bpe", tokenizer_dir=tokenizer_dir)
    return train_byte_bpe(args.input, tokenizer_dir, vocab_size=args.vocab_size)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Entry point of ``lowprec-prepare-data``."""
    parser = argparse.ArgumentParser(
        prog="lowprec-prepare-data",
        description="Tokenize text files into megatron indexed .bin/.idx files.",
    )
    parser.add_argument("--input", nargs="+", required=True, help="UTF-8 text files")
    parser.add_argument("--output-prefix", required=True, help="writes <prefix>.bin and <prefix>.idx")
    parser.add_argument("--tokenizer-type", choices=TOKENIZER_KINDS, default="byte_bpe")
    parser.add_argument(
        "--tokenizer-dir",
        help="byte_bpe: load tokenizer.json from here, or train on --input and save here "
        "(default <output-prefix>-tokenizer)",
    )
    parser.add_argument(
        "--vocab-size", type=int, default=EMBEDDED_DEFAULT_VOCAB_SIZE, help="byte_bpe training vocabulary size"
    )
    parser.add_argument("--vocab-file", help="gpt2_bpe vocab.json")
    parser.add_argument("--merge-file", help="gpt2_bpe merges.txt")
    parser.add_argument("--sentencepiece-model", help="sentencepiece .model file")
    parser.add_argument("--documents", choices=DOCUMENT_UNITS, default="paragraph")
    parser.add_argument("--no-append-eod", action="store_true", help="do not end documents with EOD")
    args = parser.parse_args(argv)
    tokenizer = _tokenizer_from_args(args)
    prefix = prepare_dataset(
        args.input,
        args.output_prefix,
        tokenizer,
        append_eod=not args.no_append_eod,
        documents=args.documents,
    )
    print(f"wrote {prefix}.bin and {prefix}.idx with {tokenizer!r}")
