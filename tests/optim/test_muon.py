"""The precision-aware Muon, tested against torch.optim.Muon and fp64 references, option by option.
Every test but the fused ones runs the eager step (``fused=False``), whose bits the fused step has
(the contract matrix, ``tests/optim/test_contract.py``), without compiling each option."""

import copy
import math

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz

from megatron_lowprec.megatron.layout import ROW
from megatron_lowprec.numerics.rounding import counter_random_bits
from megatron_lowprec.optim import get_strategy
from megatron_lowprec.optim.fused import fused_available
from megatron_lowprec.optim.muon import (
    NS_COEFFICIENTS,
    QUINTIC_COEFFICIENT_SETS,
    Muon,
    muon_strategy,
    newton_schulz,
    update_scale,
)

from ..options import OPTIONS, layout_kind, one_per_kind
from .references import in_one_buffer

TORCH_NS = ((3.4445, -4.775, 2.0315), 5, 1e-7)


def _param(values, dtype=torch.bfloat16, device=None):
    return torch.nn.Parameter(torch.as_tensor(values, dtype=torch.float32, device=device).to(dtype))


def _random(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


MASTER_TOLERANCE = 2**-6
"""Per step, in units of lr·s(m, n): how far option D's master may be from torch.optim.Muon's."""
MOMENTUM_TOLERANCE = 2**-23
"""Per unit of the summed |g| of the steps so far: how far D's FP32 momentum may be from torch's."""


@pytest.mark.parametrize("master_storage", ["fp32", "remainder"])
@pytest.mark.parametrize("shape", [(16, 24), (40, 8), (64, 64)])
@pytest.mark.parametrize(("scale_mode", "adjust_lr_fn", "nesterov"), [("shape_scaling", None, True), ("match_rms_adamw", "match_rms_adamw", False)])
def test_option_d_is_torch_muon_on_the_fp32_master_within_its_roundings(master_storage, shape, scale_mode, adjust_lr_fn, nesterov):
    """D keeps an FP32 master and FP32 momentum and runs torch's Muon on them, operation for operation
    but for the roundings: torch's two lerps (momentum, Nesterov) and ``add_(alpha=)`` round once
    (on CPUs a fused multiply-add), ours multiply and add apart (two or three roundings, the same
    eager and compiled). So the momentum stays within 2^-23 of the summed |g| (an FP32 ulp of the
    terms each step, shrunk by μ < 1 after), and the master within lr·s·2^-6 per step: where the two
    FP32 directions straddle a BF16 rounding boundary, Newton-Schulz's BF16 input differs by one BF16
    ulp, which moves its BF16 output by about a BF16 ulp (2^-8 of entries below 1) in many elements
    (seen at 64 x 64: 1.5·2^-8·lr·s at worst over 4 steps). The master is stored either way, and the
    BF16 parameter is its nearest rounding."""
    start = _random(shape, 0).bfloat16().float()
    reference = torch.nn.Parameter(start.clone())
    param = _param(start)
    param.grad_dtype = torch.float32
    hyper = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov)
    torch_muon = torch.optim.Muon([reference], adjust_lr_fn=adjust_lr_fn, **hyper)
    ours = Muon([param], scale_mode=scale_mode, option="D", master_storage=master_storage, fused=False, **hyper)
    scale = math.sqrt(max(1, shape[0] / shape[1])) if scale_mode == "shape_scaling" else 0.2 * math.sqrt(max(shape))
    summed_grads = torch.zeros(shape)
    for step in range(1, 5):
        grad = _random(shape, step)
        summed_grads += grad.abs()
        reference.grad, param.grad = grad.clone(), grad.clone()
        torch_muon.step()
        ours.step()
        state = ours.state[param]
        master = state["master"] if master_storage == "fp32" else _joined(param, state["master_remainder"])
        assert (master - reference.detach()).abs().max().item() <= step * hyper["lr"] * scale * MASTER_TOLERANCE
        momentum_error = state["momentum"] - torch_muon.state[reference]["momentum_buffer"]
        assert (momentum_error.abs() <= MOMENTUM_TOLERANCE * summed_grads).all()
    if master_storage == "fp32":
        assert torch.equal(param.detach(), master.bfloat16())


def _joined(param, remainder):
    """The FP32 master whose upper 16 bits are the BF16 ``param`` and lower 16 bits ``remainder``, by
    integer arithmetic independent of the package (the remainder is the signed distance below or
    above the BF16 value rounded to nearest, ties away; a residual shifted up by 8 bits is one)."""
    upper = param.detach().view(torch.int16).to(torch.int32) << 16
    return (upper + remainder.to(torch.int32)).view(torch.float32)


