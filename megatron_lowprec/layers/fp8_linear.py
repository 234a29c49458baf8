"""COAT's FP8 linear layer (Xi et al., 2024, section 5.2): E4M3 forward, E5M2 output gradients.

Forward: the input X and the weight W are quantized to E4M3 per tensor with current scaling,

    scale = amax / 448,    payload = RNE_E4M3(x / scale)    (numerics/quant.py's formula, one group),

with amax = max|x| (COAT's Group Scaling takes it in two stages, per 1 x G group and then over the
groups, so that a kernel can fuse the first stage into the producer of x; the maximum is exact in any
order). On GPUs that convert FP8 in Triton the maximum, the division and the cast are one compiled
call (``numerics/quant.py: quantize_matrix``), which reads x twice and writes one byte per element,
and, where the GEMMs run on ``torch._scaled_mm``, also the transposed payload that a backward GEMM
takes, from the same kernel (Transformer Engine's row- and column-major FP8 copies); elsewhere they
are eager operations, the same bits. The product
E4M3(X) E4M3(W)^T is accumulated in FP32 and returned in the input's dtype. Backward: the output
gradient dY is quantized to E5M2 per tensor; dX = E5M2(dY) E4M3(W) and dW = E5M2(dY)^T E4M3(X).
Only the FP8 input and its scale are saved for backward: W is a parameter (no activation memory)
and is quantized again in backward, to the same payload.

Inside :func:`fp8_weight_cache` (one optimizer step's forward and backward passes over all its
micro-batches) each weight is quantized once, on first use, and its E4M3 payload and scale serve
every forward and backward pass until the block ends, as COAT keeps the FP8 weight of a step. The
payload is what re-quantizing the unchanged weight would give, so the results are the same bits;
the cache holds one byte per weight element while the block runs, two where the quantization also
writes the transposed payload for backward (:func:`transposes_in_quantization`; Transformer Engine's
FP8 weights keep both layouts so too), which then no backward pass copies.

Matmuls run on ``torch._scaled_mm`` on GPUs that have it (compute capability >= 8.9, every
dimension a multiple of 16, not both operands E5M2), else they are emulated: dequantize to FP32
(payload * scale), FP32 matmul, cast to the output dtype. On CPUs "auto" emulates too: torch's CPU
``_scaled_mm`` is orders of magnitude slower than the emulation, and it sums the exact FP8 products
in FP32 in an order it picks by instruction set (AVX2, AVX-512, AMX), so the two backends agree
within FP32 summation error, not bit for bit; ``backend="scaled_mm"`` still asks for it.
Non-finite inputs give NaN outputs or gradients (the optimizer then skips the step).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from megatron_lowprec.numerics.compiled import compiled_where_fp8_converts, triton_converts_fp8
from megatron_lowprec.numerics.quant import fp8_dtype_of, quantize_matrix, quantize_rows

BACKENDS = ("auto", "scaled_mm", "emulated")
E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2

_weight_cache: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]] | None = None
"""While :func:`fp8_weight_cache` runs: id(weight) -> (weight, E4M3 payload, scale, the payload's
transpose laid out row-major or None: :func:`transposes_in_quantization`); holding the weight keeps
its id from being reused. A module global rather than a context variable, because
autograd runs CUDA backward passes in its own threads."""


@contextlib.contextmanager
def fp8_weight_cache() -> Iterator[None]:
    """Quantize each weight to E4M3 once while the block runs and reuse it in every forward and
    backward pass inside (COAT's FP8 weight of one step, shared by its micro-batches). The weights
    must not change inside the block: wrap one step's forward and backward passes, not its optimizer
    update. Nested blocks share the outermost cache."""
    global _weight_cache
    outer = _weight_cache
    if outer is None:
        _weight_cache = {}
    try:
        yield
    finally:
        _weight_cache = outer


def _cached_weight(weight: torch.Tensor, transposed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """The E4M3 payload, scale and (if ``transposed`` on first use, else None) transposed payload of
    ``weight`` from the active cache (quantized on first use), or None outside :func:`fp8_weight_cache`."""
    if _weight_cache is None:
        return None
    cached = _weight_cache.get(id(weight))
    if cached is None:
        if transposed:
            payload, payload_transposed, scale = quantize_matrix(weight, E4M3, column_major=True)
            cached = (weight, payload, scale, payload_transposed)
        else:
            cached = (weight, *quantize_per_tensor(weight, E4M3), None)
        _weight_cache[id(weight)] = cached
    return cached[1:]


def quantize_per_tensor(x: torch.Tensor, fp8_format: str | torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(payload, scale): x ~ payload * scale, one float32 scale = amax / fp8_max (1 for an all-zero x).

    ``fp8_format`` is "e4m3" or "e5m2" (or the torch dtype); the cast is torch's round-to-nearest-even.
    The scale is the correctly rounded quotient on every device (eager CUDA multiplies a tensor by a
    Python float's reciprocal instead of dividing, which can be 1 ulp off). x is quantized as
    one row by :func:`~megatron_lowprec.numerics.quant.quantize_rows` (one compiled call on GPUs that
    convert FP8 in Triton).
    """
    fp8_dtype = fp8_dtype_of(fp8_format)
    if x.numel() == 0:
        return torch.empty(x.shape, dtype=fp8_dtype, device=x.device), torch.ones((), dtype=torch.float32, device=x.device)
    payload, scale = quantize_rows(x.reshape(1, -1), fp8_dtype)
    return payload.view(x.shape), scale.view(())


def _scaled_mm_chosen(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether "auto" runs ``a @ b`` on ``torch._scaled_mm``: on GPUs that support these operands."""
    if a.device.type != "cuda" or torch.cuda.get_device_capability(a.device) < (8, 9):
        return False
    both_e5m2 = a.dtype == b.dtype == E5M2
    return not both_e5m2 and all(size % 16 == 0 for size in (*a.shape, b.shape[1]))


def transposes_in_quantization(backend: str, device: torch.device, sizes: tuple[int, ...]) -> bool:
    """Whether the quantizing calls of a linear of GEMM sizes ``sizes`` (M, K, N) also write the
    transposed FP8 payloads its backward GEMMs take (:func:`~megatron_lowprec.numerics.quant.quantize_matrix`:
    one kernel writes both layouts): where those GEMMs run on ``torch._scaled_mm`` and Inductor
    compiles the quantization (a GPU that converts FP8 in Triton, every size a multiple of 16 for
    "auto"). Elsewhere the backward's operands are transposed views, which :func:`row_major` copies
    where a GEMM needs it."""
    if backend == "emulated" or not triton_converts_fp8(device):
        return False
    return backend == "scaled_mm" or all(size % 16 == 0 for size in sizes)


def _copied(payload: torch.Tensor) -> torch.Tensor:
    return payload.contiguous()


def row_major(payload: torch.Tensor) -> torch.Tensor:
    """``payload`` laid out row-major, as ``torch._scaled_mm`` takes its first operand (and the
    transpose of its second). Where :func:`transposes_in_quantization` holds, the quantization wrote
    the backward pass's operands so and nothing is copied; elsewhere they are transposed views, and
    where Inductor compiles FP8 (:func:`~megatron_lowprec.numerics.compiled.triton_converts_fp8`)
    they are copied by one compiled kernel that reads and writes tiles (ATen's strided copy of FP8
    payloads is slow on GPUs), elsewhere by ``contiguous()``."""
    return payload if payload.is_contiguous() else compiled_where_fp8_converts(_copied, payload.device)(payload)


def fp8_matmul(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    backend: str = "auto",
) -> torch.Tensor:
    """(a * a_scale) @ (b * b_scale) for FP8 ``a`` [M, K] and ``b`` [K, N], FP32 accumulation, in ``out_dtype``.

    ``backend``: "scaled_mm" (torch._scaled_mm), "emulated" (dequantize, FP32 matmul) or "auto"
    (scaled_mm on GPUs that support it, see the module docstring).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown FP8 matmul backend {backend!r}; valid: {', '.join(BACKENDS)}")
    if backend == "scaled_mm" or (backend == "auto" and _scaled_mm_chosen(a, b)):
        if a.is_cuda:
            a, b = row_major(a), row_major(b.t()).t()
        return torch._scaled_mm(a, b, scale_a=a_scale, scale_b=b_scale, out_dtype=out_dtype)
    return ((a.float() * a_scale) @ (b.float() * b_scale)).to(out_dtype)


class FP8LinearFunction(torch.autograd.Function):
    """y = x W^T + b with E4M3 operands forward and an E5M2 output gradient backward (COAT section 5.2).

    Where :func:`transposes_in_quantization` holds, the quantizations write the transposed payloads
    the backward GEMMs take (X^T for dW, W^T for dX, dY^T for dW) in the kernel that casts, and
    backward keeps X only as its transposed payload (the same bytes as the row-major one)."""

    @staticmethod
    def forward(ctx, input, weight, bias, backend):
        input_rows = input.reshape(-1, input.shape[-1])
        transposed = transposes_in_quantization(backend, input.device, (*input_rows.shape, weight.shape[0]))
        if transposed:
            input_fp8, input_fp8_t, input_scale = quantize_matrix(input_rows, E4M3, column_major=True)
        else:
            input_fp8, input_scale = quantize_per_tensor(input_rows, E4M3)
        cached = _cached_weight(weight, transposed)
        weight_fp8, weight_scale, weight_fp8_t = cached if cached is not None else (*quantize_per_tensor(weight, E4M3), None)
        output = fp8_matmul(input_fp8, input_scale, weight_fp8.t(), weight_scale, input.dtype, backend)
        if bias is not None:
            output = output + bias
        ctx.weight_cached = cached is not None
        ctx.transposed = transposed
        saved_input = input_fp8_t.t() if transposed else input_fp8
        weight_saved = (weight_fp8_t.t() if weight_fp8_t is not None else weight_fp8, weight_scale) if cached is not None else (weight,)
        ctx.save_for_backward(saved_input, input_scale, *weight_saved)
        ctx.weight_dtype = weight.dtype
        ctx.backend = backend
        ctx.input_shape = input.shape
        ctx.input_dtype = input.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return output.view(*input.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_output):
        input_fp8, input_scale, *weight_saved = ctx.saved_tensors
        grad_rows = grad_output.reshape(-1, grad_output.shape[-1])
        grad_input = grad_weight = grad_bias = None
        if ctx.transposed and (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]):
            grad_fp8, grad_fp8_t, grad_scale = quantize_matrix(
                grad_rows, E5M2, row_major=ctx.needs_input_grad[0], column_major=ctx.needs_input_grad[1]
            )
        elif not ctx.transposed:
            grad_fp8, grad_scale = quantize_per_tensor(grad_rows, E5M2)
        if ctx.needs_input_grad[0]:
            if ctx.weight_cached:
                weight_fp8, weight_scale = weight_saved
            elif ctx.transposed:
                _, weight_fp8_t, weight_scale = quantize_matrix(weight_saved[0], E4M3, row_major=False, column_major=True)
                weight_fp8 = weight_fp8_t.t()
            else:
                weight_fp8, weight_scale = quantize_per_tensor(weight_saved[0], E4M3)
            grad_input = fp8_matmul(
                grad_fp8, grad_scale, weight_fp8, weight_scale, ctx.input_dtype, ctx.backend
            ).view(ctx.input_shape)
        if ctx.needs_input_grad[1]:
            grad_fp8_t = grad_fp8_t if ctx.transposed else grad_fp8.t()
            grad_weight = fp8_matmul(grad_fp8_t, grad_scale, input_fp8, input_scale, ctx.weight_dtype, ctx.backend)
        if ctx.needs_input_grad[2]:
            grad_bias = grad_rows.sum(dim=0).to(ctx.bias_dtype)
        return grad_input, grad_weight, grad_bias, None


def check_linear_operands(input: torch.Tensor, weight: torch.Tensor) -> None:
    """``ValueError`` unless ``weight`` is [out_features, in_features] with in_features = input.shape[-1]."""
    if weight.dim() != 2 or input.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"input of shape {tuple(input.shape)} does not match weight of shape {tuple(weight.shape)}: "
            "the weight must be [out_features, in_features] with in_features = input.shape[-1]"
        )


def fp8_linear(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, backend: str = "auto"
) -> torch.Tensor:
    """``torch.nn.functional.linear`` through COAT's FP8 flow (FP8LinearFunction); any leading dims."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown FP8 matmul backend {backend!r}; valid: {', '.join(BACKENDS)}")
    check_linear_operands(input, weight)
    return FP8LinearFunction.apply(input, weight, bias, backend)


class FP8Linear(torch.nn.Linear):
    """Drop-in ``torch.nn.Linear`` whose forward and backward run through :func:`fp8_linear`."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return fp8_linear(input, self.weight, self.bias)
