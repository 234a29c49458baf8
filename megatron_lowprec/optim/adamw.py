"""The precision-aware AdamW optimizer: a thin ``torch.optim.Optimizer`` around the kernel.

The state of each parameter group lives in flat buckets (``buckets.py``); a step runs either the
eager reference per parameter or the fused (compiled) kernel per bucket (``fused.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import Any

import torch

from megatron_lowprec.metrics.update_quality import UpdateQuality
from megatron_lowprec.numerics.rounding import (
    StreamLayout,
    counter_round_keys,
    generator_random_bits,
    grid_random_bits,
    layout_random_bits,
)
from megatron_lowprec.optim.background_compile import BACKGROUND_COMPILES
from megatron_lowprec.optim.buckets import Bucket, BufferRows, build_bucket, gather_grads, own_grad_buffer
from megatron_lowprec.optim.codecs import MASTER_CODECS
from megatron_lowprec.optim.fused import (
    bucket_entries, fused_bucket_step_, fused_entries, resolve_fused, warn_eager_fallback,
)
from megatron_lowprec.optim.kernel import (
    SUPPORTED_GRAD_DTYPES,
    RandomSource,
    StepScalars,
    adamw_kernel_,
    adamw_step_,
    beta2_expansion_for,
    check_param_dtype,
)
from megatron_lowprec.optim.layouts import Layout
from megatron_lowprec.optim.master import MASTER_KEYS, master_value, store_master_, stored_master
from megatron_lowprec.optim.statistics import update_quality_by_group
from megatron_lowprec.optim.strategies import (
    PrecisionStrategy,
    check_exponent_storage,
    exponent_storage_record,
    resolve_option,
)
from megatron_lowprec.optim.torch_fused import require_torch_fused_adamw

GeneratorSource = torch.Generator | Callable[[], torch.Generator]


def non_finite_flag(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """A 1-element FP32 tensor on ``device``: 1 if any of ``grads`` (all on ``device``) holds NaN or inf.

    No host synchronisation, no temporary of a gradient's size, and every floating dtype on every
    device (the GradScaler kernel has no BF16 version on CUDA). Per gradient dtype, the extremes of
    every tensor, then one reduction of those few values: NaN propagates through max and min, and
    neither can overflow as a sum of squares can (:func:`_extremes`).
    """
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in grads:
        if grad.numel():
            by_dtype.setdefault(grad.dtype, []).append(grad)
    found = torch.zeros(1, device=device)
    for same_dtype in by_dtype.values():
        found = torch.maximum(found, _extremes(same_dtype).isfinite().logical_not().any().float())
    return found


CONVERT_REMEDY = "megatron_lowprec.optim.convert.convert_state_dict converts it"
"""What a state dict of another FP8 exponent storage than the optimizer's takes to load."""

LARGE_GRADIENT_NUMEL = 2**20
"""Gradients of at least this many elements are checked by one reduction each (``aminmax``), smaller
ones on CUDA together in one multi-tensor kernel (``torch._foreach_norm``), whose launches of
64K-element chunks suit many small tensors, not a few large ones."""


def _extremes(grads: list[torch.Tensor]) -> torch.Tensor:
    """Values whose finiteness is that of ``grads`` (one dtype): each large tensor's min and max
    (``aminmax``, one pass), and on CUDA the small ones' max-norms in one multi-tensor kernel
    (``torch._foreach_norm``, ord=inf; on CPUs the max-norm of BF16 runs per tensor and 10x slower)."""
    together, alone = [], []
    for grad in grads:
        (together if grad.device.type == "cuda" and grad.numel() < LARGE_GRADIENT_NUMEL else alone).append(grad)
    extremes = [torch.stack(torch.aminmax(grad)) for grad in alone]
    if together:
        extremes.append(torch.stack(torch._foreach_norm(together, float("inf"))))
    return torch.cat(extremes)