def test_scale_modes_match_torch_and_megatron_core_formulas():
    """torch's adjust_lr_fn: "original" (megatron-core's "shape_scaling") √max(1, m/n), "match_rms_adamw"
    0.2√max(m, n); megatron-core's "spectral" √max(m, n), "unit_rms_norm" √(m/n)."""
    assert update_scale((64, 16), "shape_scaling") == 2.0
    assert update_scale((16, 64), "shape_scaling") == 1.0
    assert update_scale((16, 64), "match_rms_adamw") == pytest.approx(1.6, rel=1e-15)
    assert update_scale((16, 64), "spectral") == 8.0
    assert update_scale((16, 64), "unit_rms_norm") == 0.5


CONSTANT_STEPS = 20
EXPECTED_PATH = {
    "A": "lost", "D-MW": "lost", "B": "mcf", "C": "mcf", "kahan": "kahan", "sr": "stochastic",
    "D": "master", "coat": "master", "D-BF16": "master", "sr8": "stochastic", "res8": "residual8",
}


def _constant_updates(option, shape, device):
    """Muon with momentum 0 and no decay under one constant gradient: every step applies the same
    update Δ = -lr·O, O = torch's Newton-Schulz of the gradient on the same device (BF16 matmuls
    round differently on a CPU and a GPU): lr = 1 gives |Δ| <= 0.35 (mean 0.085)
    against ulp(200) = 1."""
    grad = _random(shape, 7)
    param = _param(torch.full(shape, 200.0), device=device)
    optimizer = Muon([param], lr=1.0, weight_decay=0.0, momentum=0.0, option=option, seed=11, fused=False)
    for _ in range(CONSTANT_STEPS):
        param.grad = grad.to(device, torch.bfloat16)
        optimizer.step()
    update = -_zeropower_via_newtonschulz(grad.to(device).bfloat16().float(), *TORCH_NS).cpu().double()
    return optimizer, param, update


@pytest.mark.parametrize("option", OPTIONS)
def test_each_rounding_path_against_the_fp64_sum_of_the_updates(option, device):
    """20 updates well under half a BF16 ulp: nearest loses them all (A, D-MW); MCF holds θ + δθ at the
    sum of the BF16-rounded updates within 2^-10 per step (Grow rounds δθ < 0.5); Kahan holds θ + c
    within half an ulp of Δ + c (< 1) per step, 2^-9; an FP32 master within 2^-16 per step, a master
    of 16 significant bits (res8's residual) within half its step at 200, 2^-9, per step; SR
    moves every element in expectation (mean over 2048 elements of the error, signed by the
    update, within 5 standard deviations of 0: variance <= steps x ulp²/4 per element; nearest
    rounding would leave it at -20 x mean|Δ| = -1.7)."""
    optimizer, param, update = _constant_updates(option, (32, 64), device)
    state = {key: value.cpu() for key, value in optimizer.state[param].items() if torch.is_tensor(value)}
    values = param.detach().cpu().double()
    path = EXPECTED_PATH[option]
    if path == "lost":
        assert torch.equal(values, torch.full_like(values, 200.0))
        return
    if path == "stochastic":
        error = (values - 200 - CONSTANT_STEPS * update) * update.sign()
        assert abs(error.mean().item()) <= 5 * math.sqrt(CONSTANT_STEPS / 4 / values.numel())
        return
    if path == "mcf":
        represented, exact = values + state["param_lo"].double(), 200 + CONSTANT_STEPS * update.float().bfloat16().double()
        bound = CONSTANT_STEPS * 2**-10
    elif path == "kahan":
        represented, exact = values + state["kahan_compensation"].double(), 200 + CONSTANT_STEPS * update
        bound = CONSTANT_STEPS * 2**-9
    elif path == "residual8":
        represented, exact = _joined(param.cpu(), state["master_residual8"].to(torch.int32) << 8).double(), 200 + CONSTANT_STEPS * update
        bound = CONSTANT_STEPS * 2**-9
    else:
        master = state["master"] if "master" in state else _joined(param.cpu(), state["master_remainder"])
        represented, exact = master.double(), 200 + CONSTANT_STEPS * update
        bound = CONSTANT_STEPS * 2**-16
    assert (represented - exact).abs().max().item() <= bound
    assert (values - exact).abs().max().item() > bound


