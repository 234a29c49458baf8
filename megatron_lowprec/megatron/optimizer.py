"""Precision options as Megatron optimizers: ``build_optimizer(option, model_chunks, config)``.

The hook follows megatron-core's ``FP32Optimizer`` flow, which has no hidden FP32 copy of the model:
the gradients that ``DistributedDataParallel`` reduced into ``param.main_grad`` (BF16 or FP32, as
its config says) become ``param.grad``, they are clipped by their global norm over the
model-parallel group and counted, and :class:`megatron_lowprec.optim.AdamW` updates the model's
16-bit parameters in place with the chosen precision option (only ``D``, ``coat`` and ``D-BF16``
keep an FP32 master, inside the optimizer state: whole, or as a 16-bit remainder below the BF16
parameter, ``master_storage``). A step whose gradients hold NaN or inf on any rank is skipped
on every rank and reported as ``(False, None, None)``, as megatron's loss scaler reports an overflow.

Stochastic rounding draws from the stateless counter stream of ``AdamW``, with one stream per
logical tensor named by its layout-independent name (:func:`canonical_parameter_names`) and each
tensor-parallel shard at its elements' indices in the whole tensor (:func:`stream_layouts`). So an
element draws the same bits on every data-parallel replica, on every tensor-parallel rank that
holds a copy of it, on both pipeline stages that hold a tied embedding, and at every TP/PP layout.
``shared_randomness=False`` mixes the global rank into the seed: the SR paper's ablation, in which
replicas drift apart.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.optimizer import (
    get_param_id_to_sharded_param_map,
    optim_state_to_sharding_state,
)
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer import _get_param_groups as megatron_param_groups
from megatron.core.optimizer.optimizer import FP32Optimizer
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_lowprec.megatron.checkpoint_state import checkpoint_state, restore_checkpoint_state
from megatron_lowprec.megatron.distributed import (
    DistributedLowPrecisionOptimizer,
    build_distributed_optimizer,
    skip_if_any_rank_non_finite,
    sum_of_squares,
)
from megatron_lowprec.metrics import UpdateQuality
from megatron_lowprec.numerics.rounding import StreamLayout, stream_id
from megatron_lowprec.optim import AdamW, get_strategy
from megatron_lowprec.optim.buckets import PER_GROUP_PARTS
from megatron_lowprec.optim.master import MASTER_KEYS, reset_master_, stored_master

class LowPrecisionOptimizer(FP32Optimizer):
    """megatron-core's ``MegatronOptimizer`` interface around a precision-aware :class:`AdamW`."""

    def __init__(self, optimizer: AdamW, config: OptimizerConfig, seed_offset: int = 0) -> None:
        super().__init__(optimizer, config, init_state_fn=lambda optimizer, config: None)
        self._grad_dtypes: dict[torch.nn.Parameter, torch.dtype | None] = {}
        self.seed_offset = seed_offset

    def state_dict(self):
        """The AdamW state dict with the run's SR seed, without this rank's offset
        (``shared_randomness=False``), so that every rank restores its own stream from rank 0's copy."""
        state_dict = super().state_dict()
        state_dict["lowprec"]["seed"] -= self.seed_offset
        return state_dict

    @torch.no_grad()
    def reload_model_params(self, state_dict=None) -> None:
        """The FP32 masters (D, coat, D-BF16) restart from the model's parameters, as megatron's
        mixed-precision optimizers do when a checkpoint's model is loaded without its optimizer."""
        for param, state in self.optimizer.state.items():
            stored = stored_master(state)
            if stored is not None:
                reset_master_(param.detach(), stored)

    @torch.no_grad()
    def step(self):
        """Megatron's step (prepare, clip, count zeros, update); afterwards the parameters' ``.grad``
        are released and their ``grad_dtype`` restored, so that the next backward pass rounds the
        gradients of 16-bit parameters as it would without this optimizer."""
        try:
            return super().step()
        finally:
            for param, grad_dtype in self._grad_dtypes.items():
                param.grad = None
                param.grad_dtype = grad_dtype
            self._grad_dtypes.clear()

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """``main_grad`` → ``grad``; returns whether any rank of the model-parallel group found inf/NaN.

        FP32 main gradients (``grad_reduce_in_fp32``) become the gradients of 16-bit parameters as
        they are, through torch's ``grad_dtype`` for the duration of :meth:`step`.
        """
        for param in self.get_parameters():
            main_grad = getattr(param, "main_grad", None)
            if main_grad is not None and main_grad.dtype != param.grad_dtype:
                self._grad_dtypes.setdefault(param, param.grad_dtype)
                param.grad_dtype = main_grad.dtype
        super().prepare_grads()
        grads = [p.grad for p in self.get_parameters() if p.grad is not None]
        return skip_if_any_rank_non_finite(self, grads, self.get_loss_scale().device)

    @torch.no_grad()
    def clip_grad_norm(self, clip_grad: float) -> float:
        """Clipping by the global L2 norm over the model-parallel group: megatron's own for FP32
        gradients; for 16-bit gradients (megatron's asserts FP32) squares in FP32 summed in FP64
        (:func:`~megatron_lowprec.megatron.distributed.sum_of_squares`), which the distributed
        optimizer sums the same way over its shards."""
        if all(p.grad.dtype == torch.float32 for p in self.get_parameters() if p.grad is not None):
            return super().clip_grad_norm(clip_grad)
        squares = sum_of_squares(self.get_main_grads_for_grad_norm(), self.get_loss_scale().device)
        torch.distributed.all_reduce(squares, group=self.get_grad_stats_parallel_group())
        grad_norm = squares.item() ** 0.5
        coefficient = clip_grad / (grad_norm + 1.0e-6)
        if coefficient < 1.0:
            torch._foreach_mul_([p.grad for p in self.get_parameters() if p.grad is not None], coefficient)
        return grad_norm

    def update_quality(self) -> UpdateQuality:
        """EDQ and imprecision pieces of the last step for the whole model (``track_update_quality``).

        Pieces are summed over the model-parallel group (tensor and pipeline ranks), counting the
        copies of a tensor-parallel-replicated parameter once; data-parallel replicas are identical
        and are not summed.
        """
        pieces = torch.zeros(4, dtype=torch.float64, device=self.get_loss_scale().device)
        for bucket, bucket_pieces in zip(self.optimizer.buckets, self.optimizer.bucket_update_pieces):
            if tensor_parallel.param_is_not_tensor_parallel_duplicate(bucket.params[0]):
                pieces += bucket_pieces
        torch.distributed.all_reduce(pieces, group=parallel_state.get_model_parallel_group())
        return UpdateQuality.from_tensor(pieces)

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, metadata: dict | None = None):
        """Megatron's per-parameter sharding of the optimizer state (every state tensor has its
        parameter's shape; FP8 states per element, :func:`checkpoint_state`), which
        ``dist_checkpointing`` reshards across layouts; the distributed optimizer saves and loads
        the same keys. An FP32 master is saved as such under ``master`` in either storage (a
        remainder joined with its parameter), so that either storage loads the other's checkpoints.
        The shared step is kept also when it is 0 (megatron drops a falsy step, and the state could
        not load)."""
        state_dict = self.state_dict()
        step = self._extract_common_per_param_step(state_dict)
        params = self.get_parameters()
        for index, entry in state_dict["state"].items():
            param = params[index]
            tensors = {key: value for key, value in entry.items() if torch.is_tensor(value)}
            form = checkpoint_state(tensors, param.numel(), self.optimizer.strategy, is_loading, param=param)
            state_dict["state"][index] = {
                **{key: value for key, value in entry.items() if key not in tensors},
                **{key: value.view(param.shape) for key, value in form.items()},
            }
        optim_state_to_sharding_state(
            state_dict, get_param_id_to_sharded_param_map(model_sharded_state_dict, params), exclude_keys="step"
        )
        if step is not None:
            state_dict["state"]["common_step"] = step
        return state_dict

    def load_state_dict(self, state_dict) -> None:
        """A :meth:`state_dict`, or what ``dist_checkpointing.load`` returned for
        :meth:`sharded_state_dict` (FP8 states per element, restored into the groups; the FP32
        master into its storage by :meth:`AdamW.load_state_dict`)."""
        params = self.get_parameters()
        for index, entry in state_dict["state"].items():
            if index == "common_step" or not any(key.endswith(PER_GROUP_PARTS) for key in entry):
                continue
            param = params[index]
            if entry["exp_avg_scale"].numel() == param.numel() and entry["exp_avg_payload"].dtype == torch.uint8:
                restored = {
                    key: value.clone()
                    for key, value in self.optimizer.state[param].items()
                    if torch.is_tensor(value) and key not in MASTER_KEYS.values()
                }
                restore_checkpoint_state(restored, entry, param.numel(), self.optimizer.strategy)
                entry.update(restored)
        super().load_state_dict(state_dict)
        self.optimizer.seed += self.seed_offset


