"""Precision-aware AdamW: one eager reference step for every registered precision strategy.

The functional core (:func:`init_state`, :func:`adamw_step_`) is the specification that fused steps
must reproduce bit for bit; :class:`AdamW` is a thin ``torch.optim.Optimizer`` around it.

Rounding points of the reference, for every strategy:

* Scalars (bias corrections, step size, ``lr * weight_decay``, ``1 - beta``) are Python floats (fp64)
  and never pass through a low-precision tensor (Collage §4.2, "compute scalars in high precision").
* Each moment is decoded to FP32, updated there (m = β1·m + (1-β1)·g, v = β2·v + g·g·(1-β2), each
  operation rounded to FP32, none fused; or torch's own ``lerp``/``addcmul`` for option D) and
  rounded once when stored (nearest for 16-bit,
  per-group FP8 quantization for COAT). Collage-plus instead updates (v, δv) with Mul and Grow,
  every elementary operation rounded to the 16-bit format (Collage Alg. 2, line 9).
* The update Δθ = -lr (m̂ / (√v̂ + ε) + λθ) is computed in FP32 (Collage App. D) and then applied as
  the strategy says: nearest, Grow into (θ, δθ), Kahan, or stochastic rounding. Strategies with
  ``weight_decay="multiplicative"`` instead update the FP32 master as ``torch.optim.AdamW`` does,
  θ ← θ(1 - lr·λ) - lr/(1-β1^t) · m / (√v / √(1-β2^t) + ε).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from megatron_lowprec.metrics.update_quality import UpdateQuality, measure_update_quality
from megatron_lowprec.numerics.formats import float_format
from megatron_lowprec.numerics.mcf import expand_scalar, fast2sum, grow, mul
from megatron_lowprec.numerics.quant import QuantizedTensor, dequantize_fp8, quantize_fp8, quantize_fp8_into
from megatron_lowprec.numerics.rounding import generator_random_bits, stochastic_round
from megatron_lowprec.optim.strategies import PrecisionStrategy, get_strategy

SUPPORTED_PARAM_DTYPES = (torch.bfloat16, torch.float16)
SUPPORTED_GRAD_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MOMENTS = ("exp_avg", "exp_avg_sq")
FP8_PARTS = ("payload", "scale", "expansion_exponent")

GeneratorSource = torch.Generator | Callable[[], torch.Generator]


def check_param_dtype(param: torch.Tensor, strategy: PrecisionStrategy, where: str = "parameter") -> None:
    """Raise ``ValueError`` if ``strategy`` cannot store ``param``."""
    if param.dtype not in SUPPORTED_PARAM_DTYPES:
        valid = ", ".join(str(d) for d in SUPPORTED_PARAM_DTYPES)
        raise ValueError(
            f"option {strategy.name!r} keeps the model's parameters in 16 bits; {where} of shape "
            f"{tuple(param.shape)} has dtype {param.dtype}, valid dtypes: {valid}"
        )


def state_keys(strategy: PrecisionStrategy) -> list[str]:
    """Names of the tensor states ``strategy`` keeps per parameter (``step`` is an int besides these)."""
    if strategy.moments == "fp8":
        keys = [f"{moment}_{part}" for moment in MOMENTS for part in FP8_PARTS]
    else:
        keys = list(MOMENTS)
    if strategy.master_weights:
        keys.append("master")
    if strategy.keeps_param_low_component:
        keys.append("param_lo")
    if strategy.second_moment_mcf:
        keys.append("exp_avg_sq_lo")
    if strategy.param_update == "kahan":
        keys.append("kahan_compensation")
    return keys


def _fp8_moment(state: dict[str, Any], moment: str, param: torch.Tensor, strategy: PrecisionStrategy) -> QuantizedTensor:
    return QuantizedTensor(
        payload=state[f"{moment}_payload"],
        scale=state[f"{moment}_scale"],
        expansion_exponent=state[f"{moment}_expansion_exponent"] if strategy.fp8_expand else None,
        group_size=strategy.fp8_group_size,
        shape=param.shape,
        fp8_dtype=state[f"{moment}_payload"].dtype,
    )


def init_state(param: torch.Tensor, strategy: PrecisionStrategy) -> dict[str, Any]:
    """Fresh optimizer state for ``param``: zero moments and components, an FP32 master if any."""
    state: dict[str, Any] = {"step": 0}
    for moment in MOMENTS:
        if strategy.moments == "low":
            state[moment] = torch.zeros_like(param, memory_format=torch.preserve_format)
        elif strategy.moments == "fp32":
            state[moment] = torch.zeros_like(param, dtype=torch.float32)
        else:
            zeros = quantize_fp8(
                torch.zeros(param.numel(), device=param.device),
                strategy.fp8_format,
                group_size=strategy.fp8_group_size,
                expand=strategy.fp8_expand,
            )
            state.update({f"{moment}_{part}": getattr(zeros, part) for part in FP8_PARTS})
    if strategy.master_weights:
        state["master"] = param.detach().to(torch.float32, copy=True)
    for key in ("param_lo", "exp_avg_sq_lo", "kahan_compensation"):
        if key in state_keys(strategy):
            state[key] = torch.zeros_like(param, memory_format=torch.preserve_format)
    return state


def _decode_moment(state: dict[str, Any], moment: str, param: torch.Tensor, strategy: PrecisionStrategy) -> torch.Tensor:
    """The moment as an FP32 tensor."""
    if strategy.moments == "fp8":
        return dequantize_fp8(_fp8_moment(state, moment, param, strategy))
    return state[moment].float()


def _encode_moment(
    state: dict[str, Any], moment: str, values: torch.Tensor, param: torch.Tensor, strategy: PrecisionStrategy
) -> None:
    """Store an FP32 moment: nearest rounding for 16-bit, per-group quantization for FP8."""
    if strategy.moments == "fp8":
        stored = _fp8_moment(state, moment, param, strategy)
        quantize_fp8_into(values, stored.payload, stored.scale, stored.expansion_exponent, strategy.fp8_group_size)
    else:
        state[moment].copy_(values)


@dataclass(frozen=True)
class StepScalars:
    """The scalars of one AdamW step, computed in Python floats (fp64) before they meet a tensor.

    They are used as Python floats (eager) or 0-d FP32 tensors (compiled); either way each is
    rounded once to FP32 where it multiplies an FP32 tensor.
    """

    beta1: float
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    eps: float
    bias_correction2_sqrt: float
    neg_step_size: float
    """-lr / (1 - beta1^t)."""
    neg_lr_weight_decay: float
    """-lr * weight_decay (decay inside the update, Collage App. D)."""
    decay_factor: float
    """1 - lr * weight_decay (multiplicative decay, as torch.optim.AdamW)."""

    @classmethod
    def for_step(cls, step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> StepScalars:
        return cls(
            beta1=beta1,
            one_minus_beta1=1 - beta1,
            beta2=beta2,
            one_minus_beta2=1 - beta2,
            eps=eps,
            bias_correction2_sqrt=(1 - beta2**step) ** 0.5,
            neg_step_size=-lr / (1 - beta1**step),
            neg_lr_weight_decay=-lr * weight_decay,
            decay_factor=1 - lr * weight_decay,
        )


def _collage_second_moment_(
    state: dict[str, Any], grad: torch.Tensor, scalars: StepScalars, beta2_expansion: tuple[Any, Any], dtype: torch.dtype
) -> torch.Tensor:
    """(v, δv) ← Grow(Mul((β̂2, δβ2), (v, δv)), (1 - β2) g²) in 16-bit MCF (Collage Alg. 2, line 9).

    Returns the represented v = v + δv in FP32.
    """
    fresh = (grad * grad * scalars.one_minus_beta2).to(dtype)
    scaled_hi, scaled_lo = mul(*beta2_expansion, state["exp_avg_sq"], state["exp_avg_sq_lo"])
    v_hi, v_lo = grow(scaled_hi, scaled_lo, fresh)
    state["exp_avg_sq"].copy_(v_hi)
    state["exp_avg_sq_lo"].copy_(v_lo)
    return v_hi.float() + v_lo.float()


def represented_value(param: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
    """The exact value the optimizer holds for ``param`` in float64: master, θ + δθ, or θ."""
    if "master" in state:
        return state["master"].double()
    if "param_lo" in state:
        return param.double() + state["param_lo"].double()
    return param.double()


def _decay_base(param: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
    """The represented θ in FP32, which weight decay shrinks (Collage App. D: decay inside the update)."""
    if "master" in state:
        return state["master"]
    if "param_lo" in state:
        return param.float() + state["param_lo"].float()
    return param.float()


def _apply_nearest(param, state, update, random_bits):
    if "master" in state:
        state["master"].copy_(state["master"] + update)
    else:
        param.copy_(param.float() + update)


def _apply_mcf(param, state, update, random_bits):
    """(θ, δθ) ← Grow((θ, δθ), Δθ) (Collage Alg. 2, line 13)."""
    hi, lo = grow(param, state["param_lo"], update.to(param.dtype))
    param.copy_(hi)
    state["param_lo"].copy_(lo)


def _apply_kahan(param, state, update, random_bits):
    """Δ' = Δθ + c; θ ← θ + Δ'; c ← Δ' - (θ_new - θ) (Collage App. C), i.e. Fast2Sum(θ, Δ')."""
    compensated = (update + state["kahan_compensation"].float()).to(param.dtype)
    new_param, compensation = fast2sum(param, compensated)
    param.copy_(new_param)
    state["kahan_compensation"].copy_(compensation)


def _apply_stochastic(param, state, update, random_bits):
    """θ ← SR(θ + Δθ) (SR paper, Alg. 1)."""
    exact = param.float() + update
    param.copy_(stochastic_round(exact, float_format(param.dtype), random_bits))


_PARAM_UPDATES = {
    "nearest": _apply_nearest,
    "mcf": _apply_mcf,
    "kahan": _apply_kahan,
    "stochastic": _apply_stochastic,
}


def adamw_kernel_(
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict[str, Any],
    strategy: PrecisionStrategy,
    scalars: StepScalars,
    beta2_expansion: tuple[Any, Any],
    random_bits: torch.Tensor | None,
    want_update: bool,
) -> torch.Tensor | None:
    """The elementwise body of one step, in place. Apart from ``moment_arithmetic="torch"`` every
    operation is a separately rounded FP32 operation (no lerp, addcmul, addcdiv, whose CPU kernels
    fuse multiply-adds), so an eager run and a compiled run round alike.

    Returns the intended FP32 update Δθ when ``want_update`` (for the update-quality metrics).
    """
    grad = grad.float()
    torch_arithmetic = strategy.moment_arithmetic == "torch"
    exp_avg = _decode_moment(state, "exp_avg", param, strategy)
    if torch_arithmetic:
        exp_avg = torch.lerp(exp_avg, grad, scalars.one_minus_beta1)
    else:
        exp_avg = exp_avg * scalars.beta1 + grad * scalars.one_minus_beta1
    if strategy.second_moment_mcf:
        exp_avg_sq = _collage_second_moment_(state, grad, scalars, beta2_expansion, param.dtype)
    elif torch_arithmetic:
        decoded = _decode_moment(state, "exp_avg_sq", param, strategy)
        exp_avg_sq = torch.addcmul(decoded * scalars.beta2, grad, grad, value=scalars.one_minus_beta2)
    else:
        decoded = _decode_moment(state, "exp_avg_sq", param, strategy)
        exp_avg_sq = decoded * scalars.beta2 + grad * grad * scalars.one_minus_beta2
    denom = exp_avg_sq.sqrt() / scalars.bias_correction2_sqrt + scalars.eps
    update = None
    if strategy.weight_decay == "multiplicative":
        master = state["master"]
        if want_update:
            update = master * scalars.neg_lr_weight_decay + scalars.neg_step_size * exp_avg / denom
        master.copy_(master * scalars.decay_factor + scalars.neg_step_size * exp_avg / denom)
    else:
        update = _decay_base(param, state) * scalars.neg_lr_weight_decay + scalars.neg_step_size * exp_avg / denom
        _PARAM_UPDATES[strategy.param_update](param, state, update, random_bits)
    if strategy.master_weights:
        param.copy_(state["master"])
    _encode_moment(state, "exp_avg", exp_avg, param, strategy)
    if not strategy.second_moment_mcf:
        _encode_moment(state, "exp_avg_sq", exp_avg_sq, param, strategy)
    return update


@torch.no_grad()
def adamw_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict[str, Any],
    strategy: PrecisionStrategy,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    random_bits: Callable[[torch.Tensor], torch.Tensor] | None = None,
    track_update_quality: bool = False,
) -> UpdateQuality | None:
    """One AdamW step on one parameter, in place, following ``strategy`` (see the module docstring).

    ``grad`` must be finite (the optimizer checks before calling). ``random_bits(param)`` returns
    uniform 32-bit words of ``param``'s shape for stochastic rounding. Returns the update-quality
    pieces when ``track_update_quality`` is set, else ``None``.
    """
    state["step"] += 1
    scalars = StepScalars.for_step(state["step"], lr, beta1, beta2, eps, weight_decay)
    beta2_expansion = expand_scalar(beta2, param.dtype) if strategy.second_moment_mcf else (None, None)
    bits = random_bits(param) if strategy.param_update == "stochastic" else None
    before = represented_value(param, state) if track_update_quality else None
    update = adamw_kernel_(param, grad, state, strategy, scalars, beta2_expansion, bits, track_update_quality)
    if before is None:
        return None
    return measure_update_quality(update, before, represented_value(param, state))


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


class AdamW(torch.optim.Optimizer):
    """AdamW with a precision strategy (``option``) that decides every storage format and rounding.

    ``option`` is a registered strategy name or alias (case-insensitive; see
    :func:`megatron_lowprec.optim.strategies.strategy_names`) or a :class:`PrecisionStrategy`.
    Parameters must be bfloat16 or float16; gradients may be bfloat16, float16 or float32.
    State is created at construction, so memory is known before the first step.

    ``master_weights=False`` drops the FP32 master of a strategy that has one (e.g. COAT with BF16
    parameters as the only copy). Stochastic rounding draws its bits from ``generator`` (a
    ``torch.Generator`` or a callable returning one, e.g. a fork of a shared RNG tracker); by default
    from a generator owned by the optimizer and seeded with ``seed``.

    Non-finite gradients: if any gradient holds NaN or inf, the whole step is skipped before any
    state is touched, and :attr:`skipped_steps` is incremented (as a loss scaler skips a step).

    With ``track_update_quality=True`` every step stores, per parameter group, the EDQ and
    imprecision pieces in :attr:`update_quality`; when off it costs no memory or time.
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
        generator: GeneratorSource | None = None,
        seed: int = 0,
        track_update_quality: bool = False,
    ) -> None:
        _check_hyperparameters(lr, betas, eps, weight_decay)
        strategy = get_strategy(option)
        if master_weights is False:
            strategy = strategy.without_master_weights()
        elif master_weights and not strategy.master_weights:
            raise ValueError(f"option {strategy.name!r} has no FP32 master weights to keep; use option 'D' or 'coat'")
        self.strategy = strategy
        self.track_update_quality = track_update_quality
        self.skipped_steps = 0
        self.update_quality: list[UpdateQuality] = []
        self._generator_source = generator
        self._own_generator: torch.Generator | None = None
        self._seed = seed
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"])
        for index, param in enumerate(group["params"]):
            check_param_dtype(param, self.strategy, f"parameter {index} of group {len(self.param_groups) - 1}")
            self.state[param] = init_state(param, self.strategy)

    @property
    def generator(self) -> torch.Generator:
        """The generator stochastic rounding draws from in the current step."""
        if self._generator_source is None:
            if self._own_generator is None:
                device = self.param_groups[0]["params"][0].device
                self._own_generator = torch.Generator(device=device).manual_seed(self._seed)
            return self._own_generator
        if isinstance(self._generator_source, torch.Generator):
            return self._generator_source
        return self._generator_source()

    def _saved_generator(self) -> torch.Generator | None:
        if self._generator_source is None:
            return self.generator
        return self._generator_source if isinstance(self._generator_source, torch.Generator) else None

    def _grads_are_finite(self) -> bool:
        flags = [
            torch.isfinite(p.grad).all() for group in self.param_groups for p in group["params"] if p.grad is not None
        ]
        return bool(torch.stack(flags).all()) if flags else True

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One AdamW step for every parameter with a gradient; see the class docstring for skips."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None and (param.grad.is_sparse or param.grad.dtype not in SUPPORTED_GRAD_DTYPES):
                    raise ValueError(
                        f"gradient of dtype {param.grad.dtype} (sparse={param.grad.is_sparse}) is not supported; "
                        f"valid: dense {', '.join(str(d) for d in SUPPORTED_GRAD_DTYPES)}"
                    )
        if not self._grads_are_finite():
            self.skipped_steps += 1
            return loss
        random_bits = None
        if self.strategy.param_update == "stochastic":
            generator = self.generator
            random_bits = lambda x: generator_random_bits(x.shape, generator, x.device)  # noqa: E731
        qualities = []
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            quality = UpdateQuality()
            for param in group["params"]:
                if param.grad is None:
                    continue
                piece = adamw_step_(
                    param,
                    param.grad,
                    self.state[param],
                    self.strategy,
                    lr=group["lr"],
                    beta1=beta1,
                    beta2=beta2,
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    random_bits=random_bits,
                    track_update_quality=self.track_update_quality,
                )
                if piece is not None:
                    quality = quality + piece
            qualities.append(quality)
        if self.track_update_quality:
            self.update_quality = qualities
        return loss

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict plus a ``lowprec`` section: option, skipped steps, SR generator state."""
        state_dict = super().state_dict()
        generator = self._saved_generator() if self.strategy.param_update == "stochastic" else None
        state_dict["lowprec"] = {
            "option": self.strategy.name,
            "skipped_steps": self.skipped_steps,
            "generator_state": None if generator is None else generator.get_state(),
        }
        return state_dict

    def _check_loaded_state(self, state_dict: dict[str, Any]) -> None:
        extra = state_dict.get("lowprec")
        if extra is None or extra["option"] != self.strategy.name:
            found = None if extra is None else extra["option"]
            raise ValueError(f"state dict was saved for option {found!r}, this optimizer runs {self.strategy.name!r}")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"state dict has {len(saved_groups)} parameter groups, optimizer has {len(self.param_groups)}")
        for saved_group, group in zip(saved_groups, self.param_groups):
            for index, param in zip(saved_group["params"], group["params"]):
                saved = state_dict["state"].get(index)
                expected = self.state[param]
                if saved is None or set(saved) != set(expected):
                    raise ValueError(f"state of parameter {index} does not hold {sorted(expected)}")
                for key, value in expected.items():
                    if torch.is_tensor(value) and (saved[key].shape != value.shape or saved[key].dtype != value.dtype):
                        raise ValueError(
                            f"state {key!r} of parameter {index}: saved {saved[key].dtype}{tuple(saved[key].shape)}, "
                            f"expected {value.dtype}{tuple(value.shape)}"
                        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore every state component bit-exactly, in its own dtype (torch would cast to the param's).

        The whole state dict is validated first; a mismatch raises ``ValueError`` and changes nothing.
        """
        self._check_loaded_state(state_dict)
        torch_part = {key: value for key, value in state_dict.items() if key != "lowprec"}
        super().load_state_dict(torch_part)
        for saved_group, group in zip(state_dict["param_groups"], self.param_groups):
            for index, param in zip(saved_group["params"], group["params"]):
                self.state[param] = {
                    key: value.to(param.device, copy=True) if torch.is_tensor(value) else value
                    for key, value in state_dict["state"][index].items()
                }
        extra = state_dict["lowprec"]
        self.skipped_steps = extra["skipped_steps"]
        generator = self._saved_generator() if self.strategy.param_update == "stochastic" else None
        if generator is not None and extra["generator_state"] is not None:
            generator.set_state(extra["generator_state"])
