"""The precision-aware AdamW family, tested as a matrix of options against independent references."""

import copy
import math
from fractions import Fraction

import pytest
import torch

from megatron_lowprec.numerics.rounding import StreamLayout, counter_random_bits
from megatron_lowprec.optim import AdamW, get_strategy, state_keys, strategy_names

from ..allocations import measure_allocations
from .conftest import OPTIONS


def _param(values, dtype=torch.bfloat16, device=None):
    return torch.nn.Parameter(torch.as_tensor(values, dtype=torch.float32, device=device).to(dtype))


def _compiled_off_the_cpu(device):
    """``fused`` for the tests of an option's arithmetic or behaviour: eager on the CPU, where the
    contract matrix (tests/optim/test_contract.py) proves that the compiled step has the eager step's
    bits; the default (compiled where it can be) on GPUs, which that matrix does not run on."""
    return None if torch.device(device).type == "cuda" else False


def _constant_update_optimizer(param, option, lr):
    """beta1 = beta2 = 0 and gradient -1 make AdamW's update exactly +lr each step (eps below half an FP32 ulp)."""
    return AdamW([param], lr=lr, betas=(0.0, 0.0), eps=1e-9, weight_decay=0.0, option=option,
                 fused=_compiled_off_the_cpu(param.device))


def _represented(optimizer, param):
    state = optimizer.state[param]
    if "master" in state:
        return state["master"].double()
    if "param_lo" in state:
        return param.detach().double() + state["param_lo"].double()
    return param.detach().double()


def _run_constant_update(option, steps, start=200.0, lr=0.1, numel=1, device=None):
    param = _param([start] * numel, device=device)
    optimizer = _constant_update_optimizer(param, option, lr)
    for _ in range(steps):
        param.grad = torch.full_like(param, -1.0)
        optimizer.step()
    return optimizer, param


def test_lost_arithmetic_under_option_a(device):
    """Collage §3.1: BF16 200 + 0.1 is 200, step after step."""
    _, param = _run_constant_update("A", steps=100, device=device)
    assert param.item() == 200.0


@pytest.mark.parametrize("option", ["B", "C", "D"])
def test_exact_accumulation_under_collage_and_master_weights(option, device):
    """B, C, D accumulate the 100 updates: the represented value moves by 100 x the applied update.

    MCF keeps the BF16 increment Δ = bf16(0.1) = 205/2048 with δθ within ulp(θ)/2; every partial sum
    200 + kΔ has at most 8 + 11 significant bits, so the pair (θ, δθ) may round δθ by up to ulp(δθ)/2
    <= 2^-10 per step (δθ < 0.5). The FP32 master rounds by ulp_fp32(256)/2 = 2^-17 per step.
    """
    steps = 100
    optimizer, param = _run_constant_update(option, steps, device=device)
    applied = Fraction(float(torch.tensor(0.1, dtype=torch.float32).to(torch.bfloat16)))
    per_step_bound = Fraction(1, 2**17)
    if option == "D":
        applied = Fraction(float(torch.tensor(0.1, dtype=torch.float32)))
    else:
        per_step_bound = Fraction(1, 2**10)
    exact = 200 + steps * applied
    represented = Fraction(_represented(optimizer, param).item())
    assert abs(represented - exact) <= steps * per_step_bound
    assert param.item() == 210.0


@pytest.mark.parametrize("option", ["sr", "sr8"])
def test_stochastic_rounding_moves_in_expectation(option, device):
    """E[SR(x)] = x: the mean over 4096 independently rounded copies tracks 200 + 100 x 0.1 (sr8's
    FP8 moments hold the constant m = -1 and v = 1 exactly).

    Each step adds a Bernoulli error of variance <= ulp²/4 = 1/4 per element, so after 100 steps an
    element's variance is <= 25 and the mean of 4096 elements has standard deviation <= 5/64; the test
    allows 5 standard deviations.
    """
    numel, steps = 4096, 100
    _, param = _run_constant_update(option, steps, numel=numel, device=device)
    mean = param.double().mean().item()
    exact = 200 + steps * float(torch.tensor(0.1, dtype=torch.float32))
    assert abs(mean - exact) <= 5 * 5 / math.sqrt(numel)
    assert param.double().std().item() > 0


