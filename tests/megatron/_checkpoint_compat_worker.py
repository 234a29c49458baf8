"""One rank of the checks that checkpoints written by the package at commit 967a844 still load: a
tiny megatron DDP model of three BF16 weights, trained a few steps with and without the
distributed optimizer, on gloo.

``write`` (run with the package at 967a844 first on ``PYTHONPATH``: :func:`write`) saves, per option
and optimizer (``plain``, ``distributed``), each rank's ``state_dict()``, a dist_checkpointing
(torch_dist) save of ``sharded_state_dict`` (what ``lowprec-train``'s checkpoints hold under
``optimizer``) and the model's parameters. ``load`` (the current package) loads each into a fresh
model and optimizer and reports whether every state is what was saved, bit for bit.

Launched as ``python _checkpoint_compat_worker.py RESULT_DIR SCENARIO JSON`` once per rank; writes
``RESULT_DIR/rank<N>.json``. It imports nothing but megatron-core, torch and the package's public
``build_optimizer``, so that it runs against either version.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.megatron.launch import run_scenario

KINDS = ("plain", "distributed")
STEPS = 3


class ThreeWeights(torch.nn.Module):
    """Three BF16 weights (240, 70 and 192 elements: megatron pads each start to 64 elements, so
    that a data-parallel shard boundary cuts the first) and a loss that reads all of them, placed
    as megatron places tensors (on the CUDA device, which the CPU bridge redirects without one)."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(5)
        self.first = torch.nn.Parameter(torch.randn(20, 12, generator=generator).bfloat16().cuda())
        self.second = torch.nn.Parameter(torch.randn(70, generator=generator).bfloat16().cuda())
        self.third = torch.nn.Parameter(torch.randn(12, 16, generator=generator).bfloat16().cuda())

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(inputs @ self.first) @ self.third
        return (hidden.float() - targets).square().mean() + (self.second.float() * targets[0, :1]).sin().sum()


def _model(distributed: bool):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=1, bf16=True, params_dtype=torch.bfloat16)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distributed)
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=ThreeWeights())


def _optimizer(option: str, model, distributed: bool):
    from megatron.core.optimizer import OptimizerConfig

    from megatron_lowprec.megatron.optimizer import build_optimizer

    config = OptimizerConfig(
        optimizer="adam", lr=3e-3, weight_decay=0.1, adam_beta2=0.95, bf16=True, clip_grad=1.0, use_distributed_optimizer=distributed
    )
    return build_optimizer(option, [model], config, seed=11, fused=False)


def _train(model, optimizer, steps: int) -> None:
    rank = torch.distributed.get_rank()
    for step in range(steps):
        generator = torch.Generator().manual_seed(100 * step + rank)
        inputs = torch.randn(4, 20, generator=generator).bfloat16()
        targets = torch.randn(4, 16, generator=generator)
        model.zero_grad_buffer()
        optimizer.zero_grad()
        model(inputs.cuda(), targets.cuda()).backward()
        model.finish_grad_sync()
        optimizer.step()


