"""The FP32 master stored as the BF16 parameter plus an int16 remainder (``master_storage="remainder"``):
the same masters as the whole FP32 form, bit for bit, in every path that holds a master."""

import copy

import pytest
import torch

from megatron_lowprec.numerics.formats import split_bf16_remainder
from megatron_lowprec.optim import AdamW, get_strategy
from megatron_lowprec.optim import codecs as codecs_module
from megatron_lowprec.optim import master as master_module
from megatron_lowprec.optim.fused import fused_available
from megatron_lowprec.optim.master import master_value, stored_master

from ..options import MASTER_OPTIONS, one_per_kind

SHAPES = [(1000,), (3,), (129,), (4097,), (7, 13), (300,)]
"""Mixed sizes, most of them not multiples of the bucket alignment or of COAT's group of 128."""


def _strategy(option, storage):
    return get_strategy(option).with_master_storage(storage)


COMPILED_OPTIONS = one_per_kind(MASTER_OPTIONS, lambda strategy: (strategy.moments, strategy.adam_kernel))
"""The options whose remainder form these tests also step compiled: one per kind of moments and Adam
kernel (D: torch's fused kernel; coat: FP8 moments; D-BF16: BF16 moments). The remainder codec is the
same code beside every moment codec, so another option's remainder form (res8's: FP8 moments with a
BF16 exponent k, which the contract matrix compiles in res8's own master form) compiles no new path
of it; its eager remainder form is checked here too."""


def _paths(device, option):
    if not fused_available(device) or option not in COMPILED_OPTIONS:
        return [False]
    return [False, True]


def _optimizer(option, storage, fused, device, **kwargs):
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator).to(device, torch.bfloat16)) for shape in SHAPES]
    hyper = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, **kwargs)
    return params, AdamW(params, option=_strategy(option, storage), fused=fused, **hyper)


def _gradients(steps, seed=1):
    """Per step, one BF16 gradient per parameter, scaled over seven decades."""
    generator = torch.Generator().manual_seed(seed)
    return [
        [(torch.randn(shape, generator=generator) * 10.0 ** (step % 7 - 3)).to(torch.bfloat16) for shape in SHAPES]
        for step in range(steps)
    ]


def _train(params, optimizer, gradients):
    for step_gradients in gradients:
        for param, grad in zip(params, step_gradients):
            param.grad = grad.to(param.device)
        optimizer.step()


def _masters(params, optimizer):
    return [master_value(p.detach(), stored_master(optimizer.state[p])).cpu().clone() for p in params]


def _assert_same_masters(expected, got):
    for index, (a, b) in enumerate(zip(expected, got)):
        differing = int((a.view(torch.int32) != b.view(torch.int32)).sum())
        assert differing == 0, f"{differing} master elements of parameter {index} differ"


def _assert_same_states_but_the_master(expected, got):
    (params, optimizer), (other_params, other_optimizer) = expected, got
    for p, q in zip(params, other_params):
        for key, value in optimizer.state[p].items():
            if key in master_module.MASTER_KEYS.values():
                continue
            other = other_optimizer.state[q][key]
            if torch.is_tensor(value):
                assert torch.equal(value.cpu().view(torch.uint8), other.cpu().view(torch.uint8)), key
            else:
                assert value == other, key


def _even_ties(master):
    """Elements whose FP32 master is a tie below an even BF16 value (low half 0x8000, last kept bit 0)."""
    bits = master.view(torch.int32)
    return ((bits & 0xFFFF) == 0x8000) & (((bits >> 16) & 1) == 0)


@pytest.mark.parametrize("option", MASTER_OPTIONS)
def test_remainder_masters_are_the_whole_masters_bit_for_bit(option, device):
    """40 steps of the remainder form (eager and fused) against the whole FP32 form (eager) on the same
    gradients: the same FP32 masters and moments, bit for bit; each BF16 parameter is its master's
    upper half (the split), where the whole form's is its nearest-even rounding: the two differ
    exactly at the masters that are ties below an even BF16 value. The remainder form tracks update
    quality, so that its fused step is the one compiled for the update-quality test below (one
    compile for both; tracking reads the step's values and changes none)."""
    gradients = _gradients(40)
    whole = _optimizer(option, "fp32", False, device)
    _train(*whole, gradients)
    whole_masters = _masters(*whole)
    for fused in _paths(device, option):
        remainder = _optimizer(option, "remainder", fused, device, track_update_quality=True)
        _train(*remainder, gradients)
        masters = _masters(*remainder)
        _assert_same_masters(whole_masters, masters)
        _assert_same_states_but_the_master(whole, remainder)
        for master, param, whole_param in zip(masters, remainder[0], whole[0]):
            upper, _ = split_bf16_remainder(master)
            assert torch.equal(param.detach().cpu().view(torch.int16), upper.view(torch.int16))
            assert torch.equal(whole_param.detach().cpu(), master.bfloat16())
            differs = param.detach().cpu().view(torch.int16) != whole_param.detach().cpu().view(torch.int16)
            assert torch.equal(differs, _even_ties(master))


