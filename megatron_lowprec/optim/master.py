"""Where an FP32 master weight lives: a whole FP32 tensor, or the BF16 parameter plus a 16-bit remainder
or an 8-bit residual.

A strategy with ``master_weights`` keeps one stored tensor per parameter under :func:`master_key`:

* ``master_storage="fp32"``: ``"master"``, the FP32 master itself; the 16-bit parameter is its
  nearest rounding (ties to even), written after every update.
* ``master_storage="remainder"``: ``"master_remainder"``, an int16 tensor; the master is the BF16
  parameter (its upper half) joined with it
  (:func:`~megatron_lowprec.numerics.formats.join_bf16_remainder`), 2 bytes instead of 4. The
  parameter then rounds the master to nearest with ties away from zero.
* ``master_storage="residual8"``: ``"master_residual8"``, an int8 tensor (FlashOptim's master
  residual, :func:`~megatron_lowprec.numerics.formats.split_bf16_residual8`): the master is the BF16
  parameter plus its rounding error in 1/128 units of half a BF16 ULP, 1 byte instead of 4. It holds
  16 significant bits, not FP32's 24: storing rounds the FP32 value to that grid to nearest (ties
  away from zero), so an update under half the grid's step (2^-16 of the weight) is lost, as one
  under 2^-24 is in an FP32 master, and reading gives the stored value back exactly. Nearest rather
  than stochastic rounding: the codec stays a function of the value alone, so that every reader and
  writer (checkpoints, torch's fused kernel, a change of storage) agrees without random bits, and an
  AdamW step (about the learning rate in magnitude) is lost only where it falls under 2^-17 of the
  weight, a ten-thousandth of a BF16 ULP's share where BF16 alone loses it.

Each form is a master codec (:class:`~megatron_lowprec.optim.codecs.MasterCodec`: its key, its
dtype, join and split). Every reader and writer of a master (the reference kernel, torch's fused
kernel for option D, the update-quality pieces, state dicts and checkpoints) goes through the codec,
or through :func:`master_value` and :func:`store_master_`, which find it by the stored tensor's
dtype, so the masters are the same bits in either form, eager and compiled.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from megatron_lowprec.optim.codecs import MASTER_CODECS, RemainderMaster, Residual8Master, master_codec_of
from megatron_lowprec.optim.strategies import PrecisionStrategy

MASTER_KEYS = {storage: codec.key for storage, codec in MASTER_CODECS.items()}
"""The state key of the stored master for each ``master_storage``."""

REMAINDER_DTYPE = RemainderMaster.dtype
RESIDUAL_DTYPE = Residual8Master.dtype
MASTER_DTYPES = {storage: codec.dtype for storage, codec in MASTER_CODECS.items()}
"""The dtype of the stored master for each ``master_storage``: the forms are told apart by it."""


def master_key(strategy: PrecisionStrategy) -> str:
    """The state key under which ``strategy`` stores its master."""
    return MASTER_CODECS[strategy.master_storage].key


def stored_master(state: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """The stored master of a state (FP32 master, int16 remainder or int8 residual), or ``None`` if it keeps none."""
    for key in MASTER_KEYS.values():
        if key in state:
            return state[key]
    return None


def master_value(param: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
    """The FP32 master of ``param``: ``stored`` itself when it is the FP32 master (updated in place
    by whoever writes it), else ``param`` joined with the remainder or residual ``stored`` (a new tensor)."""
    return master_codec_of(stored).join(param, stored)


def split_master(value: torch.Tensor, stored_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 masters ``value`` as the BF16 parameters and the stored pieces of dtype ``stored_dtype``
    (int16 remainders or int8 residuals) that :func:`master_value` joins."""
    return master_codec_of(stored_dtype).split(value)


def store_master_(param: torch.Tensor, stored: torch.Tensor, value: torch.Tensor) -> None:
    """Make FP32 ``value`` the master of ``param``: the whole form stores it and rounds the parameter
    to nearest (a cast); the remainder and residual forms split it into the parameter and the stored piece."""
    master_codec_of(stored).store_tensor_(param, stored, value)


def store_masters_(params: list[torch.Tensor], stored: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    """:func:`store_master_` over lists of pieces, ``values`` from :func:`master_value` (whole
    masters: the stored pieces themselves, copied to the parameters in one multi-tensor call)."""
    if all(piece.dtype == torch.float32 and value is piece for piece, value in zip(stored, values)):
        torch._foreach_copy_(params, values)
        return
    for param, piece, value in zip(params, stored, values):
        store_master_(param, piece, value)


REMAINDER_TIE = -(1 << 15)
"""The remainder of an FP32 value exactly halfway between two BF16 values (low 16 bits 0x8000)."""


def copies_off_nearest_even(param: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
    """How many BF16 copies ``param`` of the remainder masters ``stored`` differ from the masters
    rounded to nearest even (torch's cast, the whole form's copy): the exact ties, whose copy is
    rounded away from zero onto an odd last bit where the cast keeps the even one below (a 0-d
    int64 tensor on the device)."""
    odd = (param.view(torch.int16) & 1) == 1
    return ((stored == REMAINDER_TIE) & odd).sum()


def new_master(strategy: PrecisionStrategy, numel: int, like: torch.Tensor) -> torch.Tensor:
    """A flat, zero stored master of ``strategy`` for ``numel`` elements on ``like``'s device: fill
    it from the parameters with :func:`reset_master_`."""
    return like.new_zeros(numel, dtype=strategy.param_codec.dtype)


def reset_master_(param: torch.Tensor, stored: torch.Tensor) -> None:
    """Restart the master from the 16-bit ``param`` (same shape as ``stored``): its exact FP32 value,
    or a zero remainder or residual (a BF16 value is its own upper half)."""
    master_codec_of(stored).reset_(param, stored)


def check_master_param_dtype(param: torch.Tensor, strategy: PrecisionStrategy, where: str) -> None:
    """``ValueError`` if ``strategy`` stores its master below the parameter and ``param`` is not BF16."""
    if strategy.master_weights and strategy.param_codec.below_bf16 and param.dtype != torch.bfloat16:
        raise ValueError(
            f"option {strategy.name!r} with master_storage={strategy.master_storage!r} keeps the FP32 master's upper half in "
            f"the BF16 parameter; {where} of shape {tuple(param.shape)} has dtype {param.dtype}: use "
            "bfloat16 parameters or master_storage='fp32'"
        )