def canonical_parameter_names(model_chunks: list[torch.nn.Module]) -> dict[torch.nn.Parameter, str]:
    """Each parameter's name in the whole model, the same at every parallel layout: wrapper prefixes
    (``module.``) dropped, transformer layers numbered globally (megatron's ``layer_number``, which
    counts the layers of earlier pipeline stages and virtual chunks), and the last stage's copy of a
    tied embedding (``shared_embedding``) named as the embedding itself."""
    names: dict[torch.nn.Parameter, str] = {}
    for chunk in model_chunks:
        layer_names = {
            module_name: f"{module_name.rsplit('.', 1)[0]}.{module.layer_number - 1}"
            for module_name, module in chunk.named_modules()
            if isinstance(module, TransformerLayer)
        }
        for name, param in chunk.named_parameters():
            module_name, _, leaf = name.rpartition(".")
            for layer, canonical_layer in layer_names.items():
                if module_name == layer or module_name.startswith(layer + "."):
                    module_name = canonical_layer + module_name[len(layer):]
                    break
            canonical = _strip_wrappers(f"{module_name}.{leaf}")
            if getattr(param, "shared_embedding", False) and canonical == "output_layer.weight":
                canonical = "embedding.word_embeddings.weight"
            names[param] = canonical
    return names


def _strip_wrappers(name: str) -> str:
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def stream_layouts(model_chunks: list[torch.nn.Module]) -> dict[torch.nn.Parameter, StreamLayout]:
    """The SR stream layout of every parameter: the stream of its canonical name, and for a
    tensor-parallel shard (``tensor_model_parallel``) its elements' indices in the whole tensor,
    which megatron cuts along ``partition_dim`` into ``partition_stride`` blocks, each split across
    the ranks (a gated MLP's fc1 has stride 2: each rank holds [gate part; up part])."""
    rank = parallel_state.get_tensor_model_parallel_rank()
    world_size = parallel_state.get_tensor_model_parallel_world_size()
    layouts = {}
    for param, name in canonical_parameter_names(model_chunks).items():
        if getattr(param, "tensor_model_parallel", False):
            layouts[param] = StreamLayout.shard(
                stream_id(name), tuple(param.shape), param.partition_dim, rank, world_size, param.partition_stride
            )
        else:
            layouts[param] = StreamLayout.whole(stream_id(name), param.numel())
    return layouts