def grads_are_finite(grads: list[torch.Tensor]) -> bool:
    """Whether every one of ``grads`` is finite: one fused pass per device (:func:`non_finite_flag`)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for grad in grads:
        by_device.setdefault(grad.device, []).append(grad)
    return not any(non_finite_flag(grads, device).item() for device, grads in by_device.items())


def check_grad_dtypes(param_groups: list[dict[str, Any]]) -> None:
    """``ValueError`` naming a sparse gradient or one of an unsupported dtype, and the valid dtypes."""
    for group in param_groups:
        for param in group["params"]:
            grad = param.grad
            if grad is not None and (grad.is_sparse or grad.dtype not in SUPPORTED_GRAD_DTYPES):
                raise ValueError(
                    f"gradient of dtype {grad.dtype} (sparse={grad.is_sparse}) is not supported; "
                    f"valid: dense {', '.join(str(d) for d in SUPPORTED_GRAD_DTYPES)}"
                )


def _check_hyperparameters(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    checks = [
        ("lr", lr, lr >= 0, ">= 0"),
        ("betas[0]", betas[0], 0 <= betas[0] < 1, "in [0, 1)"),
        ("betas[1]", betas[1], 0 <= betas[1] < 1, "in [0, 1)"),
        ("eps", eps, eps > 0, "> 0"),
        ("weight_decay", weight_decay, weight_decay >= 0, ">= 0"),
    ]
    for name, value, ok, valid in checks:
        if not ok:
            raise ValueError(f"invalid {name}={value!r}; it must be {valid}")


class PrecisionOptimizer(torch.optim.Optimizer):
    """What the precision-aware optimizers (:class:`AdamW`, :class:`~megatron_lowprec.optim.muon.Muon`)
    share: a strategy (``self.strategy``), each parameter's place in the stochastic-rounding stream,
    the gradient checks before a step (:meth:`_grads_ready`), which buckets take their fused step
    (:meth:`_fused_step_grads`), zeroing their flat gradient buffers, and state dicts that save the
    option and restore every state component bit-exactly in its own dtype. A subclass sets
    ``strategy``, ``seed``, ``skipped_steps``, ``check_grads_finite``, ``buckets`` and
    ``_stream_layout`` (a callable or ``None``) before ``super().__init__``."""

    _stream_layout: Callable[[torch.nn.Parameter], StreamLayout] | None
    _stream_layouts: dict[torch.nn.Parameter, StreamLayout]

    def _grads_ready(self) -> bool:
        """Check the gradients' dtypes; ``False`` (one more skipped step) if one is not finite."""
        check_grad_dtypes(self.param_groups)
        if self.check_grads_finite and not grads_are_finite(self._gradients_to_check()):
            self.skipped_steps += 1
            return False
        return True

    def _gradients_to_check(self) -> list[torch.Tensor]:
        """Every gradient, a bucket's own gradient buffer in place of its views (one pass over it)."""
        grads = []
        for bucket in self.buckets:
            own = own_grad_buffer(bucket)
            grads += [own] if own is not None else [param.grad for param in bucket.params if param.grad is not None]
        return grads

    def _begin_step(self, closure: Callable[[], float] | None) -> tuple[float | None, bool]:
        """The loss of ``closure`` (run with gradients on), and whether to step (:meth:`_grads_ready`)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        return loss, self._grads_ready()

    @property
    def _sr_seed(self) -> int | None:
        """The seed of the counter stream where the strategy rounds stochastically, else ``None``."""
        return self.seed if self.strategy.param_update == "stochastic" else None

    def _fused_step_grads(self, bucket: Bucket) -> tuple[torch.Tensor | BufferRows | None, int | None]:
        """(the bucket's gradients, its next step) where the bucket takes its fused step (its
        parameters are laid out in a flat buffer, :attr:`~megatron_lowprec.optim.buckets.Bucket.laid_out`, its entries are at one step and their gradients gather:
        :func:`~megatron_lowprec.optim.buckets.gather_grads`), each entry's step advanced; else
        ``(None, None)``, with an :class:`~megatron_lowprec.optim.fused.EagerFallbackWarning` where a
        fused bucket has gradients but cannot (its entries then step one by one)."""
        steps = {self.state[param]["step"] for param in bucket.params}
        grad = gather_grads(bucket) if bucket.laid_out and len(steps) == 1 else None
        if grad is None:
            if bucket.laid_out and any(param.grad is not None for param in bucket.params):
                warn_eager_fallback(*self._fallback_reason(bucket, len(steps) > 1))
            return None, None
        step = steps.pop() + 1
        for param in bucket.params:
            self.state[param]["step"] = step
        return grad, step

    def _fallback_reason(self, bucket: Bucket, several_steps: bool) -> tuple[str, str]:
        """(the parameter, the reason) why a fused bucket cannot take its compiled step
        (:func:`~megatron_lowprec.optim.buckets.gather_grads` found no common gradient buffer)."""
        params = self.param_groups[bucket.group_index]["params"]

        def named(param: torch.nn.Parameter) -> str:
            index = next(index for index, other in enumerate(params) if other is param)
            return f"parameter {index} of group {bucket.group_index} (shape {tuple(param.shape)})"

        without = [param for param in bucket.params if param.grad is None]
        if without:
            return named(without[0]), "it has no gradient, and its bucket steps together or not at all"
        if several_steps:
            return bucket_entries(bucket), "its parameters are at different steps (some had no gradient before)"
        dtypes = sorted({str(param.grad.dtype) for param in bucket.params})
        return bucket_entries(bucket), f"its gradients have several dtypes ({', '.join(dtypes)})"

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat gradient buffers in place (keeping the gradient views), and the rest as torch does."""
        pooled = {id(p) for bucket in self.buckets if bucket.grad_buffer is not None for p in bucket.params}
        for bucket in self.buckets:
            if bucket.grad_buffer is not None:
                bucket.grad_buffer.zero_()
        for group in self.param_groups:
            for param in group["params"]:
                if id(param) not in pooled and param.grad is not None:
                    if set_to_none:
                        param.grad = None
                    else:
                        param.grad.zero_()

    def _saved_generator(self) -> torch.Generator | None:
        """The generator whose state the state dict saves (none by default)."""
        return None

    def _entry_values(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The 16-bit values of ``param``'s state entry (the whole parameter by default)."""
        return param.detach()

    def _checked_stream_layout(self, param: torch.nn.Parameter, where: str) -> StreamLayout:
        if self._stream_layout is None:
            return StreamLayout.whole(len(self._stream_layouts), param.numel())
        layout = self._stream_layout(param)
        try:
            layout.rows(param.numel())
        except ValueError as error:
            raise ValueError(f"stream_layout of {where} (shape {tuple(param.shape)}): {error}") from None
        return layout

    def random_bits(self, param: torch.nn.Parameter, step: int) -> torch.Tensor:
        """The 32-bit words (int32, ``param``'s shape) that stochastic rounding of ``param`` draws at
        ``step`` from the counter stream."""
        return layout_random_bits(self.seed, step, self._stream_layouts[param], param.shape, param.device)

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict plus a ``lowprec`` section: option, master storage, FP8 exponent storage
        where not FP32 (:func:`~megatron_lowprec.optim.strategies.exponent_storage_record`), skipped
        steps, SR seed and generator state. A master stored as a remainder is saved as such: the model's state dict
        holds its upper half (the BF16 parameters)."""
        state_dict = super().state_dict()
        generator = self._saved_generator()
        state_dict["lowprec"] = {
            "option": self.strategy.name,
            "master_storage": self.strategy.master_storage,
            **exponent_storage_record(self.strategy),
            "skipped_steps": self.skipped_steps,
            "seed": self.seed,
            "generator_state": None if generator is None else generator.get_state(),
        }
        return state_dict

    def _check_loaded_state(self, state_dict: dict[str, Any]) -> None:
        extra = state_dict.get("lowprec")
        if extra is None or extra["option"] != self.strategy.name:
            found = None if extra is None else extra["option"]
            raise ValueError(f"state dict was saved for option {found!r}, this optimizer runs {self.strategy.name!r}")
        check_exponent_storage(extra, self.strategy, CONVERT_REMEDY)
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"state dict has {len(saved_groups)} parameter groups, optimizer has {len(self.param_groups)}")
        for saved_group, group in zip(saved_groups, self.param_groups):
            if len(saved_group["params"]) != len(group["params"]):
                raise ValueError("state dict and optimizer differ in the number of parameters of a group")
            for index, param in zip(saved_group["params"], group["params"]):
                saved = state_dict["state"].get(index)
                expected = self.state.get(param)
                if expected is None and saved is None:
                    continue
                if expected is None:
                    raise ValueError(f"state dict holds a state of parameter {index}, which this optimizer keeps none of")
                if saved is None or _master_as_one_key(saved) != _master_as_one_key(expected):
                    raise ValueError(f"state of parameter {index} does not hold {sorted(expected)}")
                for key, value in expected.items():
                    if key in MASTER_KEYS.values():
                        self._check_loaded_master(index, param, value, saved)
                    elif torch.is_tensor(value) and (saved[key].shape != value.shape or saved[key].dtype != value.dtype):
                        raise ValueError(
                            f"state {key!r} of parameter {index}: saved {saved[key].dtype}{tuple(saved[key].shape)}, "
                            f"expected {value.dtype}{tuple(value.shape)}"
                        )

    @staticmethod
    def _check_loaded_master(index: int, param: torch.Tensor, stored: torch.Tensor, saved: dict[str, Any]) -> None:
        """A saved master in either storage fits ``param``'s ``stored`` master (its whole shape, or
        its run's): FP32 of that shape, or an int16 remainder or int8 residual of it below a BF16 parameter."""
        codec = next(codec for codec in MASTER_CODECS.values() if codec.key in saved)
        key, dtype, below = codec.key, codec.dtype, codec.below_bf16
        if saved[key].shape != stored.shape or saved[key].dtype != dtype or (below and param.dtype != torch.bfloat16):
            raise ValueError(
                f"state {key!r} of parameter {index}: saved {saved[key].dtype}{tuple(saved[key].shape)} for a "
                f"{param.dtype} parameter; expected {dtype}{tuple(stored.shape)}"
                + (" below a bfloat16 parameter" if below else "")
            )

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore every state component bit-exactly into the existing buckets, in its own dtype.

        The FP32 master loads in either storage: a whole FP32 master into a remainder (the parameter
        becomes its upper half) and a remainder into a whole master (joined with the parameter, which
        must hold the saved model's: load the model's state dict first, as torch checkpoints do).
        The whole state dict is validated first; a mismatch raises ``ValueError`` and changes nothing.
        """
        self._check_loaded_state(state_dict)
        for saved_group, group in zip(state_dict["param_groups"], self.param_groups):
            for key, value in saved_group.items():
                if key != "params":
                    group[key] = value
            for index, param in zip(saved_group["params"], group["params"]):
                if index not in state_dict["state"]:
                    continue
                state = self.state[param]
                for key, value in state_dict["state"][index].items():
                    if key in MASTER_KEYS.values():
                        _load_master_(self._entry_values(param), state, key, value)
                    elif torch.is_tensor(value):
                        state[key].copy_(value)
                    else:
                        state[key] = value
        extra = state_dict["lowprec"]
        self.skipped_steps = extra["skipped_steps"]
        self.seed = extra["seed"]
        generator = self._saved_generator()
        if generator is not None and extra["generator_state"] is not None:
            generator.set_state(extra["generator_state"])




class AdamW(PrecisionOptimizer):
    """AdamW with a precision strategy (``option``) that decides every storage format and rounding.

    ``option`` is a registered strategy name or alias (case-insensitive; see
    :func:`megatron_lowprec.optim.strategies.strategy_names`) or a :class:`PrecisionStrategy`.
    Parameters must be bfloat16 or float16; gradients may be bfloat16, float16 or float32.
    State is created at construction, in flat buckets, so memory is known before the first step.

    ``fused`` (default: where available) runs one compiled pass per bucket. It re-points each
    parameter's ``.data`` (and, at the first step, ``.grad``) at views of flat buffers, as
    megatron-core's DistributedDataParallel does; :meth:`zero_grad` then zeroes the gradient buffer
    in place and keeps the views. ``fused=False`` runs the eager reference per parameter. Both give
    bit-identical results. ``background_compile=True`` (fused only) runs a call uncompiled, the same
    bits, until a child process has compiled it into Inductor's on-disk cache, so the first step does
    not wait for the compiler (tens of seconds on a CPU with an empty cache); the call then compiles
    from that cache (:mod:`~megatron_lowprec.optim.background_compile`). Off by default here (a
    library call starts no process unasked); ``lowprec-train`` and the Megatron-LM entry turn it on.

    ``master_weights=False`` drops the FP32 master of a strategy that has one (e.g. COAT with BF16
    parameters as the only copy). ``master_storage`` stores the master of a strategy that has one
    (D, coat, D-BF16, res8) as ``"fp32"`` (a whole FP32 tensor, 4 bytes), ``"remainder"`` (the BF16
    parameter is its upper half, an int16 remainder its lower half: 2 bytes; BF16 parameters only;
    the same masters bit for bit) or ``"residual8"`` (the BF16 parameter plus an int8 residual, 1
    byte: masters of 16 significant bits); ``None`` keeps the strategy's own (``optim/master.py``).
    ``moment_storage`` stores the 8-bit moments of a strategy that has them (coat, sr8, res8) as
    ``"fp8"`` (COAT's FP8 groups) or ``"int8"`` (companded INT8 on the same groups with a BF16 scale,
    FlashOptim); ``None`` keeps the strategy's own.
    Stochastic rounding draws its bits from a counter-based stream
    keyed by (``seed``, step, stream, element index), which needs no state and gives every replica of
    an element the same bits; a ``generator`` (a ``torch.Generator`` or a callable returning one,
    e.g. a fork of a shared RNG tracker) replaces it and implies the eager path.
    ``stream_layout(param)`` says where a parameter's elements sit in the stream
    (:class:`~megatron_lowprec.numerics.rounding.StreamLayout`): a distributed caller names each
    logical tensor and gives a tensor-parallel shard its elements' indices in the whole tensor, so
    that every replica and every layout draws the same bits for an element. By default each
    parameter is a whole stream numbered by its position in the optimizer. Parameters go to one
    bucket per group, device and dtype, and ``bucket_key(param)`` splits buckets further (e.g.
    tensor-parallel shards apart from replicated parameters, whose metrics are summed differently).

    ``layout`` (a :class:`~megatron_lowprec.optim.layouts.Layout`) steps elements that live
    elsewhere instead of buckets of its own: e.g. a distributed optimizer's shard of megatron's DDP
    buffers, each parameter's state the run of its elements there (flat). The step, the state-dict
    format and the bits of each element are the same; the gradients are the layout's, and a step
    that is not fused runs the eager reference per entry.

    Non-finite gradients: if any gradient holds NaN or inf, the whole step is skipped before any
    state is touched, and :attr:`skipped_steps` is incremented (as a loss scaler skips a step). A
    caller that has already checked (e.g. across ranks, as the Megatron hook does) passes
    ``check_grads_finite=False`` to save that pass over the gradients.

    With ``track_update_quality=True`` every step computes the EDQ and imprecision pieces of each
    bucket on its device (:attr:`bucket_update_pieces`, aligned with :attr:`buckets`), inside the
    step's kernels and without a host synchronisation; :attr:`update_quality` (per parameter group)
    and :attr:`bucket_update_quality` read them back. When off it costs no memory or time.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        *,
        option: str | PrecisionStrategy,
        master_weights: bool | None = None,
        master_storage: str | None = None,
        moment_storage: str | None = None,
        fused: bool | None = None,
        background_compile: bool = False,
        generator: GeneratorSource | None = None,
        seed: int = 0,
        track_update_quality: bool = False,
        check_grads_finite: bool = True,
        stream_layout: Callable[[torch.nn.Parameter], StreamLayout] | None = None,
        bucket_key: Callable[[torch.nn.Parameter], Hashable] | None = None,
        layout: Layout | None = None,
    ) -> None:
        _check_hyperparameters(lr, betas, eps, weight_decay)
        strategy = resolve_option(option, master_weights, master_storage, moment_storage)
        if fused and generator is not None and strategy.param_update == "stochastic":
            raise ValueError("fused=True draws SR bits from the counter stream; a generator needs fused=False")
        self.strategy = strategy
        self.track_update_quality = track_update_quality
        self.check_grads_finite = check_grads_finite
        self.skipped_steps = 0
        self.bucket_update_pieces: list[torch.Tensor] = []
        self.buckets: list[Bucket] = []
        self.seed = seed
        self._stream_layout = stream_layout
        self._stream_layouts: dict[torch.nn.Parameter, StreamLayout] = {}
        self._bucket_key = bucket_key or (lambda param: None)
        self._fused_request = fused
        self.background_compile = background_compile
        self._generator_source = generator
        self._own_generator: torch.Generator | None = None
        self.layout = layout
        self._layout_fused: bool | None = None
        # The ids of a fused layout's buckets that the fused step cannot serve (fused_entries): they step eagerly.
        self._eager_layout_buckets: set[int] = set()
        self._laid_out_entries: dict[torch.nn.Parameter, tuple[Bucket, int]] = {}
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        if layout is not None:
            if generator is not None:
                raise ValueError("a layout draws SR bits from the counter stream; it takes no generator")
            self._build_layout(layout)

    def _build_layout(self, layout: Layout) -> None:
        """The layout's buckets, each entry's state views as its parameter's state."""
        for bucket, states in layout.build(self.strategy, self.param_groups, self._stream_layouts):
            self.buckets.append(bucket)
            for index, (param, state) in enumerate(zip(bucket.params, states)):
                self.state[param] = state
                self._laid_out_entries[param] = (bucket, index)
        device = self.buckets[0].device if self.buckets else torch.device("cpu")
        self._layout_fused = self._wants_fused(device)
        if self._layout_fused:
            for bucket in self.buckets:
                served = fused_entries(
                    self.strategy, self._fused_request, bucket.params, bucket.streams, bucket.element_starts, bucket.numels
                )
                if not all(served):
                    self._eager_layout_buckets.add(id(bucket))

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """:meth:`PrecisionOptimizer.load_state_dict`; a layout's buckets then fill their padding
        from their entries (:meth:`~megatron_lowprec.optim.buckets.Bucket.repeat_into_padding_`)."""
        super().load_state_dict(state_dict)
        if self.layout is not None:
            for bucket in self.buckets:
                bucket.repeat_into_padding_()

    def _entry_values(self, param: torch.nn.Parameter) -> torch.Tensor:
        if param in self._laid_out_entries:
            bucket, index = self._laid_out_entries[param]
            return bucket.entry_params()[index]
        return param.detach()

    def _wants_fused(self, device: torch.device) -> bool:
        if self._generator_source is not None and self.strategy.param_update == "stochastic":
            return False
        return resolve_fused(device, self._fused_request)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self._layout_fused is not None:
            raise ValueError("an AdamW over a layout takes its parameter groups at construction; build a new one to add a group")
        super().add_param_group(param_group)
        group_index = len(self.param_groups) - 1
        group = self.param_groups[group_index]
        _check_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"])
        by_layout: dict[tuple[torch.device, torch.dtype, Hashable], list[torch.nn.Parameter]] = {}
        for index, param in enumerate(group["params"]):
            where = f"parameter {index} of group {group_index}"
            check_param_dtype(param, self.strategy, where)
            self._stream_layouts[param] = self._checked_stream_layout(param, where)
            if self.layout is not None:
                continue
            by_layout.setdefault((param.device, param.dtype, self._bucket_key(param)), []).append(param)
        for (device, _, _), params in by_layout.items():
            if self.strategy.adam_kernel == "torch_fused":
                require_torch_fused_adamw(device, self.strategy.name)
            if not self._wants_fused(device):
                self._add_bucket(group_index, params, fused=False)
                continue
            served = fused_entries(self.strategy, self._fused_request, params, [self._stream_layouts[param] for param in params])
            for fused in (True, False):
                self._add_bucket(group_index, [param for param, takes_fused in zip(params, served) if takes_fused == fused], fused)

    def _add_bucket(self, group_index: int, params: list[torch.nn.Parameter], fused: bool) -> None:
        """A bucket of ``params`` (none: no bucket), owning their flat buffer where it takes the fused step."""
        if not params:
            return
        bucket, states = build_bucket(self.strategy, group_index, params, fused, [self._stream_layouts[param] for param in params])
        self.buckets.append(bucket)
        for param, state in zip(params, states):
            self.state[param] = state

    @property
    def generator(self) -> torch.Generator | None:
        """The generator stochastic rounding draws from in this step, or ``None`` for the counter stream."""
        if self._generator_source is None or isinstance(self._generator_source, torch.Generator):
            return self._generator_source
        return self._generator_source()

    def _random_source(self, bucket: Bucket, index: int, step: int, generator: torch.Generator | None) -> RandomSource:
        if self.strategy.param_update != "stochastic":
            return None
        param = bucket.params[index]
        if generator is not None:
            return generator_random_bits(param.shape, generator, param.device)
        return self.random_bits(param, step)

    @property
    def bucket_update_quality(self) -> list[UpdateQuality]:
        """The last step's update-quality pieces of each bucket (``track_update_quality``)."""
        return [UpdateQuality.from_tensor(pieces) for pieces in self.bucket_update_pieces]

    @property
    def update_quality(self) -> list[UpdateQuality]:
        """The last step's update-quality pieces of each parameter group (``track_update_quality``;
        :func:`~megatron_lowprec.optim.statistics.update_quality_by_group`)."""
        if not self.bucket_update_pieces:
            return []
        groups = [bucket.group_index for bucket in self.buckets]
        return update_quality_by_group(groups, self.bucket_update_pieces, len(self.param_groups))

    def _group_hyper(self, index: int) -> dict[str, float]:
        group = self.param_groups[index]
        beta1, beta2 = group["betas"]
        return dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"])

    def _advance_steps(self, bucket: Bucket) -> int:
        """Every entry of ``bucket`` (one step, as a layout's entries always are) at its next step."""
        step = self.state[bucket.params[0]]["step"] + 1
        for param in bucket.params:
            self.state[param]["step"] = step
        return step

    def _step_bucket(self, bucket: Bucket, generator: torch.Generator | None) -> torch.Tensor | None:
        hyper = {index: self._group_hyper(index) for index in sorted(set(bucket.entry_groups))}
        if self.layout is not None:
            fused = self._layout_fused and id(bucket) not in self._eager_layout_buckets
            if fused or self.strategy.adam_kernel == "torch_fused":
                grad, entry_grads = self.layout.bucket_grads(bucket)
                return fused_bucket_step_(
                    bucket, self.strategy, grad, entry_grads, hyper, step=self._advance_steps(bucket), sr_seed=self._sr_seed,
                    track_update_quality=self.track_update_quality, background_compile=self.background_compile,
                    compile_master_codec=fused,
                )
            return self._step_entries_eagerly(bucket, hyper)
        grad, step = self._fused_step_grads(bucket)
        if grad is not None:
            return fused_bucket_step_(
                bucket, self.strategy, grad, [param.grad.reshape(-1) for param in bucket.params],
                hyper, step=step, sr_seed=self._sr_seed, track_update_quality=self.track_update_quality,
                background_compile=self.background_compile,
            )
        hyper = hyper[bucket.group_index]
        quality = bucket.params[0].new_zeros(4, dtype=torch.float64) if self.track_update_quality else None
        for index, param in enumerate(bucket.params):
            if param.grad is None:
                continue
            state = self.state[param]
            piece = adamw_step_(
                param,
                param.grad,
                state,
                self.strategy,
                random_source=self._random_source(bucket, index, state["step"] + 1, generator),
                track_update_quality=self.track_update_quality,
                **hyper,
            )
            if piece is not None:
                quality += piece
        return quality

    def _step_entries_eagerly(self, bucket: Bucket, hyper: dict[int, dict[str, float]]) -> torch.Tensor | None:
        """The eager reference kernel on each entry of a layout's bucket, where it lives, stochastic
        rounding with each grid of stream rows' words; the update-quality pieces of the entries that
        count (:attr:`~megatron_lowprec.optim.buckets.Bucket.entry_counted`)."""
        step = self._advance_steps(bucket)
        _, entry_grads = self.layout.bucket_grads(bucket)
        pieces = [torch.zeros(4, dtype=torch.float64, device=bucket.device)]
        for index, (param, grad) in enumerate(zip(bucket.entry_params(), entry_grads)):
            values = hyper[bucket.entry_groups[index]]
            scalars = StepScalars.for_step(step, **values)
            expansion = beta2_expansion_for(self.strategy, values["beta2"], param.dtype)
            state = {key: value for key, value in self.state[bucket.params[index]].items() if key != "step"}
            counted = bucket.entry_counted is None or bucket.entry_counted[index]
            for param_part, grad_part, state_part, words in self._eager_parts(bucket, index, step, param, grad, state):
                piece = adamw_kernel_(
                    param_part, grad_part, state_part, self.strategy, scalars, expansion, words, self.track_update_quality
                )
                if counted:
                    pieces.append(piece)
        return sum(pieces) if self.track_update_quality else None

    def _eager_parts(self, bucket: Bucket, index: int, step: int, param, grad, state):
        """(parameter, gradient, state, SR words) of each eager call on entry ``index``: the whole
        entry, or under stochastic rounding each grid of whole stream rows; with FP8 moments, whose
        groups a grid may cut, the whole entry with the words of every grid in order."""
        if self.strategy.param_update != "stochastic":
            yield param, grad, state, None
            return
        layout, element_start = bucket.streams[index], bucket.element_starts[index]
        keys = counter_round_keys(self.seed, step, layout.stream)
        if self.strategy.grouped_moments:
            words = [
                grid_random_bits(keys, offset, layout.row_stride, rows, length, param.device).reshape(-1)
                for _, rows, length, offset in layout.grids(element_start, bucket.numels[index])
            ]
            yield param, grad, state, torch.cat(words).view(param.shape)
            return
        for first, rows, length, offset in layout.grids(element_start, bucket.numels[index]):
            local = slice(first - element_start, first - element_start + rows * length)
            yield (
                param[local].view(rows, length), grad[local].view(rows, length),
                {key: value[local].view(rows, length) for key, value in state.items()},
                grid_random_bits(keys, offset, layout.row_stride, rows, length, param.device),
            )

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One AdamW step for every parameter with a gradient; see the class docstring for skips."""
        loss, ready = self._begin_step(closure)
        if not ready:
            return loss
        generator = self.generator if self.strategy.param_update == "stochastic" else None
        pieces = [self._step_bucket(bucket, generator) for bucket in self.buckets]
        if self.track_update_quality:
            self.bucket_update_pieces = pieces
        if self.background_compile:
            BACKGROUND_COMPILES.start()
        return loss

    def _saved_generator(self) -> torch.Generator | None:
        return self._generator_source if isinstance(self._generator_source, torch.Generator) else None

def _master_as_one_key(state: dict[str, Any]) -> set[str]:
    """The keys of ``state`` with either master key counted as ``master``."""
    return {MASTER_KEYS["fp32"] if key in MASTER_KEYS.values() else key for key in state}


def _load_master_(param: torch.Tensor, state: dict[str, Any], saved_key: str, saved: torch.Tensor) -> None:
    """Load a saved master (FP32 under ``master``, or a remainder below ``param``) into ``state``'s
    stored master, whichever its storage; a remainder into a remainder is copied as it is."""
    stored = stored_master(state)
    if saved.dtype == stored.dtype:
        stored.copy_(saved)
        return
    value = saved.to(stored.device) if saved_key == MASTER_KEYS["fp32"] else master_value(param, saved.to(param.device))
    store_master_(param, stored, value)
