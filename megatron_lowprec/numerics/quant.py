"""Per-tensor and per-group FP8 quantization with COAT dynamic range expansion.

COAT (Xi et al., 2024), section 3: a tensor is cut into groups of ``G`` consecutive elements
(1 x G along the flattened tensor; one group for per-tensor quantization). Each group is scaled so
that its largest magnitude lands on the format's largest finite value, then cast to FP8 with
round-to-nearest-even:

    scale = max|x| / fp8_max,    payload = RNE_fp8(x / scale),    x ~ payload * scale.

Dynamic range expansion (section 4.2) first applies ``f(x) = sign(x) |x|^k`` per group, with
``k = log_{R_X}(R_fmt)``: ``R_X = max|x| / min|x|`` over the group's non-zero elements and
``R_fmt = fp8_max / smallest positive subnormal`` (E4M3: 448 / 2^-9 = 229376, the paper's figure;
E5M2: 57344 / 2^-16 = 3758096384, the paper's Delta_max / Delta_min for E5M2), so that ``f(X)``
spans the whole format. To stay finite the expansion acts on the group normalised by its maximum
``M = max|x|``:

    payload = RNE_fp8(fp8_max * f(x / M)),    x ~ M * f^{-1}(payload / fp8_max).

``k`` follows the paper's formula without clamping: ``k > 1`` widens a group narrower than the
format, ``k < 1`` narrows a group wider than the format (its smallest elements then stay non-zero
instead of underflowing). Groups without two distinct non-zero magnitudes get ``k = 1``.
``k`` is stored per group in float32, or in bfloat16 (2 bytes instead of 4): then ``k`` is rounded
toward zero to bfloat16 before the expansion uses it, so that the stored ``k`` inverts it exactly
and, being at most COAT's, leaves the group's smallest element at or above the smallest subnormal.
All arithmetic is float32 tensor code, device-agnostic; the caller's device is kept.

Every division is correctly rounded and ``log``/``pow`` are this package's own
(:mod:`megatron_lowprec.numerics.elementary`), so that eager code and code that Inductor compiles
for a CPU or a GPU quantize to the same FP8 codes, scales and exponents; ``k`` is computed as
``log2(R_fmt) / -log2(min|x| / M)``.

Companded INT8 groups (FlashOptim, arXiv 2602.23349: a spec per optimizer state) are the other
8-bit moment codec, on the same 1 x G groups. Each group stores one BF16 scale ``s``, its largest
magnitude rounded toward zero to BF16 (2 bytes; at least the smallest normal FP32 value, 1 for an
all-zero group), and per element one byte:

* a signed state (AdamW's m, Muon's momentum) as an int8 code of FlashOptim's softsign companding of
  ``n = x / s`` (clamped to [-1, 1]): ``q = RNE(127 · 2n / (1 + |n|))`` in [-127, 127], decoded by
  its inverse ``n = q / (254 - |q|)``, ``x ~ s · n``. The companding's slope is 2 at zero and 1/2
  at the group's maximum, so small elements get steps four times finer than large ones;
* a non-negative state (AdamW's v) as a uint8 code of its square root, linear:
  ``q = RNE(255 · sqrt(x) / s)`` with ``s`` the group's largest square root, decoded as
  ``x ~ (q · s / 255)^2``.

FlashOptim's scales are FP16 per 32 values; here they are BF16 per group of G (128 for the lean
options, the FP8 groups' grid), since groups of small gradients have scales below FP16's smallest
subnormal (2^-24), and 2 bytes per 128 values keep the lean options under their byte budgets. The
scale is rounded before it is used, so decoding with the stored scale inverts what was encoded.
"""

import math
from dataclasses import dataclass

import torch

from megatron_lowprec.numerics.compiled import compiled_where_fp8_converts
from megatron_lowprec.numerics.elementary import div_rn, log2, power, sqrt_rn
from megatron_lowprec.numerics.formats import from_fp8_codes, round_to_bfloat16_toward_zero, to_fp8_codes

_FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
EXPONENT_STORAGES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""The dtypes a group's expansion exponent k is stored in, by name."""


def exponent_dtype_of(storage: "str | torch.dtype") -> torch.dtype:
    """The dtype of expansion exponents stored as ``storage`` ("fp32", "bf16", or the dtype)."""
    if isinstance(storage, torch.dtype) and storage in EXPONENT_STORAGES.values():
        return storage
    if isinstance(storage, str) and storage in EXPONENT_STORAGES:
        return EXPONENT_STORAGES[storage]
    raise ValueError(f"expansion exponents cannot be stored as {storage!r}; valid: {', '.join(EXPONENT_STORAGES)}")


def fp8_dtype_of(fp8_format: "str | torch.dtype") -> torch.dtype:
    """The torch float8 dtype named by ``fp8_format`` ("e4m3", "e5m2", any case, or the dtype)."""
    if isinstance(fp8_format, torch.dtype) and fp8_format in _FORMATS.values():
        return fp8_format
    if isinstance(fp8_format, str) and fp8_format.lower() in _FORMATS:
        return _FORMATS[fp8_format.lower()]
    valid = ", ".join([*_FORMATS, *(str(dtype) for dtype in _FORMATS.values())])
    raise ValueError(f"unknown FP8 format {fp8_format!r}; valid: {valid}")


def payload_format(payload: torch.Tensor, fp8_dtype: "str | torch.dtype | None" = None) -> torch.dtype:
    """The FP8 dtype of ``payload``: its own dtype, or, for a uint8 payload of integer codes
    (:func:`~megatron_lowprec.numerics.formats.to_fp8_codes`: a device whose compiler has no FP8
    conversion), ``fp8_dtype``, which must then be given."""
    if payload.dtype == torch.uint8:
        if fp8_dtype is None:
            raise ValueError("a uint8 payload holds FP8 codes of a format that fp8_dtype must name (e4m3 or e5m2)")
        return fp8_dtype_of(fp8_dtype)
    own = fp8_dtype_of(payload.dtype)
    if fp8_dtype is not None and fp8_dtype_of(fp8_dtype) != own:
        raise ValueError(f"payload of dtype {payload.dtype} given with fp8_dtype={fp8_dtype!r}")
    return own