def _drop_remainder_bit(split):
    """A split that loses the lowest bit of every remainder (the mutation the tests must catch)."""

    def split_without_bit(value):
        upper, remainder = split(value)
        return upper, remainder & ~1

    return split_without_bit


@pytest.mark.parametrize("option", MASTER_OPTIONS)
def test_dropping_one_remainder_bit_changes_the_masters(option, monkeypatch):
    """Mutation: the split loses the remainder's lowest bit; the masters then part from the whole form's."""
    monkeypatch.setattr(codecs_module, "split_bf16_remainder", _drop_remainder_bit(codecs_module.split_bf16_remainder))
    gradients = _gradients(5)
    whole = _optimizer(option, "fp32", False, "cpu")
    remainder = _optimizer(option, "remainder", False, "cpu")
    _train(*whole, gradients)
    _train(*remainder, gradients)
    with pytest.raises(AssertionError, match="master elements"):
        _assert_same_masters(_masters(*whole), _masters(*remainder))


@pytest.mark.parametrize("fused", [False, True], ids=["eager", "fused"])
def test_option_d_with_a_remainder_is_torch_fused_adamw_on_fp32_copies(fused, device):
    """Option D's remainder form against torch.optim.AdamW(fused=True) on FP32 copies of the
    parameters: masters bit-identical after 30 steps, through torch's own kernel on windows of the
    joined master (20000 elements: several windows; 561, 129 and 5: vector tails)."""
    if fused and not fused_available(device):
        pytest.skip(f"no fused step on {device.type}")
    generator = torch.Generator().manual_seed(1)
    shapes = [(33, 17), (129,), (5,), (20000,)]
    start = [torch.randn(shape, generator=generator).to(device, torch.bfloat16) for shape in shapes]
    ours = [torch.nn.Parameter(t.clone()) for t in start]
    reference = [torch.nn.Parameter(t.float()) for t in start]
    hyper = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    optimizer = AdamW(ours, option="D", master_storage="remainder", fused=fused, **hyper)
    reference_optimizer = torch.optim.AdamW(reference, **hyper, fused=True)
    for _ in range(30):
        for p, q in zip(ours, reference):
            grad = (torch.randn(p.shape, generator=generator) * 1e-2).to(device, torch.bfloat16)
            p.grad, q.grad = grad, grad.float()
        optimizer.step()
        reference_optimizer.step()
    for p, q in zip(ours, reference):
        assert "master" not in optimizer.state[p]
        assert torch.equal(master_value(p.detach(), optimizer.state[p]["master_remainder"]).view(torch.int32), q.detach().view(torch.int32))


def _resume(option, saved_storage, loaded_storage, device, corrupt=None):
    """5 steps in ``saved_storage``, its parameters and state dict saved, 5 more steps; a fresh
    optimizer in ``loaded_storage`` (after a step of its own) loads the saved parameters, then the
    state dict (``corrupt`` may alter it first), and takes the same 5 steps. Both optimizers' masters
    at the end, and the loaded optimizer's masters right after loading against the saved ones."""
    gradients = _gradients(11, seed=2)
    params, optimizer = _optimizer(option, saved_storage, False, device)
    _train(params, optimizer, gradients[:5])
    saved_params = [p.detach().clone() for p in params]
    saved_masters = _masters(params, optimizer)
    saved_state = copy.deepcopy(optimizer.state_dict())
    _train(params, optimizer, gradients[5:10])

    other_params, other = _optimizer(option, loaded_storage, False, device)
    _train(other_params, other, gradients[10:])
    if corrupt is not None:
        corrupt(saved_state)
    with torch.no_grad():
        for param, saved in zip(other_params, saved_params):
            param.copy_(saved)
    other.load_state_dict(saved_state)
    _assert_same_masters(saved_masters, _masters(other_params, other))
    _train(other_params, other, gradients[5:10])
    return _masters(params, optimizer), _masters(other_params, other)


@pytest.mark.parametrize("option", MASTER_OPTIONS)
@pytest.mark.parametrize(
    "saved_storage, loaded_storage", [("remainder", "remainder"), ("fp32", "remainder"), ("remainder", "fp32")]
)
def test_state_dicts_load_into_either_storage_and_continue_bit_identically(option, saved_storage, loaded_storage, device):
    """A state dict of either storage loads into either (the model's parameters loaded first): the
    masters come back bit for bit and 5 more steps match training straight through."""
    straight, resumed = _resume(option, saved_storage, loaded_storage, device)
    _assert_same_masters(straight, resumed)