def _second_moment_after(option, gradients, beta2, device=None):
    param = _param([1.0], device=device)
    optimizer = AdamW([param], lr=1e-6, betas=(0.9, beta2), eps=1e-8, weight_decay=0.0, option=option,
                      fused=_compiled_off_the_cpu(param.device))
    history = []
    for value in gradients:
        param.grad = torch.tensor([value], dtype=torch.bfloat16, device=device)
        optimizer.step()
        state = optimizer.state[param]
        v = state["exp_avg_sq"].double()
        if "exp_avg_sq_lo" in state:
            v = v + state["exp_avg_sq_lo"].double()
        history.append(v.item())
    return history


def _fp64_second_moment(gradients, beta2):
    v, history = 0.0, []
    for value in gradients:
        v = beta2 * v + (1 - beta2) * value * value
        history.append(v)
    return history


def test_bf16_second_moment_never_decays_with_beta2_0_999(device):
    """Under A, v·0.999 rounds back to v in BF16: v only grows for a constant-then-zero gradient."""
    gradients = [1.0] * 50 + [0.0] * 200
    history = _second_moment_after("A", gradients, beta2=0.999, device=device)
    assert all(later >= earlier for earlier, later in zip(history, history[1:]))
    assert history[-1] == history[49]


def test_collage_plus_second_moment_decays_like_fp64(device):
    """Under C, (v, δv) tracks the fp64 recursion. The fresh term (1-β2)g² enters as one BF16 value
    (relative error <= 2^-9, Collage Alg. 2 line 9), and each Mul+Grow adds a relative error of order
    2^-15 (a length-2 BF16 expansion holds 16 significant bits): after n steps the relative error is
    at most 2^-9 + n·2^-14."""
    gradients = [1.0] * 50 + [0.0] * 200
    history = _second_moment_after("C", gradients, beta2=0.999, device=device)
    reference = _fp64_second_moment(gradients, beta2=0.999)
    for step, (got, want) in enumerate(zip(history, reference), start=1):
        assert abs(got - want) <= (2**-9 + step * 2**-14) * want
    assert history[-1] / history[49] == pytest.approx(0.999**200, rel=200 * 2**-14)


def _state_nbytes(optimizer):
    return sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for value in state.values()
        if torch.is_tensor(value)
    )


@pytest.mark.parametrize("shapes", [[(64, 32), (256,)], [(7, 13), (1000,), (3,)]])
def test_bytes_per_param_measured_from_state_tensors(option, shapes, device):
    params = [_param(torch.randn(shape), device=device) for shape in shapes]
    optimizer = AdamW(params, option=option)
    numel = sum(p.numel() for p in params)
    grad_bytes = 2 * numel
    measured = (_state_nbytes(optimizer) + sum(p.numel() * p.element_size() for p in params) + grad_bytes) / numel
    expected = sum(get_strategy(option).bytes_per_param(p.numel(), grad_reduce_in_fp32=False) * p.numel() for p in params) / numel
    assert measured == pytest.approx(expected, rel=0, abs=1e-12)
    if get_strategy(option).moments != "fp8":
        assert measured == get_strategy(option).bytes_per_param(grad_reduce_in_fp32=False)


def test_construction_allocates_the_state_and_no_temporaries(option):
    """Measured with the CPU allocator: building the optimizer allocates its state buffers (zero FP8
    moments included) and nothing besides, so a run's peak memory is not its construction."""
    params = [_param(torch.randn(shape)) for shape in [(300, 333), (4097,), (7,)]]
    allocations = measure_allocations(lambda: AdamW(params, option=option, fused=False))
    state_bytes = sum(buffer.nbytes for bucket in allocations.result.buckets for buffer in bucket.state.values())
    assert allocations.end == pytest.approx(state_bytes, rel=1e-3)
    assert allocations.peak <= 1.01 * state_bytes


def test_state_keys_are_exactly_the_strategy_components(option, device):
    param = _param(torch.randn(10), device=device)
    optimizer = AdamW([param], option=option)
    assert set(optimizer.state[param]) == set(state_keys(get_strategy(option))) | {"step"}


def _regression_problem(seed=0, device=None):
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(256, 16, generator=generator)
    teacher = torch.randn(16, 1, generator=generator)
    targets = torch.tanh(inputs @ teacher)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    torch.manual_seed(seed)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            layer.reset_parameters()
    return model.to(device, torch.bfloat16), inputs.to(device, torch.bfloat16), targets.to(device, torch.bfloat16)