def _payload_values(payload: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """The payload's values in float32 (a cast, or the decoding of integer codes)."""
    return from_fp8_codes(payload, fp8_dtype) if payload.dtype == torch.uint8 else payload.float()


def fp8_max(fp8_dtype: torch.dtype) -> float:
    """Largest finite value of the format (COAT section 3: Delta_max; 448 for E4M3, 57344 for E5M2)."""
    return float(torch.finfo(fp8_dtype).max)


_FP8_MAX_DIVISORS = {dtype: torch.tensor(fp8_max(dtype)) for dtype in _FORMATS.values()}


def _fp8_max_divisor(fp8_dtype: torch.dtype) -> "torch.Tensor | float":
    """:func:`fp8_max` as :func:`div_rn`'s divisor: a 0-d host tensor in compiled code (a compiled
    division by a Python constant becomes a product with its reciprocal, which GPUs would compute in
    FP64), the number in eager code (which :func:`div_rn` fills in on the device)."""
    return _FP8_MAX_DIVISORS[fp8_dtype] if torch.compiler.is_compiling() else fp8_max(fp8_dtype)


def fp8_dynamic_range(fp8_dtype: torch.dtype) -> float:
    """R_fmt = Delta_max / Delta_min, Delta_min the smallest positive subnormal (COAT section 4.1)."""
    info = torch.finfo(fp8_dtype)
    smallest_subnormal = info.smallest_normal * info.eps
    return float(info.max) / smallest_subnormal


def expand_dynamic_range(x: torch.Tensor, expansion_exponent: torch.Tensor) -> torch.Tensor:
    """COAT expand function f(x) = sign(x) |x|^k (section 4.2), for k > 0."""
    return torch.copysign(power(x.abs(), expansion_exponent), x)


def contract_dynamic_range(y: torch.Tensor, expansion_exponent: torch.Tensor) -> torch.Tensor:
    """Inverse of the expand function, f^{-1}(y) = sign(y) |y|^{1/k} (section 4.2), for k > 0."""
    return torch.copysign(power(y.abs(), div_rn(1.0, expansion_exponent)), y)


@dataclass
class QuantizedTensor:
    """An FP8 tensor with per-group float32 scales and, under COAT expansion, per-group exponents k.

    ``scale`` is the group's max|x| / fp8_max (1 for an all-zero group); ``expansion_exponent``
    (float32 or bfloat16, :data:`EXPONENT_STORAGES`) is None when expansion is off; ``group_size``
    None means one group for the whole tensor. The payload is of ``fp8_dtype``, or a uint8 view of
    it (the same bits, read and written as integer codes: :func:`payload_format`).
    """

    payload: torch.Tensor
    scale: torch.Tensor
    expansion_exponent: "torch.Tensor | None"
    group_size: "int | None"
    shape: torch.Size
    fp8_dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Storage in bytes: FP8 payload plus per-group scales and exponents."""
        tensors = [self.payload, self.scale]
        if self.expansion_exponent is not None:
            tensors.append(self.expansion_exponent)
        return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def num_groups(numel: int, group_size: "int | None") -> int:
    """Number of groups of ``group_size`` consecutive elements; the last one may be partial."""
    return -(-numel // _resolved_group_size(numel, group_size))


def _resolved_group_size(numel: int, group_size: "int | None") -> int:
    if group_size is None:
        return max(numel, 1)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int or None, got {group_size!r}")
    return group_size


def _grouped(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """``x`` as (groups, group_size): a view of contiguous ``x`` holding whole groups, else a
    zero-padded copy of its flattening (zeros change neither the group's max|x| nor its smallest
    non-zero |x|)."""
    padding = -x.numel() % group_size
    if padding == 0:
        return x.reshape(-1, group_size)
    return torch.nn.functional.pad(x.reshape(-1), (0, padding)).view(-1, group_size)


def _ungrouped(groups: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_grouped`: the first ``like.numel()`` values in ``like``'s shape."""
    if groups.numel() == like.numel():
        return groups.view(like.shape)
    return groups.view(-1)[: like.numel()].view(like.shape)


def scale_of(group_max: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """The scale of a group whose largest magnitude is ``group_max`` (FP32): ``max|x| / fp8_max``,
    correctly rounded and at least the smallest normal FP32 value; 1 for an all-zero group."""
    return torch.where(
        group_max > 0, div_rn(group_max, _fp8_max_divisor(fp8_dtype)).clamp_min(torch.finfo(torch.float32).tiny), 1.0
    )


def _quantize_rows(rows: torch.Tensor, fp8_dtype: torch.dtype) -> "tuple[torch.Tensor, torch.Tensor]":
    format_max = fp8_max(fp8_dtype)
    values = rows.float()
    scale = scale_of(values.abs().amax(dim=1, keepdim=True), fp8_dtype)
    return div_rn(values, scale).clamp(-format_max, format_max).to(fp8_dtype), scale


def quantize_rows(rows: torch.Tensor, fp8_dtype: "str | torch.dtype") -> "tuple[torch.Tensor, torch.Tensor]":
    """Each row of ``rows`` [groups, G] as one group (section 3, no expansion): the FP8 payload
    [groups, G] and the FP32 scale [groups, 1], the bits :func:`quantize_fp8_into` gives. Where
    Inductor compiles FP8 casts (:func:`~megatron_lowprec.numerics.compiled.triton_converts_fp8`) one
    compiled call (a max reduction and a cast per element, whatever the row count), elsewhere eager
    operations. A NaN dequantizes to NaN, an infinity makes its whole row NaN (its scale is infinite)."""
    fp8_dtype = fp8_dtype_of(fp8_dtype)
    if rows.dim() != 2 or rows.shape[1] == 0:
        raise ValueError(f"rows must be [groups, group_size] with group_size >= 1, got shape {tuple(rows.shape)}")
    return compiled_where_fp8_converts(_quantize_rows, rows.device)(rows.detach(), fp8_dtype)


def _quantize_matrix(
    matrix: torch.Tensor, fp8_dtype: torch.dtype, row_major: bool, column_major: bool
) -> "tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]":
    format_max = fp8_max(fp8_dtype)
    values = matrix.float()
    scale = scale_of(values.abs().amax(), fp8_dtype)

    def cast(layout: torch.Tensor) -> torch.Tensor:
        return div_rn(layout, scale).clamp(-format_max, format_max).to(fp8_dtype)

    return cast(values) if row_major else None, cast(values.t()).contiguous() if column_major else None, scale


def quantize_matrix(
    matrix: torch.Tensor, fp8_dtype: "str | torch.dtype", row_major: bool = True, column_major: bool = False
) -> "tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]":
    """A 2-D ``matrix`` [M, K] quantized per tensor (section 3, one group): (payload [M, K] if
    ``row_major``, its transpose [K, M] laid out row-major if ``column_major``, the 0-d FP32 scale);
    the payload's bits are :func:`quantize_rows`' of the matrix as one row (an empty matrix: scale
    1). The transposed copy is what ``torch._scaled_mm`` takes for a transposed operand (COAT's
    backward GEMMs, section 5.2). Where
    Inductor compiles FP8 casts one compiled call: the maximum's reduction, then one kernel that reads
    each element once and writes both layouts (Transformer Engine's casts emit the row- and
    column-major copies together), so that no kernel copies the FP8 payload to transpose it;
    elsewhere eager operations, the same bits. The compiled call keeps the column count a constant
    of its graph (one graph per column count, format and layouts; the row count stays a symbol): Inductor
    fuses the two layouts' stores into one tiled kernel only where it knows the row length."""
    fp8_dtype = fp8_dtype_of(fp8_dtype)
    if matrix.dim() != 2:
        raise ValueError(f"matrix must be 2-D, got shape {tuple(matrix.shape)}")
    if not (row_major or column_major):
        raise ValueError("quantize_matrix needs row_major=True, column_major=True or both")
    if matrix.numel() == 0:
        empty = torch.empty(matrix.shape, dtype=fp8_dtype, device=matrix.device)
        return empty if row_major else None, empty.t().contiguous() if column_major else None, torch.ones((), device=matrix.device)
    matrix = matrix.detach()
    torch._dynamo.mark_static(matrix, 1)
    return compiled_where_fp8_converts(_quantize_matrix, matrix.device)(matrix, fp8_dtype, bool(row_major), bool(column_major))


def dequantize_rows(payload: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP32 ``payload * scale`` of :func:`quantize_rows`'s results (eager operations: compiled code
    that reads the values, such as COAT's backward passes, fuses them)."""
    return payload.float() * scale


def quantize_fp8_into(
    x: torch.Tensor,
    payload: torch.Tensor,
    scale: torch.Tensor,
    expansion_exponent: "torch.Tensor | None" = None,
    group_size: "int | None" = None,
    check_finite: bool = True,
    fp8_dtype: "str | torch.dtype | None" = None,
) -> None:
    """Quantize ``x`` into preallocated buffers (COAT section 3, per-group; section 4.2 expansion).

    ``payload`` (``x.numel()`` elements) is float8, or uint8 codes of the format ``fp8_dtype``
    (:func:`payload_format`; the same bits); ``scale`` is float32 with one element per group, and so,
    to enable expansion, is ``expansion_exponent``, float32 or bfloat16. A bfloat16 buffer gets each
    group's k rounded toward zero to bfloat16 (its low 16 bits cleared: an integer operation that
    compiled code keeps), and the expansion uses that k, so that dequantizing with the stored k
    inverts it. Truncation never raises k: since the normalized elements are at most 1, each
    ``|x / M|^k`` can only grow, and the smallest one, which COAT's k puts on the smallest
    subnormal, stays at or above it (no element underflows that COAT's k keeps). Raises ValueError
    on mismatched buffers, and on non-finite input unless ``check_finite=False`` (a compiled caller
    that has already checked its inputs skips the device sync).
    """
    fp8_dtype = payload_format(payload, fp8_dtype)
    groups_count = num_groups(x.numel(), group_size)
    if payload.numel() != x.numel():
        raise ValueError(f"payload has {payload.numel()} elements, x has {x.numel()}")
    for name, buffer, dtypes in (
        ("scale", scale, (torch.float32,)), ("expansion_exponent", expansion_exponent, tuple(EXPONENT_STORAGES.values()))
    ):
        if buffer is not None and (buffer.dtype not in dtypes or buffer.numel() != groups_count):
            valid = " or ".join(str(dtype).removeprefix("torch.") for dtype in dtypes)
            raise ValueError(f"{name} must be {valid} with {groups_count} elements, got {buffer.dtype} "
                             f"with {buffer.numel()}")
    format_max = fp8_max(fp8_dtype)
    groups = _grouped(x.detach().float(), _resolved_group_size(x.numel(), group_size))
    magnitude = groups.abs()
    group_max = magnitude.amax(dim=1, keepdim=True)
    if check_finite and not bool(torch.isfinite(group_max).all()):
        raise ValueError("cannot quantize a tensor holding NaN or infinity")
    nonzero_group = group_max > 0
    group_scale = scale_of(group_max, fp8_dtype)
    if expansion_exponent is None:
        scaled = div_rn(groups, group_scale)
    else:
        group_norm = torch.where(nonzero_group, group_max, 1.0)
        normalized = div_rn(groups, group_norm)
        # k comes from the same float32 ratio that f raises to the power k (rounding is monotonic, so
        # min|x| / M is the smallest normalized magnitude), so the smallest non-zero element lands on
        # the smallest subnormal even when R_X is within rounding of 1. Both group statistics are
        # taken in one pass over x. A group whose ratio is 1 (one magnitude), 0 (it underflows:
        # R_X > 2^149) or inf (all zeros) gets k = 1.
        smallest_nonzero = div_rn(torch.where(magnitude > 0, magnitude, math.inf).amin(dim=1, keepdim=True), group_norm)
        spread = (smallest_nonzero > 0) & (smallest_nonzero < 1)
        log_group_range = -log2(torch.where(spread, smallest_nonzero, 0.5))
        group_exponent = torch.where(spread, div_rn(math.log2(fp8_dynamic_range(fp8_dtype)), log_group_range), 1.0)
        if expansion_exponent.dtype == torch.bfloat16:
            group_exponent = round_to_bfloat16_toward_zero(group_exponent)
        scaled = format_max * expand_dynamic_range(normalized, group_exponent)
        expansion_exponent.view(-1).copy_(group_exponent.view(-1))
    if payload.dtype == torch.uint8:
        quantized = to_fp8_codes(scaled, fp8_dtype)
    else:
        quantized = scaled.clamp(-format_max, format_max).to(fp8_dtype)
    payload.copy_(_ungrouped(quantized, payload))
    scale.view(-1).copy_(group_scale.view(-1))


def quantize_fp8(
    x: torch.Tensor,
    fp8_dtype: "str | torch.dtype" = "e4m3",
    group_size: "int | None" = None,
    expand: bool = False,
    exponent_storage: "str | torch.dtype" = "fp32",
) -> QuantizedTensor:
    """Quantize ``x`` to FP8 per tensor (``group_size=None``) or per 1 x ``group_size`` group,
    optionally with COAT dynamic range expansion (section 4.2), its exponents k stored as
    ``exponent_storage`` (:data:`EXPONENT_STORAGES`)."""
    dtype = fp8_dtype_of(fp8_dtype)
    groups_count = num_groups(x.numel(), group_size)
    quantized = QuantizedTensor(
        payload=torch.empty(x.numel(), dtype=dtype, device=x.device),
        scale=torch.empty(groups_count, dtype=torch.float32, device=x.device),
        expansion_exponent=(
            torch.empty(groups_count, dtype=exponent_dtype_of(exponent_storage), device=x.device) if expand else None
        ),
        group_size=group_size,
        shape=x.shape,
        fp8_dtype=dtype,
    )
    quantize_fp8_into(x, quantized.payload, quantized.scale, quantized.expansion_exponent, group_size)
    return quantized


def quantized_zeros(
    numel: int,
    fp8_dtype: "str | torch.dtype",
    group_size: "int | None",
    expand: bool,
    device: torch.device,
    groups: "int | None" = None,
    exponent_storage: "str | torch.dtype" = "fp32",
) -> QuantizedTensor:
    """What :func:`quantize_fp8` gives ``numel`` zeros, built without quantizing anything: zero
    payloads, and per group the scale 1 and the exponent k = 1 of an all-zero group (so an optimizer
    starting from zero moments allocates its FP8 state alone). ``groups`` defaults to the groups of
    ``group_size`` consecutive elements (several tensors' elements each in their own groups: more);
    ``exponent_storage``: the exponents' dtype (:data:`EXPONENT_STORAGES`)."""
    dtype = fp8_dtype_of(fp8_dtype)
    groups = num_groups(numel, group_size) if groups is None else groups
    return QuantizedTensor(
        payload=torch.zeros(numel, dtype=dtype, device=device),
        scale=torch.ones(groups, dtype=torch.float32, device=device),
        expansion_exponent=torch.ones(groups, dtype=exponent_dtype_of(exponent_storage), device=device) if expand else None,
        group_size=group_size,
        shape=torch.Size([numel]),
        fp8_dtype=dtype,
    )


def dequantize_fp8(q: QuantizedTensor) -> torch.Tensor:
    """Float32 tensor of the original shape: payload * scale, or under expansion
    max|x| * f^{-1}(payload / fp8_max) (COAT section 4.2 and Appendix A)."""
    numel = q.payload.numel()
    groups = _grouped(_payload_values(q.payload, q.fp8_dtype), _resolved_group_size(numel, q.group_size))
    group_scale = q.scale.view(-1, 1)
    if q.expansion_exponent is None:
        values = groups * group_scale
    else:
        format_max = fp8_max(q.fp8_dtype)
        values = (group_scale * format_max) * contract_dynamic_range(
            div_rn(groups, _fp8_max_divisor(q.fp8_dtype)), q.expansion_exponent.view(-1, 1).float()
        )
    return _ungrouped(values, q.payload).view(q.shape)


INT8_SCALE_DTYPE = torch.bfloat16
"""The dtype of a companded INT8 group's scale (2 bytes)."""
SIGNED_CODE_MAX = 127
"""Largest magnitude of a signed companded code (int8, symmetric: -128 is never written)."""
SQUARE_ROOT_CODE_MAX = 255
"""Largest code of a square-rooted non-negative state (uint8)."""
INT8_CODE_DTYPES = (torch.int8, torch.uint8)

_CODE_DIVISORS = {SQUARE_ROOT_CODE_MAX: torch.tensor(float(SQUARE_ROOT_CODE_MAX))}


def _code_divisor(value: int) -> "torch.Tensor | float":
    """``value`` as :func:`div_rn`'s divisor, as :func:`_fp8_max_divisor` passes the FP8 maximum."""
    return _CODE_DIVISORS[value] if torch.compiler.is_compiling() else float(value)


def int8_scale_of(group_max: torch.Tensor) -> torch.Tensor:
    """The FP32 value of the BF16 scale of a companded INT8 group whose largest magnitude is
    ``group_max``: rounded toward zero to BF16 (an integer operation that compiled code keeps), at
    least the smallest normal FP32 value; 1 for an all-zero group."""
    tiny = torch.finfo(torch.float32).tiny
    return torch.where(group_max > 0, round_to_bfloat16_toward_zero(group_max).clamp_min(tiny), 1.0)


def _check_int8_buffers(x: torch.Tensor, payload: torch.Tensor, scale: torch.Tensor, group_size: "int | None") -> None:
    if payload.dtype not in INT8_CODE_DTYPES:
        raise ValueError(f"an INT8 payload is int8 (signed, companded) or uint8 (square-rooted), got {payload.dtype}")
    if payload.numel() != x.numel():
        raise ValueError(f"payload has {payload.numel()} elements, x has {x.numel()}")
    groups_count = num_groups(x.numel(), group_size)
    if scale.dtype != INT8_SCALE_DTYPE or scale.numel() != groups_count:
        raise ValueError(f"scale must be bfloat16 with {groups_count} elements, got {scale.dtype} with {scale.numel()}")


def quantize_int8_into(
    x: torch.Tensor,
    payload: torch.Tensor,
    scale: torch.Tensor,
    group_size: "int | None" = None,
    check_finite: bool = True,
) -> None:
    """Encode FP32 ``x`` into preallocated companded INT8 buffers (see the module's docstring): an
    int8 ``payload`` holds a signed state as softsign-companded codes, a uint8 one a non-negative
    state (negative values are taken as zero) as codes of its square root; ``scale`` (bfloat16) has
    one element per group of ``group_size`` consecutive elements. Every code is rounded to nearest,
    ties to even. Raises ValueError on mismatched buffers, and on non-finite input unless
    ``check_finite=False`` (a compiled caller that has checked its inputs skips the sync)."""
    _check_int8_buffers(x, payload, scale, group_size)
    groups = _grouped(x.detach().float(), _resolved_group_size(x.numel(), group_size))
    square_root = payload.dtype == torch.uint8
    if square_root:
        groups = sqrt_rn(groups.clamp_min(0.0))
    group_max = groups.abs().amax(dim=1, keepdim=True)
    if check_finite and not bool(torch.isfinite(group_max).all()):
        raise ValueError("cannot quantize a tensor holding NaN or infinity")
    group_scale = int8_scale_of(group_max)
    normalized = div_rn(groups, group_scale).clamp(-1.0, 1.0)
    if square_root:
        codes = torch.round(normalized * float(SQUARE_ROOT_CODE_MAX))
    else:
        codes = torch.round(div_rn(normalized, 1.0 + normalized.abs()) * float(2 * SIGNED_CODE_MAX))
    payload.copy_(_ungrouped(codes.to(payload.dtype), payload))
    scale.view(-1).copy_(group_scale.view(-1))


def dequantize_int8(payload: torch.Tensor, scale: torch.Tensor, group_size: "int | None", shape: torch.Size) -> torch.Tensor:
    """FP32 values of companded INT8 codes (:func:`quantize_int8_into`) in ``shape``: an int8 payload
    decodes as ``s · q / (254 - |q|)``, a uint8 one as ``(q · s / 255)^2`` (``q · s`` is exact: 8
    significant bits each), each division correctly rounded."""
    codes = _grouped(payload.float(), _resolved_group_size(payload.numel(), group_size))
    group_scale = scale.view(-1, 1).float()
    if payload.dtype == torch.uint8:
        root = div_rn(codes * group_scale, _code_divisor(SQUARE_ROOT_CODE_MAX))
        values = root * root
    else:
        values = div_rn(codes, float(2 * SIGNED_CODE_MAX) - codes.abs()) * group_scale
    return _ungrouped(values, payload).view(shape)


def int8_zeros(
    numel: int, group_size: "int | None", signed: bool, device: torch.device, groups: "int | None" = None
) -> "tuple[torch.Tensor, torch.Tensor]":
    """What :func:`quantize_int8_into` gives ``numel`` zeros, built without encoding: zero codes
    (int8 if ``signed``, else uint8) and the scale 1 of an all-zero group per group (``groups``
    defaults to ``numel`` cut into groups of ``group_size``)."""
    groups = num_groups(numel, group_size) if groups is None else groups
    payload = torch.zeros(numel, dtype=torch.int8 if signed else torch.uint8, device=device)
    return payload, torch.ones(groups, dtype=INT8_SCALE_DTYPE, device=device)
