"""Option D's step: torch's own fused AdamW kernel on the FP32 master, then the 16-bit copy.

Strategies with ``adam_kernel="torch_fused"`` (Collage option D: BF16 model, FP32 master weights and
FP32 moments) do not run this package's specification of the Adam update but the kernel of
``torch.optim.AdamW(fused=True)`` itself, ``torch._fused_adamw_`` (CPU since torch 2.4, CUDA since
2.0): the FP32 master then follows torch bit for bit on the same device, at torch's speed, and
the 16-bit parameter is its nearest rounding, written in one more pass.

The eager step (one parameter) and the fused step (one flat bucket) both call
:func:`torch_fused_adamw_step_`; a bucket's parameters are passed as separate tensors, as torch
passes its parameters, because torch's CPU kernel runs the last ``numel % vector width`` elements
of each tensor through a separately compiled scalar loop, which need not round as its vector loop. The kernel wants FP32 gradients:
16-bit gradients are converted in windows of at most 1/:data:`WINDOWS_PER_MASTER` of the master
(every window start a multiple of :data:`WINDOW_ALIGNMENT`, so that windows split tensors only
between whole vectors), which bounds the step's temporaries; FP32 gradients are used in place.

A master stored as the BF16 parameter plus an int16 remainder (``master_storage="remainder"``,
``optim/master.py``) is joined into an FP32 window of the same bounds, updated there by the same
kernel call, and split back: the same kernel on the same FP32 values, so the same masters bit for bit.
"""

from __future__ import annotations

import functools

import torch

from megatron_lowprec.metrics.update_quality import update_quality_pieces
from megatron_lowprec.optim.master import master_value, store_master_

WINDOWS_PER_MASTER = 100
"""A 16-bit gradient is converted to FP32 in windows of at most 1/100 of the master (1% of its bytes)."""

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


def require_torch_fused_adamw(device: torch.device, option: str) -> None:
    """Raise ``RuntimeError`` if torch's fused AdamW kernel cannot run on ``device`` (checked once per device type)."""
    reason = _kernel_available(device.type)
    if reason is not None:
        raise RuntimeError(
            f"option {option!r} updates its FP32 master with torch's fused AdamW kernel "
            f"(torch.optim.AdamW(fused=True); CPU needs torch >= 2.4), which torch {torch.__version__} "
            f"cannot run on {device.type}: {reason}"
        )


def _windows(numel: int, grad: torch.Tensor, master: torch.Tensor, track_update_quality: bool) -> list[tuple[int, int]]:
    if grad.dtype == torch.float32 and master.dtype == torch.float32 and not track_update_quality:
        return [(0, numel)]
    size = max(numel // WINDOWS_PER_MASTER // WINDOW_ALIGNMENT, 1) * WINDOW_ALIGNMENT
    return [(start, min(start + size, numel)) for start in range(0, numel, size)]


def _pieces(spans: list[tuple[int, int]], start: int, end: int) -> list[tuple[int, int]]:
    """The parts of the tensors at ``spans`` ((offset, numel) in the flat buffers) inside [start, end),
    relative to ``start``."""
    pieces = []
    for offset, numel in spans:
        low, high = max(offset, start), min(offset + numel, end)
        if high > low:
            pieces.append((low - start, high - start))
    return pieces


def _fused_adamw(master, grad, exp_avg, exp_avg_sq, pieces, step, hyper) -> None:
    """One ``torch._fused_adamw_`` call over the ``pieces`` of the flat tensors (as torch.optim.AdamW(fused=True))."""
    def split(flat):
        return [flat[low:high] for low, high in pieces]

    masters = split(master)
    torch._fused_adamw_(
        masters, split(grad), split(exp_avg), split(exp_avg_sq), [], [step] * len(masters),
        amsgrad=False, maximize=False, **hyper,
    )


@torch.no_grad()
def torch_fused_adamw_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
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
) -> torch.Tensor | None:
    """One AdamW step, in place, of the tensors at ``spans`` ((offset, numel) pairs) of the flat
    16-bit ``param``, its ``grad``, the flat stored ``master`` (the FP32 master, or the int16
    remainder below a BF16 ``param``: ``optim/master.py``) and the flat FP32 ``exp_avg`` and
    ``exp_avg_sq`` (``step`` counts this step); the parameter becomes the master's 16-bit copy.

    With ``track_update_quality`` the intended update is the same kernel's update computed in
    float64 from the same state, and the effective update the change of the FP32 master; the
    update-quality pieces (an FP64 tensor on the master's device) are returned.
    """
    device = master.device
    step_tensor = torch.full((), float(step), dtype=torch.float32, device=device)
    hyper = dict(lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps)
    quality = master.new_zeros(4, dtype=torch.float64) if track_update_quality else None
    windows = _windows(master.numel(), grad, master, track_update_quality)
    scratch = None if grad.dtype == torch.float32 else torch.empty(windows[0][1], dtype=torch.float32, device=device)
    for start, end in windows:
        pieces = _pieces(spans, start, end)
        if not pieces:
            continue
        window_grad = grad[start:end] if scratch is None else scratch[: end - start].copy_(grad[start:end])
        window_param, window_stored = param[start:end], master[start:end]
        window_master = master_value(window_param, window_stored)
        if track_update_quality:
            before = window_master.double()
            intended = before.clone()
            _fused_adamw(
                intended, window_grad.double(), exp_avg[start:end].double(), exp_avg_sq[start:end].double(),
                pieces, step_tensor, hyper,
            )
            intended -= before
        _fused_adamw(window_master, window_grad, exp_avg[start:end], exp_avg_sq[start:end], pieces, step_tensor, hyper)
        store_master_(window_param, window_stored, window_master)
        if track_update_quality:
            quality += update_quality_pieces(intended, before, window_master)
    return quality