def _train(model, optimizer, inputs, targets, steps):
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(inputs).float(), targets.float())
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_every_option_trains_a_small_model(option, device):
    """60 steps of a small regression bring the mean of the last ten losses below a quarter of the first
    (eager on the CPU: what trains is the option's arithmetic, :func:`_compiled_off_the_cpu`)."""
    model, inputs, targets = _regression_problem(device=device)
    optimizer = AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, option=option,
                      fused=_compiled_off_the_cpu(device))
    losses = _train(model, optimizer, inputs, targets, steps=60)
    assert all(math.isfinite(loss) for loss in losses)
    assert sum(losses[-10:]) / 10 < 0.25 * losses[0]


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_option_d_is_torch_fused_adamw_on_the_fp32_master(fused, grad_dtype, device):
    """Option D updates the FP32 master with torch's fused AdamW kernel: after 100 steps the master
    is bit-identical to torch.optim.AdamW(fused=True) on FP32 copies of the parameters, and the BF16
    parameter is its nearest rounding. Sizes leave vector tails (561, 129, 5) and need several
    windows of FP32 gradient (20000)."""
    generator = torch.Generator().manual_seed(1)
    shapes = [(33, 17), (129,), (5,), (20000,)]
    start = [torch.randn(shape, generator=generator).to(device, torch.bfloat16) for shape in shapes]
    ours = [torch.nn.Parameter(t.clone()) for t in start]
    for p in ours:
        p.grad_dtype = grad_dtype
    reference = [torch.nn.Parameter(t.float()) for t in start]
    hyper = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    optimizer = AdamW(ours, option="D", fused=fused, **hyper)
    reference_optimizer = torch.optim.AdamW(reference, **hyper, fused=True)
    for _ in range(100):
        for p, q in zip(ours, reference):
            grad = (torch.randn(p.shape, generator=generator) * 1e-2).to(device, grad_dtype)
            p.grad, q.grad = grad, grad.float()
        optimizer.step()
        reference_optimizer.step()
    for p, q in zip(ours, reference):
        master = optimizer.state[p]["master"]
        assert torch.equal(master.view(torch.int32), q.detach().view(torch.int32))
        assert torch.equal(optimizer.state[p]["exp_avg_sq"], reference_optimizer.state[q]["exp_avg_sq"])
        assert torch.equal(p.detach(), master.bfloat16())


def _snapshot(model, optimizer):
    return copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())


def _state_kind(option):
    strategy = get_strategy(option)
    return strategy.param_update, frozenset(state_keys(strategy))


FUSED_ROUND_TRIPS = [
    option for option in OPTIONS
    if not any(_state_kind(option)[0] == update and _state_kind(option)[1] < keys for update, keys in map(_state_kind, OPTIONS))
]
"""The options whose state dict round trip runs the compiled step on the CPU: those whose state
components no other option with the same parameter update holds together with more (A's moments are
in D's state, B's in C's); the others' compiled resume would load and step the same components."""


def test_state_dict_round_trip_continues_bit_identically(option, device):
    """10 steps, a state dict, 10 more steps against a fresh model and optimizer (another seed) that
    load both: the same losses, parameters and state bits. Compiled (the default) for
    :data:`FUSED_ROUND_TRIPS` and on GPUs: the resume of the compiled step over the optimizer's own
    buffers, which no other test takes; eager for the rest (:func:`_compiled_off_the_cpu`)."""
    fused = None if option in FUSED_ROUND_TRIPS else _compiled_off_the_cpu(device)
    model, inputs, targets = _regression_problem(seed=3, device=device)
    optimizer = AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, option=option, seed=7, fused=fused)
    _train(model, optimizer, inputs, targets, steps=10)
    model_state, optimizer_state = _snapshot(model, optimizer)
    straight = _train(model, optimizer, inputs, targets, steps=10)

    resumed_model, _, _ = _regression_problem(seed=99, device=device)
    resumed_model.load_state_dict(model_state)
    resumed_optimizer = AdamW(resumed_model.parameters(), lr=1e-2, weight_decay=0.1, option=option, seed=12345,
                              fused=fused)
    resumed_optimizer.load_state_dict(optimizer_state)
    resumed = _train(resumed_model, resumed_optimizer, inputs, targets, steps=10)

    assert resumed == straight
    for p, q in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(p, q)
        for key, value in optimizer.state[p].items():
            other = resumed_optimizer.state[q][key]
            if torch.is_tensor(value):
                assert other.dtype == value.dtype
                assert torch.equal(value.view(torch.uint8), other.view(torch.uint8)), key
            else:
                assert other == value