def build_optimizer(
    option: str,
    model_chunks: list[torch.nn.Module],
    config: OptimizerConfig,
    *,
    seed: int = 0,
    shared_randomness: bool = True,
    fused: bool | None = None,
    track_update_quality: bool = False,
    master_storage: str | None = None,
) -> LowPrecisionOptimizer | DistributedLowPrecisionOptimizer:
    """The Megatron optimizer of precision ``option`` for ``model_chunks`` (after megatron DDP wrapping).

    ``config.use_distributed_optimizer`` shards every state across the data-parallel ranks (ZeRO-1,
    :mod:`megatron_lowprec.megatron.distributed`); the chunks must then be DDP built with
    ``use_distributed_optimizer=True`` as well.

    Parameter groups are megatron's own (no weight decay on biases and 1-D parameters, ``wd_mult``
    and ``lr_mult`` for ``OptimizerParamScheduler``); ``config`` supplies lr, weight decay, Adam's
    betas and eps and ``clip_grad``. Parameters must be BF16 or FP16 (``Float16Module``). An unknown
    option raises ``ValueError`` listing the valid names before anything is built.

    ``master_storage`` (``"fp32"`` or ``"remainder"``; ``None``: the option's own) stores the FP32
    master of ``D``, ``coat`` or ``D-BF16`` whole or as a 16-bit remainder below the BF16
    parameter (:class:`~megatron_lowprec.optim.AdamW`); the unsharded optimizer only, for now.
    """
    strategy = get_strategy(option)
    if master_storage is not None:
        strategy = strategy.with_master_storage(master_storage)
    if config.use_distributed_optimizer and not shared_randomness:
        raise ValueError(
            "shared_randomness=False (the SR paper's drifting replicas) needs use_distributed_optimizer=False: "
            "with the distributed optimizer each element is updated on one rank only"
        )
    groups: list[dict[str, Any]] = []
    for group in megatron_param_groups(model_chunks, config, None):
        if group["params"]:
            groups.append(
                {**group, "lr": config.lr * group["lr_mult"], "weight_decay": config.weight_decay * group["wd_mult"]}
            )
    if config.use_distributed_optimizer:
        if strategy.master_storage == "remainder":
            raise ValueError(
                f"option {strategy.name!r} with master_storage='remainder' runs with use_distributed_optimizer=False "
                "for now (the sharded optimizer keeps whole FP32 masters); use master_storage='fp32' to shard it"
            )
        return build_distributed_optimizer(
            strategy, model_chunks, config, groups, seed=seed, fused=fused,
            track_update_quality=track_update_quality, stream_layouts=stream_layouts(model_chunks),
        )
    seed_offset = 0 if shared_randomness else torch.distributed.get_rank() * 1_000_003
    adamw = AdamW(
        groups,
        lr=config.lr,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_eps,
        weight_decay=config.weight_decay,
        option=strategy,
        seed=seed + seed_offset,
        fused=fused,
        track_update_quality=track_update_quality,
        check_grads_finite=False,
        stream_layout=stream_layouts(model_chunks).__getitem__,
        bucket_key=tensor_parallel.param_is_not_tensor_parallel_duplicate,
    )
    return LowPrecisionOptimizer(adamw, config, seed_offset)