def test_stochastic_rounding_bits_are_the_counter_stream_shared_by_replicas(device):
    """Two optimizers with one seed (two replicas) round identically, with the words of the counter
    stream at (seed, step, parameter position, element); another seed rounds otherwise."""
    def trained(seed):
        params = [_param(_random((8, 32), index), device=device) for index in range(2)]
        optimizer = Muon(params, lr=0.01, option="sr", seed=seed, fused=False)
        for step in range(3):
            for index, param in enumerate(params):
                param.grad = _random((8, 32), 10 * step + index).to(device, torch.bfloat16)
            optimizer.step()
        return optimizer, params

    optimizer, first = trained(5)
    _, replica = trained(5)
    _, other = trained(6)
    assert all(torch.equal(a, b) for a, b in zip(first, replica))
    assert not all(torch.equal(a, b) for a, b in zip(first, other))
    expected = counter_random_bits(5, 2, torch.arange(8 * 32), stream=1).view(8, 32)
    assert torch.equal(optimizer.random_bits(first[1], 2).cpu(), expected)


def test_sr8_steps_a_shard_whose_groups_straddle_stream_rows_eagerly_by_default():
    """A tensor-parallel shard whose stream rows (96 elements, rank 0 of 2) split sr8's FP8 groups of
    128: with fused=None Muon steps it eagerly, decided when it is built, with one warning line naming
    its shape, to fused=False's bits; fused=True is refused in one line."""
    import warnings

    from megatron_lowprec.numerics.inductor import EagerFallbackWarning
    from megatron_lowprec.numerics.rounding import StreamLayout

    def layout(param):
        return StreamLayout.shard(5, (4, 96), 1, 0, 2)

    def trained(fused):
        param = _param(_random((4, 96), 0))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            optimizer = Muon([param], lr=0.01, option="sr8", seed=3, fused=fused, stream_layout=layout)
            for step in range(2):
                param.grad = _random((4, 96), step + 1).bfloat16()
                optimizer.step()
        return param, optimizer, [warning for warning in caught if issubclass(warning.category, EagerFallbackWarning)]

    eager, eager_optimizer, _ = trained(False)
    fallback, optimizer, caught = trained(None)
    assert torch.equal(eager.view(torch.int16), fallback.view(torch.int16))
    for key, value in eager_optimizer.state[eager].items():
        other = optimizer.state[fallback][key]
        assert torch.equal(value.view(torch.uint8), other.view(torch.uint8)) if torch.is_tensor(value) else value == other
    assert len(caught) == 1 and "(4, 96)" in str(caught[0].message)
    with pytest.raises(ValueError, match=r"option 'sr8' .* shape \(4, 96\) has stream rows of 96 elements.*use fused=False"):
        Muon([_param(_random((4, 96), 0))], option="sr8", fused=True, stream_layout=layout)


MUON_BYTES_PER_PARAM = {
    "A": 6, "B": 8, "C": 8, "D": 12, "D-MW": 8, "kahan": 8, "sr": 6, "coat": 2 + 2 + 4 + 1 + 8 / 128, "D-BF16": 8,
    "sr8": 2 + 2 + 1 + (4 + 2) / 128, "res8": 2 + 2 + 1 + (4 + 2) / 128 + 1,
}
"""BF16 parameter + BF16 gradient + Muon's state: one momentum (2, 4, or 1 + 8/G bytes for FP8 with
its per-group FP32 scale and FP32 exponent; 1 + 6/G with res8's BF16 exponent), the FP32 master
(4), its remainder (2) or its residual (1), and δθ or the Kahan compensation (2)."""


@pytest.mark.parametrize("option", OPTIONS)
def test_bytes_per_param_measured_from_the_allocated_state(option, device):
    params = [_param(_random(shape, 0), device=device) for shape in [(64, 128), (128, 256)]]
    optimizer = Muon(params, option=option, fused=False)
    numel = sum(param.numel() for param in params)
    state = sum(buffer.nbytes for bucket in optimizer.buckets for buffer in bucket.state.values())
    measured = (state + 2 * numel + 2 * numel) / numel
    assert measured == MUON_BYTES_PER_PARAM[option]
    assert muon_strategy(option).bytes_per_param(grad_reduce_in_fp32=False) == MUON_BYTES_PER_PARAM[option]