def test_load_state_dict_rejects_another_option_without_changing_state(device):
    param = _param(torch.randn(8), device=device)
    optimizer = AdamW([param], option="C")
    other = AdamW([_param(torch.randn(8), device=device)], option="A")
    before = copy.deepcopy(optimizer.state[param])
    with pytest.raises(ValueError, match="'A'"):
        optimizer.load_state_dict(other.state_dict())
    for key, value in before.items():
        assert torch.equal(torch.as_tensor(value), torch.as_tensor(optimizer.state[param][key]))


def test_unknown_option_lists_valid_names():
    with pytest.raises(ValueError) as error:
        AdamW([_param([1.0])], option="collage_max")
    for name in strategy_names():
        assert name in str(error.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_parameter_dtype_the_option_cannot_hold_is_rejected_at_construction(option, dtype):
    with pytest.raises(ValueError, match=str(dtype)):
        AdamW([torch.nn.Parameter(torch.ones(3, dtype=dtype))], option=option)


@pytest.mark.parametrize(
    "hyper, fragment",
    [(dict(lr=-1.0), "lr=-1.0"), (dict(betas=(1.0, 0.9)), "betas\\[0\\]"), (dict(eps=0.0), "eps=0.0"),
     (dict(weight_decay=-0.1), "weight_decay")],
)
def test_bad_hyperparameters_are_named(hyper, fragment):
    with pytest.raises(ValueError, match=fragment):
        AdamW([_param([1.0])], option="A", **hyper)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_gradient_skips_the_step_and_leaves_state_untouched(option, bad, device):
    """Eager on the CPU (:func:`_compiled_off_the_cpu`): the skip is decided before either path runs;
    the check over a fused bucket's own gradient buffer is
    test_the_finiteness_check_reads_a_bucket_s_own_gradient_buffer_in_one_pass."""
    params = [_param(torch.randn(300), device=device), _param(torch.randn(4, 4), device=device)]
    optimizer = AdamW(params, lr=1e-2, option=option, fused=_compiled_off_the_cpu(device))
    for p in params:
        p.grad = torch.randn(p.shape).to(device, torch.bfloat16)
    optimizer.step()
    before_params = [p.detach().clone() for p in params]
    before_state = copy.deepcopy(optimizer.state_dict())
    params[0].grad = torch.randn(300).to(device, torch.bfloat16)
    params[1].grad = torch.randn(4, 4).to(device, torch.bfloat16)
    params[1].grad[2, 3] = bad
    optimizer.step()
    assert optimizer.skipped_steps == 1
    after_state = optimizer.state_dict()
    for p, q in zip(params, before_params):
        assert torch.equal(p.detach(), q)
    for index, state in before_state["state"].items():
        for key, value in state.items():
            if torch.is_tensor(value):
                assert torch.equal(value.view(torch.uint8), after_state["state"][index][key].view(torch.uint8))
                assert torch.isfinite(after_state["state"][index][key].float()).all()
            else:
                assert value == after_state["state"][index][key]


def test_fp32_gradients_are_accepted(option, device):
    """Eager on the CPU (:func:`_compiled_off_the_cpu`): the fused step on FP32 gradients is checked
    against the eager one bit for bit in tests/optim/test_fused.py."""
    param = _param(torch.randn(64), device=device)
    optimizer = AdamW([param], lr=1e-2, option=option, fused=_compiled_off_the_cpu(device))
    param.grad_dtype = None
    param.grad = torch.randn(64, device=device)
    optimizer.step()
    assert optimizer.state[param]["step"] == 1


def test_update_quality_shows_lost_arithmetic_under_a_and_none_under_c(device):
    """Eager on the CPU (:func:`_compiled_off_the_cpu`): the fused step's update quality is the eager
    step's (tests/optim/test_fused.py)."""
    def quality(option):
        param = _param([200.0] * 64 + [1.0] * 64, device=device)
        optimizer = AdamW([param], lr=0.1, betas=(0.0, 0.0), eps=1e-9, weight_decay=0.0, option=option,
                          track_update_quality=True, fused=_compiled_off_the_cpu(device))
        param.grad = torch.full_like(param, -1.0)
        optimizer.step()
        return optimizer.update_quality[0]

    lossy, exact = quality("A"), quality("C")
    assert lossy.intended_nonzero == exact.intended_nonzero == 128
    assert lossy.lost == 64 and lossy.imprecision_percent == 50.0
    assert exact.lost == 0
    intended_norm = math.sqrt(128) * float(torch.tensor(0.1, dtype=torch.float32))
    assert exact.edq == pytest.approx(intended_norm, rel=2**-8)
    assert lossy.edq < exact.edq


def test_option_d_without_torch_s_fused_kernel_is_refused_by_name(monkeypatch):
    from megatron_lowprec.optim import torch_fused

    monkeypatch.delattr(torch, "_fused_adamw_")
    torch_fused._kernel_available.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"option 'D' .*torch._fused_adamw_ does not exist"):
            AdamW([_param(torch.randn(8))], option="D")
    finally:
        monkeypatch.undo()
        torch_fused._kernel_available.cache_clear()
    AdamW([_param(torch.randn(8))], option="D")


