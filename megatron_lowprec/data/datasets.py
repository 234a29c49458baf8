"""megatron ``GPTDataset`` train/valid/test splits built with ``BlendedMegatronDatasetBuilder``."""

import os
import re
from typing import Callable, Optional, Sequence, Tuple, Union

from megatron_lowprec.data.corpus import default_cache_dir
from megatron_lowprec.data.tokenizer import Tokenizer

PAPER_SPLIT = "980,10,10"
_SPLIT_PATTERN = re.compile(r"^\s*\d+(\.\d*)?(\s*,\s*\d+(\.\d*)?){0,2}\s*$")

PathLike = Union[str, os.PathLike]


def _build_on_every_rank() -> bool:
    return True


def build_gpt_datasets(
    data_prefix: Union[PathLike, Sequence[PathLike]],
    tokenizer: Tokenizer,
    seq_length: int,
    num_samples: Sequence[Optional[int]],
    split: str = PAPER_SPLIT,
    seed: int = 1234,
    weights: Optional[Sequence[float]] = None,
    cache_dir: Optional[PathLike] = None,
    create_attention_mask: bool = True,
    is_built_on_rank: Callable[[], bool] = _build_on_every_rank,
) -> Tuple:
    """Build ``(train, valid, test)`` megatron ``GPTDataset``s over prepared ``.bin/.idx`` prefixes.

    ``num_samples`` gives the samples to draw per split (``None``: one epoch); megatron rounds
    a single-source split up to whole epochs, so ``len(split) >= num_samples`` while
    ``split.num_samples`` is the requested count. Each sample holds ``seq_length`` input
    ``tokens`` and ``labels`` (drawn as ``seq_length + 1`` consecutive tokens), ``loss_mask``,
    ``position_ids`` and, when ``create_attention_mask``, a causal ``attention_mask``.
    Several prefixes are blended by ``weights`` (or by size when omitted). Sample indices are
    cached under ``<cache_dir>/gpt_dataset_indices``; works with or without an initialised
    ``torch.distributed``. Without it, a blend of several prefixes is built with no cache path,
    because megatron's ``BlendedDataset`` cache writer asks torch.distributed for the rank: the
    blend indices stay in memory and megatron caches each ``GPTDataset``'s indices in a
    ``cache/`` folder beside its ``.bin`` file.
    """
    import torch.distributed
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    if not isinstance(seq_length, int) or seq_length < 1:
        raise ValueError(f"seq_length must be a positive int, got {seq_length!r}")
    if len(num_samples) != 3:
        raise ValueError(f"num_samples must be (train, valid, test), got {tuple(num_samples)!r}")
    if not _SPLIT_PATTERN.match(split):
        raise ValueError(
            f"split must be up to three comma-separated non-negative weights like {PAPER_SPLIT!r}, got {split!r}"
        )
    if isinstance(data_prefix, (str, os.PathLike)):
        data_prefix = [data_prefix]
    prefixes = [str(prefix) for prefix in data_prefix]
    for prefix in prefixes:
        for suffix in (".bin", ".idx"):
            if not os.path.isfile(prefix + suffix):
                raise FileNotFoundError(
                    f"dataset file {prefix + suffix!r} does not exist (prepare it with lowprec-prepare-data)"
                )
    if weights is not None and len(weights) != len(prefixes):
        raise ValueError(f"weights {list(weights)} must match the {len(prefixes)} data prefixes {prefixes}")
    index_cache = str(default_cache_dir(cache_dir) / "gpt_dataset_indices")
    if len(prefixes) > 1 and not torch.distributed.is_initialized():
        index_cache = None
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=(prefixes, None if weights is None else [float(w) for w in weights]),
        split=split,
        path_to_cache=index_cache,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=create_attention_mask,
    )
    builder = BlendedMegatronDatasetBuilder(GPTDataset, list(num_samples), is_built_on_rank, config)
    train, valid, test = builder.build()
    return train, valid, test