@pytest.mark.parametrize("option", OPTIONS)
def test_every_option_fits_a_small_linear_map(option, device):
    """Least squares for a 16 x 32 map: 30 steps of Muon bring the loss below a tenth of its start."""
    inputs, target = _random((64, 32), 1), _random((16, 32), 2) / 4
    outputs = inputs @ target.T
    weight = _param(torch.zeros(16, 32), device=device)
    optimizer = Muon([weight], lr=0.05, weight_decay=0.0, option=option, fused=False)
    inputs, outputs = inputs.to(device), outputs.to(device)

    def loss():
        return ((inputs.bfloat16() @ weight.T).float() - outputs).square().mean()

    start = loss().item()
    for _ in range(30):
        optimizer.zero_grad()
        loss().backward()
        optimizer.step()
    assert loss().item() < start / 10


def test_non_finite_gradient_skips_the_step_and_leaves_state_untouched(device):
    param = _param(_random((8, 16), 0), device=device)
    optimizer = Muon([param], lr=0.01, option="B", fused=False)
    param.grad = _random((8, 16), 1).to(device, torch.bfloat16)
    optimizer.step()
    before = [param.detach().clone()] + [value.clone() for value in optimizer.state[param].values() if torch.is_tensor(value)]
    param.grad[3, 5] = float("nan")
    optimizer.step()
    after = [param.detach()] + [value for value in optimizer.state[param].values() if torch.is_tensor(value)]
    assert optimizer.skipped_steps == 1
    assert optimizer.state[param]["step"] == 1
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_step_runs_the_closure_with_gradients_and_returns_its_loss(device):
    """As torch's optimizers: ``step(closure)`` evaluates the closure with autograd on (even inside
    ``no_grad``), steps on the gradients it left, and returns its loss."""
    param = _param(_random((8, 16), 0), device=device)
    optimizer = Muon([param], lr=0.01, option="D", fused=False)
    before = param.detach().clone()

    def closure():
        optimizer.zero_grad()
        loss = (param.float() ** 2).sum()
        loss.backward()
        return loss

    with torch.no_grad():
        loss = optimizer.step(closure)
    assert torch.equal(loss.detach(), (before.float() ** 2).sum()) and loss.requires_grad
    assert optimizer.state[param]["step"] == 1 and not torch.equal(param.detach(), before)