def test_update_quality_of_option_d_sees_the_fp32_master_lose_what_it_cannot_hold():
    """D's intended update is torch's fused AdamW update in float64; the FP32 master holds a step of
    1e-3 at 1 (ulp 2^-23) but loses it at 2^24 (ulp 2)."""
    param = _param([1.0] * 64 + [2.0**24] * 64)
    optimizer = AdamW([param], lr=1e-3, betas=(0.0, 0.0), eps=1e-9, weight_decay=0.0, option="D",
                      track_update_quality=True)
    param.grad = torch.full_like(param, -1.0)
    optimizer.step()
    quality = optimizer.update_quality[0]
    assert quality.intended_nonzero == 128 and quality.lost == 64
    assert quality.edq == pytest.approx(64 * 1e-3 / math.sqrt(128), rel=1e-4)


def test_update_quality_is_off_by_default(device):
    param = _param(torch.randn(16), device=device)
    optimizer = AdamW([param], option="C")
    param.grad = torch.randn(16).to(device, torch.bfloat16)
    optimizer.step()
    assert optimizer.update_quality == []


def test_stochastic_rounding_uses_the_given_generator(device):
    def run(generator):
        param = _param(torch.full((512,), 200.0), device=device)
        optimizer = AdamW([param], lr=0.1, betas=(0.0, 0.0), eps=1e-9, weight_decay=0.0, option="sr",
                          generator=generator)
        param.grad = torch.full_like(param, -1.0)
        optimizer.step()
        return param.detach().clone()

    same_a = run(torch.Generator(device).manual_seed(5))
    same_b = run(lambda: torch.Generator(device).manual_seed(5))
    other = run(torch.Generator(device).manual_seed(6))
    assert torch.equal(same_a, same_b)
    assert not torch.equal(same_a, other)


def test_coat_without_master_keeps_bf16_parameters_only(device):
    param = _param(torch.randn(256), device=device)
    optimizer = AdamW([param], option="coat", master_weights=False)
    assert "master" not in optimizer.state[param]
    with pytest.raises(ValueError, match="no FP32 master"):
        AdamW([_param(torch.randn(4))], option="A", master_weights=True)


@pytest.mark.parametrize("option_name", OPTIONS)
def test_moments_stay_finite_under_large_gradients(option_name, device):
    """Gradients of 1e-30, 1e15 and 1: every state component stays finite (eager on the CPU: the
    arithmetic under test is the kernel's, :func:`_compiled_off_the_cpu`)."""
    param = _param(torch.randn(512), device=device)
    optimizer = AdamW([param], lr=1e-3, option=option_name, fused=_compiled_off_the_cpu(device))
    for scale in (1e-30, 1e15, 1.0):
        param.grad = (torch.randn(512) * scale).to(device, torch.bfloat16)
        optimizer.step()
    for value in optimizer.state[param].values():
        if torch.is_tensor(value):
            assert torch.isfinite(value.float()).all()


