"""``build_optimizer(..., convert_checkpoint=True)``: the Megatron optimizer loads the state of another option."""

from __future__ import annotations

import copy

import pytest
import torch

MODEL = ["model.hidden_size=128", "model.num_layers=1", "model.seq_length=16", "model.vocab_size=128"]


def _built(option: str, convert_checkpoint: bool = False):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_lowprec.megatron.optimizer import build_optimizer
    from megatron_lowprec.train.app import compose
    from megatron_lowprec.train.loop import megatron_optimizer_config
    from megatron_lowprec.train.model import gpt_model

    config = compose([f"precision={option}", *MODEL])
    torch.manual_seed(3)
    module = gpt_model(config, config.model.vocab_size)
    model = DistributedDataParallel(config=module.config, ddp_config=DistributedDataParallelConfig(), module=module)
    optimizer = build_optimizer(
        option, [model], megatron_optimizer_config(config.optimizer), fused=False, background_compile=False,
        convert_checkpoint=convert_checkpoint,
    )
    return model, optimizer


def _step(model, optimizer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for param in model.parameters():
        param.main_grad.copy_(torch.randn(param.shape, generator=generator) * 1e-2)
    optimizer.step()


def test_build_optimizer_converts_a_state_dict_of_another_option_on_request(megatron_rank):
    saved_model, saved_optimizer = _built("D")
    _step(saved_model, saved_optimizer, 0)
    saved = saved_optimizer.state_dict()
    model, refusing = _built("B")
    with pytest.raises(ValueError, match=r"^the optimizer state was saved with option 'D', this optimizer runs 'B'; "
                                         r"build_optimizer\(\.\.\., convert_checkpoint=True\) converts it$"):
        refusing.load_state_dict(copy.deepcopy(saved))

    model, optimizer = _built("B", convert_checkpoint=True)
    model.load_state_dict(saved_model.state_dict())
    optimizer.load_state_dict(copy.deepcopy(saved))
    params = optimizer.get_parameters()
    for index, param in enumerate(params):
        source, state = saved["state"][index], optimizer.optimizer.state[param]
        master = source["master"].double()
        assert torch.equal(param.double(), master.bfloat16().double())  # an FP32 value rounds to BF16 in one cast
        assert torch.equal(state["param_lo"].double(), (master - param.double()).bfloat16().double())
        assert torch.equal(state["exp_avg"], source["exp_avg"].bfloat16())
    _step(model, optimizer, 1)
    assert all(param.isfinite().all() for param in params)


def test_a_res8_state_saved_with_fp32_exponents_is_converted_on_request(megatron_rank):
    """res8's state as saved while its FP8 exponents were FP32 (no exponent storage recorded): the
    optimizer refuses it in one line, and with ``convert_checkpoint=True`` loads it with its moments
    quantized afresh with BF16 exponents, its masters exactly."""
    from dataclasses import replace

    from megatron_lowprec.optim import get_strategy
    from megatron_lowprec.optim.convert import convert_state_dict

    saved_model, saved_optimizer = _built("res8")
    _step(saved_model, saved_optimizer, 0)
    current = saved_optimizer.state_dict()
    old, _, _ = convert_state_dict(
        current, saved_optimizer.get_parameters(), replace(get_strategy("res8"), fp8_exponent_storage="fp32")
    )
    assert "fp8_exponent_storage" not in old["lowprec"] and old["state"][0]["exp_avg_expansion_exponent"].dtype == torch.float32
    model, optimizer = _built("res8")
    with pytest.raises(ValueError, match=r"^the optimizer state of option 'res8' was saved with its FP8 expansion exponents in "
                                         r"fp32, this optimizer stores them in bf16; build_optimizer\(\.\.\., "
                                         r"convert_checkpoint=True\) converts it$"):
        optimizer.load_state_dict(copy.deepcopy(old))

    optimizer.convert_checkpoint = True
    model.load_state_dict(saved_model.state_dict())
    optimizer.load_state_dict(copy.deepcopy(old))
    for index, param in enumerate(optimizer.get_parameters()):
        state, source = optimizer.optimizer.state[param], current["state"][index]
        assert state["exp_avg_expansion_exponent"].dtype == torch.bfloat16
        assert torch.equal(state["master_residual8"], source["master_residual8"])
    _step(model, optimizer, 1)
    assert all(param.isfinite().all() for param in optimizer.get_parameters())