def _model_sharded_state(model) -> dict:
    """The model's parameters as megatron's ShardedTensors, each replicated over the data-parallel ranks."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing import ShardedTensor

    replica = parallel_state.get_data_parallel_rank()
    return {
        name: ShardedTensor.from_rank_offsets(f"weights.{name}", param, replica_id=(0, 0, replica))
        for name, param in model.module.named_parameters()
    }


def write(options: list[str], directory: str) -> dict:
    """Per option and optimizer: ``STEPS`` steps, then ``<option>/<kind>/rank<N>.pt`` (this rank's
    ``state_dict()`` and the model's parameters) and ``<option>/<kind>/torch_dist``."""
    from megatron.core import dist_checkpointing, parallel_state

    import megatron_lowprec

    parallel_state.initialize_model_parallel()
    rank = torch.distributed.get_rank()
    for option in options:
        for kind in KINDS:
            distributed = kind == "distributed"
            folder = Path(directory) / option / kind
            (folder / "torch_dist").mkdir(parents=True, exist_ok=True)
            torch.distributed.barrier()
            model = _model(distributed)
            optimizer = _optimizer(option, model, distributed)
            _train(model, optimizer, STEPS)
            params = {name: param.detach().cpu().clone() for name, param in model.module.named_parameters()}
            torch.save({"state_dict": _to_cpu(optimizer.state_dict()), "params": params}, folder / f"rank{rank}.pt")
            sharded = optimizer.sharded_state_dict(_model_sharded_state(model))
            dist_checkpointing.save({"optimizer": sharded}, str(folder / "torch_dist"))
    return {"package": megatron_lowprec.__file__}


def _to_cpu(value):
    if torch.is_tensor(value):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {key: _to_cpu(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_to_cpu(item) for item in value]
    return value


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _same(left: torch.Tensor, right: torch.Tensor) -> bool:
    return left.dtype == right.dtype and torch.equal(_bits(left), _bits(right))


def _fresh(option: str, kind: str, saved_params: dict[str, torch.Tensor]):
    """A model holding the saved parameters and its optimizer, which takes a step of its own first,
    so that loading must overwrite every state."""
    distributed = kind == "distributed"
    model = _model(distributed)
    optimizer = _optimizer(option, model, distributed)
    _train(model, optimizer, 1)
    with torch.no_grad():
        for name, param in model.module.named_parameters():
            param.copy_(saved_params[name])
    return model, optimizer


def _plain_states_match(optimizer, saved: dict) -> bool:
    """Whether the plain optimizer's per-parameter states are the saved per-rank state dict's."""
    state = optimizer.state_dict()["state"]
    return sorted(state) == sorted(saved["state"]) and all(
        sorted(state[index]) == sorted(saved["state"][index])
        and all(
            _same(value, saved["state"][index][key]) if torch.is_tensor(value) else value == saved["state"][index][key]
            for key, value in state[index].items()
        )
        for index in state
    )


def _shards_match(optimizer, saved: dict) -> bool:
    """Whether each entry of the distributed optimizer's state buckets holds the state of the saved
    per-shard buffers at its place, and its step is the saved one (the padding between entries
    holds no state: a bucket fills it from its entries when it loads)."""
    from megatron_lowprec.optim.buckets import elements_per_value

    strategy = optimizer.optimizer.strategy
    buckets = [shard.state_bucket for shard in optimizer.shards]
    if [bucket is None for bucket in buckets] != [entry is None for entry in saved["shards"]]:
        return False
    step = saved["lowprec"]["step"]
    return all(
        sorted(bucket.state) == sorted(entry)
        and all(
            _same(bucket.view(bucket.state[key], index, elements_per_value(key, strategy)), bucket.view(entry[key], index, elements_per_value(key, strategy)))
            for key in entry for index in range(len(bucket.params))
        )
        for bucket, entry in zip(buckets, saved["shards"]) if bucket is not None
    ) and all(optimizer.optimizer.state[piece.param]["step"] == step for shard in optimizer.shards for piece in shard.pieces)


def _pieces_match_plain(optimizer, plain_saved: dict) -> bool:
    """Whether each owned piece's state of the distributed optimizer is the same elements of the
    saved plain state dict's (FP8 per-group parts by group)."""
    from megatron_lowprec.optim.buckets import PER_GROUP_PARTS

    strategy = optimizer.optimizer.strategy
    group = strategy.fp8_group_size if strategy.moments == "fp8" else 1
    index_of = {param: index for index, param in enumerate(optimizer.get_parameters())}
    for shard in optimizer.shards:
        for piece in shard.pieces:
            whole = plain_saved["state"][index_of[piece.param]]
            for key, value in optimizer.piece_state(piece).items():
                if key.endswith(PER_GROUP_PARTS):
                    expected = whole[key][piece.param_start // group : piece.param_start // group + value.numel()]
                else:
                    expected = whole[key].reshape(-1)[piece.param_start : piece.param_start + piece.numel]
                if not _same(value, expected):
                    return False
    return True


def load(options: list[str], directory: str) -> dict:
    """Per option: whether the current package loads each saved checkpoint with every state bit for
    bit as saved (the plain optimizer's per-rank and torch_dist saves into the plain optimizer; the
    distributed optimizer's per-rank save, in its per-shard format, and its torch_dist save into the
    distributed optimizer; the plain torch_dist save into the distributed optimizer), and whether
    the distributed optimizer's per-rank state dict now has the plain one's format: the same keys,
    each piece's state the same elements of its parameter's."""
    from megatron.core import dist_checkpointing, parallel_state

    import megatron_lowprec

    parallel_state.initialize_model_parallel()
    rank = torch.distributed.get_rank()
    result: dict = {"package": megatron_lowprec.__file__}
    for option in options:
        saved = {kind: torch.load(Path(directory) / option / kind / f"rank{rank}.pt", weights_only=False) for kind in KINDS}
        checks = {}
        for kind in KINDS:
            model, optimizer = _fresh(option, kind, saved[kind]["params"])
            optimizer.load_state_dict(saved[kind]["state_dict"])
            match = _plain_states_match if kind == "plain" else _shards_match
            checks[f"{kind} per-rank"] = match(optimizer, saved[kind]["state_dict"])
            for source in KINDS if kind == "distributed" else ("plain",):
                model, optimizer = _fresh(option, kind, saved[source]["params"])
                sharded = optimizer.sharded_state_dict(_model_sharded_state(model), is_loading=True)
                loaded = dist_checkpointing.load({"optimizer": sharded}, str(Path(directory) / option / source / "torch_dist"))
                optimizer.load_state_dict(loaded["optimizer"])
                if kind == "plain":
                    checks[f"{kind} torch_dist of {source}"] = _plain_states_match(optimizer, saved["plain"]["state_dict"])
                elif source == "distributed":
                    checks[f"{kind} torch_dist of {source}"] = _shards_match(optimizer, saved["distributed"]["state_dict"])
                else:
                    checks[f"{kind} torch_dist of {source}"] = _pieces_match_plain(optimizer, saved["plain"]["state_dict"])
            if kind == "distributed":
                state_dict = optimizer.state_dict()
                plain = saved["plain"]["state_dict"]
                checks["distributed format is plain's"] = (
                    sorted(state_dict) == sorted(plain) and sorted(state_dict["lowprec"]) == sorted(plain["lowprec"])
                    and all(sorted(entry) == sorted(plain["state"][index]) for index, entry in state_dict["state"].items())
                    and _pieces_match_plain(optimizer, plain)
                )
        result[option] = checks
    return result


if __name__ == "__main__":
    run_scenario({"write": write, "load": load})
