"""Tokenizers with the interface megatron's GPT datasets need.

Three kinds, all local files, nothing downloaded:

- ``byte_bpe``: a byte-level BPE trained with the ``tokenizers`` library (the embedded default),
  saved to and loaded from a directory holding ``tokenizer.json``;
- ``gpt2_bpe``: GPT-2 BPE from user-supplied ``vocab.json`` and ``merges.txt``;
- ``sentencepiece``: a SentencePiece ``.model`` (e.g. LLaMA's).

Every tokenizer exposes ``vocab_size``, ``eod``, ``tokenize``, ``tokenize_batch``,
``detokenize`` and ``unique_identifiers`` (which megatron hashes into its dataset cache keys).
"""

from abc import ABC, abstractmethod
import os
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Union

from megatron_lowprec.data.corpus import file_sha256

TOKENIZER_KINDS = ("byte_bpe", "gpt2_bpe", "sentencepiece")
END_OF_TEXT = "<|endoftext|>"
BYTE_BPE_FILE = "tokenizer.json"

PathLike = Union[str, os.PathLike]


def _require_file(path: Optional[PathLike], what: str) -> Path:
    if path is None:
        raise ValueError(f"{what} is required")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} {str(path)!r} does not exist")
    return path


class Tokenizer(ABC):
    """Common interface; subclasses implement the four token operations."""

    kind = ""

    def __init__(self, files: Sequence[Path]):
        self.unique_identifiers: Dict[str, object] = {
            "class": type(self).__name__,
            "kind": self.kind,
            "files": {str(path): file_sha256(path) for path in files},
        }

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids."""

    @property
    @abstractmethod
    def eod(self) -> int:
        """The end-of-document token id."""

    @abstractmethod
    def tokenize(self, text: str) -> List[int]:
        """Token ids of one text."""

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        """Token ids of several texts."""
        return [self.tokenize(text) for text in texts]

    @abstractmethod
    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of token ids."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eod={self.eod})"


class _HuggingFaceByteLevelTokenizer(Tokenizer):
    """A byte-level BPE from the ``tokenizers`` library whose EOD is ``<|endoftext|>``."""

    def __init__(self, backend, files: Sequence[Path]):
        self._backend = backend
        eod = backend.token_to_id(END_OF_TEXT)
        if eod is None:
            sources = [str(path) for path in files]
            raise ValueError(f"{self.kind} vocabulary from {sources} has no {END_OF_TEXT!r} token")
        self._eod = eod
        super().__init__(files)

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size()

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> List[int]:
        return self._backend.encode(text).ids

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [encoding.ids for encoding in self._backend.encode_batch(list(texts))]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._backend.decode(list(ids))


class ByteBPETokenizer(_HuggingFaceByteLevelTokenizer):
    """A byte-level BPE trained on the corpus, stored as ``<directory>/tokenizer.json``."""

    kind = "byte_bpe"

    def __init__(self, directory: PathLike):
        from tokenizers import Tokenizer as BackendTokenizer

        path = _require_file(Path(directory) / BYTE_BPE_FILE, "byte_bpe tokenizer file")
        super().__init__(BackendTokenizer.from_file(str(path)), [path])


class GPT2BPETokenizer(_HuggingFaceByteLevelTokenizer):
    """GPT-2 BPE from a ``vocab.json`` and a ``merges.txt``."""

    kind = "gpt2_bpe"

    def __init__(self, vocab_file: PathLike, merge_file: PathLike):
        from tokenizers import ByteLevelBPETokenizer

        vocab_path = _require_file(vocab_file, "gpt2_bpe vocab file")
        merge_path = _require_file(merge_file, "gpt2_bpe merge file")
        backend = ByteLevelBPETokenizer.from_file(str(vocab_path), str(merge_path))
        super().__init__(backend, [vocab_path, merge_path])


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model; its end-of-sentence id is the EOD."""

    kind = "sentencepiece"

    def __init__(self, model_file: PathLike):
        import sentencepiece

        path = _require_file(model_file, "sentencepiece model")
        self._processor = sentencepiece.SentencePieceProcessor(model_file=str(path))
        eos = self._processor.eos_id()
        if eos < 0:
            raise ValueError(f"sentencepiece model {str(path)!r} has no end-of-sentence token for EOD")
        self._eod = eos
        super().__init__([path])

    @property
    def vocab_size(self) -> int:
        return self._processor.get_piece_size()

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> List[int]:
        return self._processor.encode(text)

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return self._processor.encode(list(texts))

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._processor.decode(list(ids))


def train_byte_bpe(
    files: Sequence[PathLike], output_dir: PathLike, vocab_size: int = 4096, min_frequency: int = 2
) -> ByteBPETokenizer:
    """Train a byte-level BPE on text files, save it to ``output_dir`` and load it back."""
    from tokenizers import ByteLevelBPETokenizer

    if not files:
        raise ValueError("train_byte_bpe needs at least one training file")
    paths = [_require_file(path, "training file") for path in files]
    if vocab_size < 257:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: a byte-level BPE needs at least 257 (256 bytes + EOD)"
        )
    trainer = ByteLevelBPETokenizer()
    trainer.train(
        [str(path) for path in paths],
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        show_progress=False,
        special_tokens=[END_OF_TEXT],
    )
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    trainer.save(str(output_dir / BYTE_BPE_FILE))
    return ByteBPETokenizer(output_dir)


def build_tokenizer(
    kind: str,
    *,
    tokenizer_dir: Optional[PathLike] = None,
    vocab_file: Optional[PathLike] = None,
    merge_file: Optional[PathLike] = None,
    sentencepiece_model: Optional[PathLike] = None,
) -> Tokenizer:
    """Load a tokenizer of ``kind`` from local files (see ``TOKENIZER_KINDS``)."""
    if kind == "byte_bpe":
        if tokenizer_dir is None:
            raise ValueError("tokenizer kind 'byte_bpe' needs tokenizer_dir (train one with train_byte_bpe)")
        return ByteBPETokenizer(tokenizer_dir)
    if kind == "gpt2_bpe":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if kind == "sentencepiece":
        return SentencePieceTokenizer(sentencepiece_model)
    raise ValueError(f"unknown tokenizer kind {kind!r}; valid kinds: {', '.join(TOKENIZER_KINDS)}")