def test_a_parameter_that_is_not_2d_is_sent_to_adamw():
    with pytest.raises(ValueError, match=r"parameter 1 of group 0 has shape \(16,\) \(1-D\).*AdamW"):
        Muon([_param(torch.zeros(4, 4)), _param(torch.zeros(16))], option="A")


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        (dict(option="A", scale_mode="rms"), r"scale_mode='rms'.*shape_scaling, match_rms_adamw, spectral, unit_rms_norm"),
        (dict(option="A", momentum=1.0), r"momentum=1.0.*\[0, 1\)"),
        (dict(option="A", ns_steps=0), r"ns_steps=0"),
        (dict(option="A", ns_coefficients=((3.0, -4.0),)), r"ns_coefficients=\(\(3.0, -4.0\),\).*sequence of such triples"),
        (dict(option="A", lr=-1.0), r"lr=-1.0"),
        (dict(option="E"), r"unknown precision option 'E'; valid options: A, bf16, B"),
        (dict(option="A", master_storage="remainder"), r"option 'A' keeps no FP32 master"),
    ],
)
def test_bad_input_is_named_with_the_valid_choices(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        Muon([_param(torch.zeros(4, 4))], **kwargs)


def test_fp32_parameters_are_refused_with_the_valid_dtypes():
    with pytest.raises(ValueError, match=r"dtype torch.float32, valid dtypes: torch.bfloat16, torch.float16"):
        Muon([torch.nn.Parameter(torch.zeros(4, 4))], option="D")


@pytest.mark.parametrize("option", OPTIONS)
def test_state_dict_round_trip_continues_bit_identically(option, device):
    """A run resumed from (model, optimizer) state dicts after 2 steps ends bit-identical to the
    uninterrupted run, every state component in its own dtype (torch's default loading would cast
    the FP32 master and momentum to the BF16 parameter's dtype)."""
    grads = [_random((8, 16), seed) for seed in range(4)]

    def run(param, optimizer, steps):
        for grad in steps:
            param.grad = grad.to(device, torch.bfloat16)
            optimizer.step()

    param = _param(_random((8, 16), 9), device=device)
    optimizer = Muon([param], lr=0.01, option=option, fused=False)
    run(param, optimizer, grads[:2])
    saved_param, saved_state = param.detach().clone(), copy.deepcopy(optimizer.state_dict())
    run(param, optimizer, grads[2:])
    resumed = _param(torch.zeros(8, 16), device=device)
    resumed_optimizer = Muon([resumed], lr=0.01, option=option, fused=False)
    resumed.data.copy_(saved_param)
    resumed_optimizer.load_state_dict(saved_state)
    run(resumed, resumed_optimizer, grads[2:])
    assert torch.equal(resumed.detach(), param.detach())
    for key, value in optimizer.state[param].items():
        if torch.is_tensor(value):
            assert value.dtype == resumed_optimizer.state[resumed][key].dtype
            assert torch.equal(value.view(torch.uint8), resumed_optimizer.state[resumed][key].view(torch.uint8))


def test_c_is_b_for_muon(device):
    """Muon keeps no second moment, so C's expansion of v has nothing to act on: C keeps B's state
    and takes B's steps, bit for bit."""
    def trained(option):
        param = _param(_random((8, 16), 3), device=device)
        optimizer = Muon([param], lr=0.01, option=option, fused=False)
        for step in range(3):
            param.grad = _random((8, 16), 20 + step).to(device, torch.bfloat16)
            optimizer.step()
        return param.detach(), optimizer.state[param]

    b_param, b_state = trained("B")
    c_param, c_state = trained("C")
    assert set(c_state) == set(b_state) == {"step", "momentum", "param_lo"}
    assert torch.equal(c_param, b_param)
    assert all(torch.equal(c_state[key], b_state[key]) for key in ("momentum", "param_lo"))


def test_split_qkv_orthogonalizes_and_scales_query_key_and_value_rows_apart():
    """A fused QKV weight of 2 query groups, each 8 query rows, 4 key rows, 4 value rows (megatron's
    layout), split (megatron-core's ``split_qkv``): with option D the FP32 master moves by torch's
    Newton-Schulz of the stacked query (16 x 8), key (8 x 8) and value (8 x 8) rows, each times
    -lr·s(m, n) with its own s ("original": 2, 1, 1; one rounding), put back in place; the unsplit
    matrix is not."""
    split_rows, shape, lr = (8, 4, 4), (32, 8), 0.02
    start = _random(shape, 0).bfloat16().float()
    grad = _random(shape, 1)
    param = _param(start)
    param.grad = grad.bfloat16()
    optimizer = Muon([param], lr=lr, weight_decay=0.0, momentum=0.0, option="D", split_rows=lambda p: split_rows, fused=False)
    optimizer.step()
    grouped = grad.bfloat16().float().view(2, 16, 8)
    expected = torch.empty(2, 16, 8)
    offset = 0
    for rows in split_rows:
        stacked = grouped[:, offset:offset + rows].reshape(-1, 8)
        scale = math.sqrt(max(1, stacked.size(0) / stacked.size(1)))
        expected[:, offset:offset + rows] = (_zeropower_via_newtonschulz(stacked, *TORCH_NS).float() * (-lr * scale)).view(2, rows, 8)
        offset += rows
    assert torch.equal(optimizer.state[param]["master"], start + expected.view(shape))
    whole = -lr * _zeropower_via_newtonschulz(grad.bfloat16().float(), *TORCH_NS).float()
    assert not torch.allclose(optimizer.state[param]["master"] - start, whole, atol=1e-4)
    with pytest.raises(ValueError, match=r"split_rows=\(8, 4, 3\).*sum must divide the rows"):
        Muon([_param(torch.zeros(shape))], option="D", split_rows=lambda p: (8, 4, 3))


FUSED_SHAPES = [(16, 24), (40, 8), (3, 5), (32, 8)]
"""Wide, tall and tiny weights (none a multiple of the bucket's 128-element alignment but the last),
the last a fused QKV weight of two query groups split (8, 4, 4)."""


@pytest.mark.skipif(not fused_available(torch.device("cpu")), reason="no C++ compiler for Inductor")
def test_option_d_with_its_master_as_a_remainder_steps_fused_with_the_eager_bits():
    """The contract matrix (``tests/optim/test_contract.py``) steps every registered option fused and
    eager; D with its FP32 master stored as a remainder below the parameter too: its owned fused
    cell, the eager step's bits in every parameter and state tensor, two compiled regions per step and
    no recompilation."""
    from .test_contract import _check_muon_cell

    _check_muon_cell("owned", get_strategy("D").with_master_storage("remainder"), "fused")


@pytest.mark.parametrize(
    "option,layout",
    [(option, "own") for option in OPTIONS]
    + [(option, layout) for option in one_per_kind(OPTIONS, layout_kind) for layout in ("megatron", "foreign gaps")],
)
def test_uncompiled_fused_calls_run_in_pieces_with_the_eager_steps_bits(option, layout, monkeypatch):
    """While their compile is pending (background compilation) the fused step's momentum and update
    calls run uncompiled, in pieces of at most ``EAGER_WINDOW_ELEMENTS`` elements (here 128: the
    bucket in 9 pieces, the wide weight in 3), whose directions are joined for Newton-Schulz: the
    eager step's bits in every parameter and state tensor over 3 steps, stochastic rounding over the
    whole bucket as on GPUs; also with the weights left in a buffer (``params_in_buffer``), read and
    written there a piece at a time: in megatron's layout (the weights one after the other, each
    start padded to 64 elements with zeros) one bucket laid out in place (FP8 moments': as rows, the
    weights off their FP8 groups); with another owner's elements between the weights, a bucket per
    weight, laid out in place or (FP8 moments' weights that are not whole FP8 groups) as rows."""
    from megatron_lowprec.optim import fused as fused_module
    from megatron_lowprec.optim import muon as muon_module
    from megatron_lowprec.optim.background_compile import BackgroundCompiles

    monkeypatch.setattr(fused_module, "EAGER_WINDOW_ELEMENTS", 128)
    monkeypatch.setattr(fused_module, "BACKGROUND_COMPILES", BackgroundCompiles())
    monkeypatch.setattr(fused_module, "BUCKET_STREAM_DEVICES", ("cuda", "cpu"))
    calls, kernel = [], muon_module.muon_momentum_kernel_
    monkeypatch.setattr(muon_module, "muon_momentum_kernel_", lambda *args: calls.append(1) or kernel(*args))
    start = [_random(shape, index).bfloat16() for index, shape in enumerate(FUSED_SHAPES)]
    eager_params = [torch.nn.Parameter(values.clone()) for values in start]
    eager = Muon(eager_params, lr=0.02, option=option, fused=False, seed=3)
    in_buffer = layout != "own"
    if in_buffer:
        fused_params, buffer, outside = in_one_buffer(start, megatron=layout == "megatron")
        kept = buffer[outside].clone()
    else:
        fused_params = [torch.nn.Parameter(values.clone()) for values in start]
    fused = Muon(
        fused_params, lr=0.02, option=option, fused=True, seed=3, background_compile=True, params_in_buffer=in_buffer, buffer_row=ROW,
    )
    in_place = [bucket.in_place for bucket in fused.buckets]
    if layout == "megatron":
        assert in_place == [get_strategy(option).moments != "fp8"]
    elif layout == "foreign gaps":
        assert len(in_place) == len(FUSED_SHAPES) and any(in_place)
        assert all(bucket.in_place or bucket.param_rows is not None for bucket in fused.buckets)
    for step in range(3):
        for index, (p, q) in enumerate(zip(eager_params, fused_params)):
            p.grad = (_random(p.shape, 100 * step + index) * 10.0 ** (step - 1)).bfloat16()
            q.grad = p.grad.clone()
        eager.step()
        calls.clear()
        fused.step()
        assert len(calls) == sum(-(-bucket.numel // 128) for bucket in fused.buckets)
        if in_buffer:
            assert torch.equal(buffer[outside].view(torch.int16), kept.view(torch.int16)), step
    for index, (p, q) in enumerate(zip(eager_params, fused_params)):
        assert torch.equal(p.detach().view(torch.int16), q.detach().view(torch.int16)), index
        for key, value in eager.state[p].items():
            other = fused.state[q][key]
            assert torch.equal(value.view(torch.uint8), other.view(torch.uint8)) if torch.is_tensor(value) else value == other, key


@pytest.mark.skipif(not fused_available(torch.device("cpu")), reason="no C++ compiler for Inductor")
def test_fused_step_in_a_buffer_it_does_not_own_is_the_eager_step_in_place():
    """``params_in_buffer=True``, option D-BF16, with another owner's elements between the weights
    (without the owner's ``buffer_row``, its buckets read them as rows):
    the parameters stay views of the buffer they live in (those elements untouched), each weight a
    bucket laid out in place there (the remainder master joined and split there), with the eager
    step's bits in every parameter and state tensor over 3 steps, compiled. A parameter moved out of
    the buffer then makes its bucket step eagerly, with a warning, the same bits. (Stochastic
    rounding, whose calls on a CPU run per weight over its slice of the buffer, the plain step's
    code: tests/megatron/test_build_optimizer.py, in megatron's layout.)"""
    option = "D-BF16"
    from megatron_lowprec.optim.fused import EagerFallbackWarning

    start = [_random(shape, index).bfloat16() for index, shape in enumerate(FUSED_SHAPES)]
    eager_params = [torch.nn.Parameter(value.clone()) for value in start]
    params, buffer, gaps = in_one_buffer(start)
    eager = Muon(eager_params, lr=0.02, option=option, fused=False, seed=3)
    unknown_row = Muon(params, lr=0.02, option=option, fused=True, params_in_buffer=True, seed=3)
    assert all(not bucket.in_place and bucket.param_rows is not None for bucket in unknown_row.buckets)
    fused = Muon(params, lr=0.02, option=option, fused=True, params_in_buffer=True, buffer_row=ROW, seed=3)
    assert all(bucket.in_place and bucket.param_buffer.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
               for bucket in fused.buckets)
    for step in range(4):
        if step == 3:
            params[1].data = params[1].detach().clone()
        for index, (p, q) in enumerate(zip(eager_params, params)):
            p.grad = (_random(p.shape, 100 * step + index) * 10.0 ** (step - 1)).bfloat16()
            q.grad = p.grad.clone()
        eager.step()
        if step < 3:
            fused.step()
            assert all(param.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr() for param in params)
        else:
            with pytest.warns(EagerFallbackWarning, match="no longer contiguous views of one buffer"):
                fused.step()
        assert torch.equal(buffer[gaps], torch.full_like(buffer[gaps], 7.0)), step
        for index, (p, q) in enumerate(zip(eager_params, params)):
            assert torch.equal(p.detach().view(torch.int16), q.detach().view(torch.int16)), (step, index)
            for key, value in eager.state[p].items():
                other = fused.state[q][key]
                assert torch.equal(value.view(torch.uint8), other.view(torch.uint8)) if torch.is_tensor(value) else value == other, key


def _megatron_core_muon():
    """megatron-core's own Muon module (``TensorParallelMuon`` on NVIDIA's emerging-optimizers), where
    it imports: the newest-megatron CI job (.ci/megatron_newest.sh) installs both; elsewhere skip."""
    emerging = pytest.importorskip("megatron.core.optimizer.emerging_optimizers", reason="megatron-core 0.17+ is not installed")
    if not emerging.HAVE_EMERGING_OPTIMIZERS:
        pytest.skip("emerging-optimizers is not installed")
    return emerging


MEGATRON_COEFFICIENTS = {"simple": NS_COEFFICIENTS, "quintic": QUINTIC_COEFFICIENT_SETS}
"""megatron-core's names of the coefficient sets, and ours (the scale modes share megatron-core's names)."""


@pytest.mark.parametrize("steps", [5, 7])
@pytest.mark.parametrize("coefficient_type", ["simple", "quintic"])
@pytest.mark.parametrize("shape", [(32, 32), (16, 64), (64, 16)])
def test_newton_schulz_is_megatron_cores_bit_for_bit_where_the_normalization_is_exact(coefficient_type, shape, steps):
    """Where normalising is exact in BF16 and FP32 alike (entries ±3 over 1024 elements: norm 96,
    quotient ±2^-5), our Newton-Schulz is emerging-optimizers' at megatron's default
    ``fp32_matmul_prec="medium"`` (BF16 matmuls) bit for bit: the same triple per iteration
    (``quintic`` cycled past five), the same addmm's, the same transposition of a tall matrix."""
    _megatron_core_muon()
    from emerging_optimizers.orthogonalized_optimizers.muon_utils import newton_schulz as megatron_newton_schulz
    from emerging_optimizers.utils import fp32_matmul_precision

    signs = torch.randint(0, 2, shape, generator=torch.Generator().manual_seed(3)) * 2 - 1
    matrix = signs.float() * 3
    with fp32_matmul_precision("medium"):
        expected = megatron_newton_schulz(matrix, steps, coefficient_type)
    assert torch.equal(newton_schulz(matrix, MEGATRON_COEFFICIENTS[coefficient_type], steps).float(), expected)


NEWTON_SCHULZ_INPUT_TOLERANCE = 0.05
"""How far (in Frobenius norm, relative to it) one step's update of D's master may be from
megatron-core's Muon's. The arithmetic differs in one place that matters: our (torch's) Newton-Schulz
rounds the momentum to BF16 and normalises it there, emerging-optimizers normalises in FP32 and then
rounds, so the BF16 iterations start one BF16 rounding (2^-9 relative) apart and carry it to the
output. Measured on these weights over 6 steps and 4 seeds: at most 1.0% with the ``quintic`` set,
2.6% with ``simple`` (whose iteration oscillates more); with our input normalised in FP32 first, the
difference falls to 4e-6. The rest differs in FP32's last bits only (decay as θ(1-lr·λ) against
θ - lr·λ·θ, the scale folded into the step size against multiplied into the update, the momentum by
lerp or by separately rounded products). The wrong coefficient set moves it by 24% or more,
Nesterov on or off by 46% or more, a wrong scale mode by a factor of 2 or more."""


@pytest.mark.parametrize(
    ("coefficient_type", "scale_mode", "nesterov", "split_qkv"),
    [("quintic", "spectral", True, True), ("simple", "shape_scaling", False, False), ("quintic", "unit_rms_norm", True, False)],
)
def test_option_d_steps_as_megatron_cores_muon(coefficient_type, scale_mode, nesterov, split_qkv):
    """Option D (FP32 master and momentum) against megatron-core's ``TensorParallelMuon`` with the same
    hyperparameters (coefficient set, 5 steps, scale mode times extra scale factor, Nesterov, split
    QKV into a fused weight's query, key and value rows per group, decoupled weight decay), on FP32
    weights and gradients, 4 steps: the momentum is megatron's within 2 FP32 ulps of the gradient's
    scale per step (bit for bit where both run torch's lerp), and each step's update of the master,
    both starting from our master, is megatron's within :data:`NEWTON_SCHULZ_INPUT_TOLERANCE` (the
    momentum depends on the gradients only, so it is compared along the whole run)."""
    emerging = _megatron_core_muon()
    shapes, qkv_rows = [(48, 32), (64, 32), (32, 96)], (8, 4, 4)
    starts = [_random(shape, index).mul(0.02).bfloat16().float() for index, shape in enumerate(shapes)]
    params = [_param(start) for start in starts]
    references = [torch.nn.Parameter(start.clone()) for start in starts]
    for param in params:
        param.grad_dtype = torch.float32
    hyper = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=nesterov)
    megatron_muon = emerging.TensorParallelMuon(
        references, **hyper, split_qkv=split_qkv, is_qkv_fn=lambda param: param is references[0], qkv_split_shapes=list(qkv_rows),
        coefficient_type=coefficient_type, num_ns_steps=5, scale_mode=scale_mode, extra_scale_factor=0.2, tp_mode="blockwise",
    )
    ours = Muon(
        params, **hyper, ns_coefficients=MEGATRON_COEFFICIENTS[coefficient_type], ns_steps=5,
        scale_mode=scale_mode, extra_scale_factor=0.2, option="D",
        split_rows=lambda param: qkv_rows if split_qkv and param is params[0] else None,
    )
    largest_gradient = 0.0
    for step in range(4):
        before = [ours.state[param]["master"].clone() for param in params]
        for index, (param, reference, master) in enumerate(zip(params, references, before)):
            grad = _random(param.shape, 10 * step + index)
            largest_gradient = max(largest_gradient, grad.abs().max().item())
            param.grad, reference.grad = grad.clone(), grad.clone()
            reference.data.copy_(master)
        ours.step()
        megatron_muon.step()
        for param, reference, master in zip(params, references, before):
            state = ours.state[param]
            momentum_difference = (state["momentum"] - megatron_muon.state[reference]["momentum_buffer"]).abs().max().item()
            assert momentum_difference <= (step + 1) * 2**-22 * largest_gradient, (step, momentum_difference)
            update, expected = state["master"] - master, reference.detach() - master
            assert (update - expected).norm() <= NEWTON_SCHULZ_INPUT_TOLERANCE * expected.norm(), step


def test_a_buffer_row_that_is_not_a_power_of_two_dividing_the_alignment_is_refused():
    with pytest.raises(ValueError, match=r"buffer_row=48: must be a power of two dividing 128, or None"):
        Muon([torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.bfloat16))], option="A", params_in_buffer=True, buffer_row=48)