def test_a_residual_master_resumes_bit_identically_and_loads_into_a_whole_master(device):
    """res8's state dict (its int8 residuals) resumes bit for bit, and loads into a whole FP32 master
    as the same masters (its 16-bit-significand values are FP32 values; ``_resume`` checks them)."""
    straight, resumed = _resume("res8", "residual8", "residual8", device)
    _assert_same_masters(straight, resumed)
    _resume("res8", "residual8", "fp32", device)


def _clear_remainder_bit(state_dict):
    for state in state_dict["state"].values():
        state["master_remainder"] &= ~1


def test_a_state_dict_that_lost_one_remainder_bit_is_caught():
    """Mutation: the saved remainders lose their lowest bit; the loaded masters differ from the saved ones."""
    with pytest.raises(AssertionError, match="master elements"):
        _resume("D-BF16", "remainder", "remainder", "cpu", corrupt=_clear_remainder_bit)


def test_a_state_dict_of_the_other_storage_is_checked_before_anything_changes():
    params, optimizer = _optimizer("D", "remainder", False, "cpu")
    saved = copy.deepcopy(optimizer.state_dict())
    saved["state"][0]["master_remainder"] = saved["state"][0]["master_remainder"].float()
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match="'master_remainder' of parameter 0: saved torch.float32"):
        optimizer.load_state_dict(saved)
    assert all(torch.equal(p, q) for p, q in zip(params, before))
    fp16 = torch.nn.Parameter(torch.randn(8).half())
    whole = AdamW([fp16], option="D")
    remainder_state = AdamW([torch.nn.Parameter(torch.randn(8).bfloat16())], option="D", master_storage="remainder").state_dict()
    with pytest.raises(ValueError, match="below a bfloat16 parameter"):
        whole.load_state_dict(remainder_state)


@pytest.mark.parametrize("option", MASTER_OPTIONS)
def test_update_quality_of_the_remainder_form_is_the_whole_form_s(option, device):
    """EDQ and imprecision read the represented value, the joined master: the pieces of 3 steps of the
    remainder form are those of the whole form's eager step, the counts exactly, the FP64 sums exactly
    in eager code and to FP64 rounding in compiled code (Inductor sums in another order; the whole
    form's compiled pieces are checked against the eager ones in tests/optim/test_fused.py)."""
    gradients = _gradients(3, seed=4)
    params, optimizer = _optimizer(option, "fp32", False, device, track_update_quality=True)
    _train(params, optimizer, gradients)
    whole = optimizer.bucket_update_pieces[0].cpu()
    assert whole[2] > 0
    for fused in _paths(device, option):
        params, optimizer = _optimizer(option, "remainder", fused, device, track_update_quality=True)
        _train(params, optimizer, gradients)
        remainder = optimizer.bucket_update_pieces[0].cpu()
        assert torch.equal(remainder[2:], whole[2:])
        if fused:
            assert remainder[:2].tolist() == pytest.approx(whole[:2].tolist(), rel=1e-12)
        else:
            assert torch.equal(remainder, whole)


def test_update_quality_that_drops_one_remainder_bit_is_caught(monkeypatch):
    """Mutation: joining loses the remainder's lowest bit; the effective updates, and so the pieces, differ."""
    gradients = _gradients(1, seed=4)
    whole = _optimizer("D-BF16", "fp32", False, "cpu", track_update_quality=True)
    _train(*whole, gradients)

    def join_without_bit(upper, remainder):
        return join(upper, remainder & ~1)

    join = codecs_module.join_bf16_remainder
    monkeypatch.setattr(codecs_module, "join_bf16_remainder", join_without_bit)
    remainder = _optimizer("D-BF16", "remainder", False, "cpu", track_update_quality=True)
    _train(*remainder, gradients)
    got, expected = remainder[1].bucket_update_pieces[0].tolist(), whole[1].bucket_update_pieces[0].tolist()
    assert got[:2] != pytest.approx(expected[:2], rel=1e-12)


def _skip_touches_nothing(params, optimizer):
    """A step with an inf gradient after a normal one: skipped, parameters and every state component
    (remainders included) unchanged to the bit."""
    for param in params:
        param.grad = torch.ones_like(param)
    optimizer.step()
    before = [p.detach().clone() for p in params], copy.deepcopy(optimizer.state_dict())
    for param in params:
        param.grad = torch.ones_like(param)
    params[-1].grad.view(-1)[-1] = torch.inf
    optimizer.step()
    assert optimizer.skipped_steps == 1
    for param, saved in zip(params, before[0]):
        assert torch.equal(param.detach().view(torch.int16), saved.view(torch.int16)), "parameter changed"
    for index, state in before[1]["state"].items():
        for key, value in state.items():
            after = optimizer.state_dict()["state"][index][key]
            if torch.is_tensor(value):
                assert torch.equal(value.view(torch.uint8), after.view(torch.uint8)), f"{key} changed"


