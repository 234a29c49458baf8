"""The embedded default corpus and the on-disk cache it is unpacked into.

``shakespeare.txt.xz`` holds Shakespeare's plays and poems (42 works), which are in the
public domain. The text is that of the Project Gutenberg e-texts as redistributed by the
``shakespeare`` 0.6 Python package (``shksprdata/texts/*_gut.txt``, the modern-spelling
variants), with the Project Gutenberg licence, headers and footers removed, line endings
normalised to ``\\n`` and the works joined by blank lines. It is about 5 MB uncompressed.
"""

import hashlib
import lzma
import os
from pathlib import Path
from typing import Optional, Union

CACHE_ENV_VAR = "MEGATRON_LOWPREC_CACHE"
XDG_CACHE_ENV_VAR = "XDG_CACHE_HOME"
_EMBEDDED_CORPUS_NAME = "shakespeare.txt.xz"


def default_cache_dir(cache_dir: Optional[Union[str, os.PathLike]] = None) -> Path:
    """The cache directory: the argument, else ``$MEGATRON_LOWPREC_CACHE``, else
    ``$XDG_CACHE_HOME/megatron_lowprec``, else ``~/.cache/megatron_lowprec``. As the XDG Base
    Directory specification says, an ``XDG_CACHE_HOME`` that is not an absolute path is ignored."""
    if cache_dir is not None:
        return Path(cache_dir)
    from_env = os.environ.get(CACHE_ENV_VAR)
    if from_env:
        return Path(from_env)
    xdg_cache = os.environ.get(XDG_CACHE_ENV_VAR, "")
    base = Path(xdg_cache) if os.path.isabs(xdg_cache) else Path.home() / ".cache"
    return base / "megatron_lowprec"


def embedded_corpus_path() -> Path:
    """Path of the compressed corpus shipped inside the package."""
    return Path(__file__).resolve().parent / _EMBEDDED_CORPUS_NAME


def file_sha256(path: Union[str, os.PathLike]) -> str:
    """Hex SHA-256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def embedded_corpus_text_file(cache_dir: Optional[Union[str, os.PathLike]] = None) -> Path:
    """Decompress the embedded corpus into the cache once and return the text file's path.

    The file name carries a hash of the shipped archive, so a changed corpus is unpacked
    afresh; the write goes through a temporary file so a partial file is never seen.
    """
    archive = embedded_corpus_path()
    if not archive.is_file():
        raise FileNotFoundError(f"embedded corpus {archive} is missing from the installed package")
    target_dir = default_cache_dir(cache_dir) / "corpus"
    target = target_dir / f"shakespeare-{file_sha256(archive)[:12]}.txt"
    if target.is_file():
        return target
    target_dir.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    with lzma.open(archive, "rb") as source, open(partial, "wb") as sink:
        for chunk in iter(lambda: source.read(1 << 20), b""):
            sink.write(chunk)
    os.replace(partial, target)
    return target
