"""Option D's step: torch's own fused AdamW kernel on the FP32 master, then the 16-bit copy.

Strategies with ``adam_kernel="torch_fused"`` (Collage option D: BF16 model, FP32 master weights and
FP32 moments) do not run this package's specification of the Adam update but the kernel of
``torch.optim.AdamW(fused=True)`` itself, ``torch._fused_adamw_`` (CPU since torch 2.4, CUDA since
2.0): the FP32 master then follows torch bit for bit on the same device, at torch's speed, and
the 16-bit parameter is its nearest rounding, written in one more pass.

The eager step (one parameter), the fused step (one flat bucket) and the distributed optimizer (one
shard) all call :func:`torch_fused_adamw_step_`; a bucket's entries are passed as separate tensors,
as torch passes its parameters, because torch's CPU kernel runs the last ``numel % vector width``
elements of each tensor through a separately compiled scalar loop, which need not round as its
vector loop. The kernel wants FP32 gradients: 16-bit gradients are converted in windows of at most
:data:`WINDOW_ELEMENTS` of the flat state (every window edge a multiple of :data:`WINDOW_ALIGNMENT`,
so that windows split entries only between whole vectors), which bounds the step's temporaries;
FP32 gradients are used in place. Gradients and 16-bit parameters may live anywhere (the bucket's
buffers, or megatron's DDP buffers): each entry's are passed as flat views.

A master stored as the BF16 parameter plus an int16 remainder (``master_storage="remainder"``,
``optim/master.py``) is joined into FP32 pieces of the same windows, updated there by the same
kernel call, and split back: the same kernel on the same FP32 values, so the same masters bit for bit.
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch

from megatron_lowprec.metrics.update_quality import update_quality_pieces
from megatron_lowprec.optim.master import master_value, store_masters_

WINDOW_ELEMENTS = 1 << 22
"""16-bit gradients are converted to FP32 (and tracked updates computed in FP64) in windows of at most
this many elements: 16 MiB of FP32 scratch, a few launches per window."""

WINDOW_ALIGNMENT = 128
"""Window edges are multiples of this many elements (a multiple of every CPU vector width, and the
bucket alignment, so that each tensor's scalar tail stays where torch has it)."""


@functools.cache
def _kernel_available(device_type: str) -> str | None:
    """``None`` if ``torch._fused_adamw_`` runs on ``device_type`` here, else why not."""
    fused_adamw = getattr(torch, "_fused_adamw_", None)
    if fused_adamw is None:
        return "torch._fused_adamw_ does not exist"
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else device_type
    one = [torch.ones(1, device=device)]
    try:
        fused_adamw(
            one, [torch.ones(1, device=device)], [torch.zeros(1, device=device)], [torch.zeros(1, device=device)],
            [], [torch.ones((), device=device)], lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8,
            amsgrad=False, maximize=False,
        )
    except (RuntimeError, TypeError, NotImplementedError) as error:
        return f"torch._fused_adamw_ failed on {device_type}: {error}"
    return None


class MasterWindows(Protocol):
    """A remainder master joined and split a window [start, end) of the flat state at a time (one
    pass each, where the 16-bit parameters sit in a buffer of the state's layout)."""

    def join(self, start: int, end: int) -> torch.Tensor:
        """The window's FP32 masters, a new flat tensor."""

    def split_(self, start: int, end: int, masters: torch.Tensor) -> None:
        """Store the window's FP32 ``masters`` into its parameters and remainders."""


def require_torch_fused_adamw(device: torch.device, option: str) -> None:
    """Raise ``RuntimeError`` if torch's fused AdamW kernel cannot run on ``device`` (checked once per device type)."""
    reason = _kernel_available(device.type)
    if reason is not None:
        raise RuntimeError(
            f"option {option!r} updates its FP32 master with torch's fused AdamW kernel "
            f"(torch.optim.AdamW(fused=True); CPU needs torch >= 2.4), which torch {torch.__version__} "
            f"cannot run on {device.type}: {reason}"
        )


def _windows(
    spans: list[tuple[int, int]], numel: int, grads: list[torch.Tensor], master: torch.Tensor, track_update_quality: bool
) -> list[tuple[int, int]]:
    """Ranges of the flat state of at most :data:`WINDOW_ELEMENTS` over the entries at ``spans``
    (edges at multiples of :data:`WINDOW_ALIGNMENT`, the first at the first entry), or the whole
    state when FP32 gradients and an FP32 master are used in place untracked."""
    if all(grad.dtype == torch.float32 for grad in grads) and master.dtype == torch.float32 and not track_update_quality:
        return [(0, numel)]
    first = spans[0][0] // WINDOW_ALIGNMENT * WINDOW_ALIGNMENT
    last = min(-(-(spans[-1][0] + spans[-1][1]) // WINDOW_ALIGNMENT) * WINDOW_ALIGNMENT, numel)
    return [(start, min(start + WINDOW_ELEMENTS, last)) for start in range(first, last, WINDOW_ELEMENTS)]


def _pieces(spans: list[tuple[int, int]], start: int, end: int) -> list[tuple[int, int, int]]:
    """The parts of the entries at ``spans`` ((offset, numel) in the flat state) inside [start, end):
    (entry, first element, end element), relative to the entry."""
    pieces = []
    for index, (offset, numel) in enumerate(spans):
        low, high = max(offset, start), min(offset + numel, end)
        if high > low:
            pieces.append((index, low - offset, high - offset))
    return pieces


def _fused_adamw(masters, grads, exp_avgs, exp_avg_sqs, step, hyper) -> None:
    """One ``torch._fused_adamw_`` call over lists of tensors (as torch.optim.AdamW(fused=True))."""
    torch._fused_adamw_(
        masters, grads, exp_avgs, exp_avg_sqs, [], [step] * len(masters), amsgrad=False, maximize=False, **hyper
    )


@torch.no_grad()
def torch_fused_adamw_step_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    spans: list[tuple[int, int]],
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    track_update_quality: bool,
    master_windows: MasterWindows | None = None,
) -> torch.Tensor | None:
    """One AdamW step, in place, of the entries at ``spans`` ((offset, numel) pairs) of the flat
    stored ``master`` (the FP32 master, or the int16 remainder below BF16 parameters:
    ``optim/master.py``) and the flat FP32 ``exp_avg`` and ``exp_avg_sq``, with ``grads`` (each
    entry's flat gradient, wherever it lives) and ``step`` counting this step; each entry's flat
    16-bit parameter in ``params`` becomes its master's 16-bit copy. A handful of launches per
    window, whatever the number of entries (torch's multi-tensor kernels). A remainder master is
    joined and split per entry, or per window by ``master_windows`` where the caller has them.

    With ``track_update_quality`` the intended update is the same kernel's update computed in
    float64 from the same state, and the effective update the change of the FP32 master; the
    update-quality pieces (an FP64 tensor on the master's device) are returned.
    """
    device = master.device
    step_tensor = torch.full((), float(step), dtype=torch.float32, device=device)
    hyper = dict(lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps)
    quality = master.new_zeros(4, dtype=torch.float64) if track_update_quality else None
    windows = _windows(spans, master.numel(), grads, master, track_update_quality)
    in_place = all(grad.dtype == torch.float32 for grad in grads)
    scratch = None if in_place else torch.empty(windows[0][1] - windows[0][0], dtype=torch.float32, device=device)
    for start, end in windows:
        pieces = _pieces(spans, start, end)
        if not pieces:
            continue

        def split(flat):
            return [flat[spans[index][0] + low : spans[index][0] + high] for index, low, high in pieces]

        window_grads = [grads[index][low:high] for index, low, high in pieces]
        if not in_place:
            sizes = [high - low for _, low, high in pieces]
            converted = list(scratch[: sum(sizes)].split(sizes))
            torch._foreach_copy_(converted, window_grads)
            window_grads = converted
        window_params = [params[index][low:high] for index, low, high in pieces]
        stored, exp_avgs, exp_avg_sqs = split(master), split(exp_avg), split(exp_avg_sq)
        if master_windows is None:
            masters = [master_value(param, piece) for param, piece in zip(window_params, stored)]
        else:
            joined = master_windows.join(start, end)
            masters = [joined[spans[index][0] + low - start : spans[index][0] + high - start] for index, low, high in pieces]
        if track_update_quality:
            before = [piece.double() for piece in masters]
            intended = [piece.clone() for piece in before]
            _fused_adamw(
                intended, [grad.double() for grad in window_grads], [piece.double() for piece in exp_avgs],
                [piece.double() for piece in exp_avg_sqs], step_tensor, hyper,
            )
        _fused_adamw(masters, window_grads, exp_avgs, exp_avg_sqs, step_tensor, hyper)
        if master_windows is None:
            store_masters_(window_params, stored, masters)
        else:
            master_windows.split_(start, end, joined)
        if track_update_quality:
            for intended_piece, before_piece, master_piece in zip(intended, before, masters):
                quality += update_quality_pieces(intended_piece - before_piece, before_piece, master_piece)
    return quality
