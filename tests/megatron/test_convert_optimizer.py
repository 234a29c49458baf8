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