@pytest.mark.parametrize("option", MASTER_OPTIONS)
def test_a_skipped_step_leaves_the_remainder_untouched(option, device):
    """Tracking update quality, so that the fused step is the one compiled for the bit-for-bit test
    above (tracking reads the step's values and changes none; a skipped step reads none)."""
    for fused in _paths(device, option):
        _skip_touches_nothing(*_optimizer(option, "remainder", fused, device, track_update_quality=True))


def test_a_skip_that_drops_one_remainder_bit_is_caught(monkeypatch):
    """Mutation: a skipped step that clears the remainders' lowest bit is seen."""
    step = AdamW.step

    def step_that_drops_a_bit(self, closure=None):
        skipped = self.skipped_steps
        step(self, closure)
        if self.skipped_steps > skipped:
            for state in self.state.values():
                state["master_remainder"] &= ~1

    monkeypatch.setattr(AdamW, "step", step_that_drops_a_bit)
    with pytest.raises(AssertionError, match="master_remainder changed"):
        _skip_touches_nothing(*_optimizer("D", "remainder", False, "cpu"))


@pytest.mark.parametrize("option, expected", [("D", 14.0), ("coat", 8.125), ("D-BF16", 10.0)])
def test_bytes_per_param_of_the_remainder_form_measured_from_the_state_tensors(option, expected, device):
    """Bytes/param of a 2^16-element parameter (whole FP8 groups) counted from its 16-bit parameter, a
    16-bit gradient (plain PyTorch's) and every state tensor."""
    param = torch.nn.Parameter(torch.randn(2**16).to(device, torch.bfloat16))
    optimizer = AdamW([param], option=option, master_storage="remainder")
    state_bytes = sum(v.numel() * v.element_size() for v in optimizer.state[param].values() if torch.is_tensor(v))
    assert (state_bytes + 2 * param.numel() * 2) / param.numel() == expected == optimizer.strategy.bytes_per_param(grad_reduce_in_fp32=False)
    assert optimizer.state[param]["master_remainder"].dtype == torch.int16


def test_master_storage_is_checked_at_construction():
    param = torch.nn.Parameter(torch.randn(8).bfloat16())
    with pytest.raises(ValueError, match=r"option 'A' keeps no FP32 master.*options with one: D, coat, D-BF16"):
        AdamW([param], option="A", master_storage="remainder")
    with pytest.raises(ValueError, match=r"master_storage='half' is not valid; choose one of fp32, remainder"):
        AdamW([param], option="D", master_storage="half")
    with pytest.raises(ValueError, match="master_weights=False drops the master"):
        AdamW([param], option="coat", master_weights=False, master_storage="remainder")
    with pytest.raises(ValueError, match=r"upper half in the BF16 parameter.*torch.float16"):
        AdamW([torch.nn.Parameter(torch.randn(8).half())], option="D-BF16")
    half = torch.nn.Parameter(torch.randn(8).half())
    assert "master" in AdamW([half], option="D-BF16", master_storage="fp32").state[half]


def test_copies_off_nearest_even_counts_where_the_copy_differs_from_torchs_cast():
    """Against torch's own cast of the joined master: every tie and its neighbours, below even and
    odd BF16 values, positive and negative, plus random masters."""
    from megatron_lowprec.numerics.formats import join_bf16_remainder
    from megatron_lowprec.optim.master import copies_off_nearest_even

    highs = torch.arange(0x3F80, 0x3F90, dtype=torch.int32)
    lows = torch.tensor([0x7FFF, 0x8000, 0x8001, 0x0000, 0xFFFF], dtype=torch.int32)
    patterns = ((highs[:, None] << 16) | lows[None, :]).reshape(-1)
    patterns = torch.cat([patterns, patterns | torch.tensor(-(1 << 31), dtype=torch.int32)])
    random = torch.randn(100_000, generator=torch.Generator().manual_seed(3)).view(torch.int32)
    masters = torch.cat([patterns, random]).view(torch.float32)
    upper, remainder = split_bf16_remainder(masters)
    assert torch.equal(join_bf16_remainder(upper, remainder).view(torch.int32), masters.view(torch.int32))
    expected = int((masters.to(torch.bfloat16).view(torch.int16) != upper.view(torch.int16)).sum())
    assert expected >= 16  # the ties below the 8 even highs, either sign, and random ones
    assert int(copies_off_nearest_even(upper, remainder)) == expected