def test_generator_driven_stochastic_rounding_resumes_bit_identically(device):
    def run(generator, state=None, steps=5):
        param = _param(torch.full((256,), 3.0), device=device)
        optimizer = AdamW([param], lr=1e-3, option="sr", generator=generator)
        if state is not None:
            param.data.copy_(state[0])
            optimizer.load_state_dict(state[1])
        for _ in range(steps):
            param.grad = torch.full_like(param, -1.0)
            optimizer.step()
        return param.detach().clone(), copy.deepcopy(optimizer.state_dict())

    straight, _ = run(torch.Generator(device).manual_seed(11), steps=10)
    half = run(torch.Generator(device).manual_seed(11), steps=5)
    resumed, _ = run(torch.Generator(device).manual_seed(999), state=half)
    assert torch.equal(resumed, straight)


def _train_sr(params, grads, stream_layout, fused, steps=4):
    optimizer = AdamW(params, lr=1e-2, weight_decay=0.1, option="sr", seed=9, fused=fused, stream_layout=stream_layout)
    for step in range(steps):
        for param, grad in zip(params, grads):
            param.grad = grad[step].to(param.device, param.dtype)
        optimizer.step()
    return [param.detach().clone() for param in params]


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "eager"])
@pytest.mark.parametrize(
    "dim, chunks", [(0, 1), (1, 1), (0, 2), (1, 2)], ids=["rows", "columns", "gated rows", "gated columns"]
)
def test_shards_with_their_stream_layout_update_exactly_as_the_whole_parameter(fused, dim, chunks, device):
    """A [12, 8] parameter trained whole equals, bit for bit, its two tensor-parallel shards trained as
    separate parameters (split along ``dim``; ``chunks`` = 2: each shard holds its part of both halves,
    as megatron's gated fc1): every element draws its SR bits from its index in the whole tensor."""
    generator = torch.Generator().manual_seed(4)
    whole = torch.randn(12, 8, generator=generator) * 3
    grads = torch.randn(4, 12, 8, generator=generator)
    stream = 77
    (expected,) = _train_sr(
        [_param(whole, device=device)], [grads], lambda p: StreamLayout.whole(stream, p.numel()), fused
    )

    def shard(tensor, rank):
        """Rank's shard of a [..., 12, 8] tensor (the leading dimension of the gradients is the step)."""
        axis = dim - 2
        return torch.cat([block.chunk(2, dim=axis)[rank] for block in tensor.chunk(chunks, dim=axis)], dim=axis)

    shards = [_param(shard(whole, rank), device=device) for rank in range(2)]
    layouts = {id(p): StreamLayout.shard(stream, tuple(p.shape), dim, rank, 2, chunks) for rank, p in enumerate(shards)}
    trained = _train_sr(shards, [shard(grads, rank) for rank in range(2)], lambda p: layouts[id(p)], fused)
    rebuilt = torch.empty_like(expected)
    index = torch.arange(expected.numel(), device=device).view(expected.shape)
    for rank in range(2):
        rebuilt.view(-1)[shard(index, rank).reshape(-1)] = trained[rank].reshape(-1)
    assert torch.equal(rebuilt.view(torch.int16), expected.view(torch.int16))
    assert not torch.equal(expected, _param(whole, device=device).detach())


def test_replicas_of_a_stream_agree_and_other_streams_differ(device):
    generator = torch.Generator().manual_seed(5)
    values, grads = torch.randn(300, generator=generator), torch.randn(4, 300, generator=generator)
    params = [_param(values, device=device) for _ in range(3)]
    streams = {id(params[0]): 1, id(params[1]): 1, id(params[2]): 2}
    first, replica, other = _train_sr(
        params, [grads] * 3, lambda p: StreamLayout.whole(streams[id(p)], p.numel()), True
    )
    assert torch.equal(first, replica)
    assert not torch.equal(first, other)


def test_a_stream_layout_that_does_not_fit_the_parameter_is_refused():
    param = _param(torch.zeros(10))
    with pytest.raises(ValueError, match=r"stream_layout of parameter 0 of group 0 \(shape \(10,\)\).*rows of 3"):
        AdamW([param], option="sr", stream_layout=lambda p: StreamLayout(0, row_length=3, row_stride=3))


def test_random_bits_are_the_words_of_the_parameter_s_stream(device):
    param = _param(torch.zeros(4, 6), device=device)
    optimizer = AdamW([param], option="sr", seed=3, stream_layout=lambda p: StreamLayout.shard(8, (4, 6), 1, 1, 2))
    expected = counter_random_bits(3, 5, torch.tensor([r * 12 + 6 + i for r in range(4) for i in range(6)]), stream=8)
    assert torch.equal(optimizer.random_bits(param, 5).cpu(), expected.view(4, 6))


def test_the_finiteness_check_can_be_left_to_the_caller(device):
    param = _param(torch.randn(8), device=device)
    optimizer = AdamW([param], lr=1e-2, option="A", fused=False, check_grads_finite=False)
    param.grad = torch.full_like(param, float("nan"))
    optimizer.step()
    assert optimizer.skipped_steps == 0 and optimizer.state[param]["step"] == 1


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan, None])
def test_non_finite_flag_finds_inf_and_nan_in_the_last_element_of_the_last_tensor(device, grad_dtype, bad):
    """Every gradient dtype on every device (the GradScaler kernel has no BF16 CUDA version); the
    largest finite values of the dtype are not flagged (a sum of squares would overflow on them)."""
    from megatron_lowprec.optim.adamw import non_finite_flag

    generator = torch.Generator().manual_seed(0)
    grads = [
        torch.randn(1000, generator=generator).to(grad_dtype),
        torch.full((4, 5), torch.finfo(grad_dtype).max, dtype=grad_dtype),
        torch.empty(0, dtype=grad_dtype),
        torch.randn(3, 4099, generator=generator).to(grad_dtype),
    ]
    if bad is not None:
        grads[-1][-1, -1] = bad
    flag = non_finite_flag([grad.to(device) for grad in grads], device)
    assert flag.device.type == device.type and flag.dtype == torch.float32 and flag.shape == (1,)
    assert flag.item() == (0.0 if bad is None else 1.0)


@pytest.mark.parametrize("position", [0, 4097, -1])
def test_non_finite_flag_across_mixed_gradient_dtypes(position, device):
    from megatron_lowprec.optim.adamw import non_finite_flag

    grads = [
        torch.zeros(10, dtype=torch.float32, device=device),
        torch.zeros(8195, dtype=torch.bfloat16, device=device),
        torch.zeros(3, dtype=torch.float16, device=device),
    ]
    assert non_finite_flag(grads, device).item() == 0.0
    grads[1][position] = math.nan
    assert non_finite_flag(grads, device).item() == 1.0


OPS_WITHOUT_BF16_CUDA_KERNELS = (torch._amp_foreach_non_finite_check_and_unscale_,)
"""Measured on an H100 (torch 2.11): ``_amp_foreach_non_finite_check_and_unscale_cuda`` is not
implemented for 'BFloat16', so a step through it failed for every option on CUDA."""


def test_non_finite_flag_uses_no_op_that_lacks_a_bf16_cuda_kernel():
    from torch.overrides import TorchFunctionMode

    from megatron_lowprec.optim.adamw import non_finite_flag

    called = []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            called.append(func)
            return func(*args, **(kwargs or {}))

    with Record():
        non_finite_flag([torch.ones(3, dtype=torch.bfloat16)], torch.device("cpu"))
    assert called and not set(called) & set(OPS_WITHOUT_BF16_CUDA_KERNELS)


def test_the_finiteness_check_reads_a_bucket_s_own_gradient_buffer_in_one_pass():
    """Once the gradients are views of their bucket's buffer (from the first fused step on), the
    check is one reduction over that buffer instead of one per gradient; a NaN in any view is found."""
    from torch.overrides import TorchFunctionMode

    from megatron_lowprec.optim.buckets import gather_grads

    params = [torch.nn.Parameter(torch.zeros(numel, dtype=torch.bfloat16)) for numel in (1000, 129, 4097)]
    optimizer = AdamW(params, option="A", fused=False)
    for param in params:
        param.grad = torch.zeros_like(param)
    reduced = []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.aminmax:
                reduced.append(args[0].numel())
            return func(*args, **(kwargs or {}))

    with Record():
        assert optimizer._grads_ready()
    assert sorted(reduced) == [129, 1000, 4097]
    [bucket] = optimizer.buckets
    gather_grads(bucket)
    reduced.clear()
    with Record():
        assert optimizer._grads_ready()
    assert reduced == [bucket.grad_buffer.numel()]
    params[1].grad[-1] = math.nan
    assert not optimizer._grads_ready() and optimizer.skipped_steps == 1

