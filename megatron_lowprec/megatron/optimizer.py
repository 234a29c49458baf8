"""Precision options as Megatron optimizers: ``build_optimizer`` takes ``get_megatron_optimizer``'s call.

The hook follows megatron-core's ``FP32Optimizer`` flow, which has no hidden FP32 copy of the model:
the gradients that ``DistributedDataParallel`` reduced into ``param.main_grad`` (BF16 or FP32, as
its config says) become ``param.grad``, they are clipped by their exact global norm over the
model-parallel group (the distributed optimizer's, bit for bit) and counted, and
:class:`megatron_lowprec.optim.AdamW` updates the model's 16-bit parameters in place with the chosen
precision option (only ``D``, ``coat`` and ``D-BF16`` keep an FP32 master, inside the optimizer
state: whole, or as a 16-bit remainder below the BF16 parameter, ``master_storage``). With
``optimizer="muon"``, :class:`megatron_lowprec.optim.Muon` updates the 2-D hidden weights and AdamW
the others, with the same option (:class:`LowPrecisionMuonOptimizer`; sharded by whole parameters
over the data-parallel ranks under megatron's layer-wise distributed optimizer,
:class:`LayerWiseLowPrecisionMuonOptimizer`). A step whose
gradients hold NaN or inf on any rank is skipped on every rank and reported as ``(False, None,
None)``, as megatron's loss scaler reports an overflow.

Stochastic rounding draws from the stateless counter stream of ``AdamW``, with one stream per
logical tensor named by its layout-independent name (:func:`canonical_parameter_names`) and each
tensor-parallel shard at its elements' indices in the whole tensor (:func:`stream_layouts`). So an
element draws the same bits on every data-parallel replica, on every tensor-parallel rank that
holds a copy of it, on both pipeline stages that hold a tied embedding, and at every TP/PP layout.
``shared_randomness=False`` mixes the global rank into the seed: the SR paper's ablation, in which
replicas drift apart.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
from typing import Any

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject
from megatron.core.dist_checkpointing.optimizer import (
    get_param_id_to_sharded_param_map,
    optim_state_to_sharding_state,
)
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer.optimizer import ChainedOptimizer, FP32Optimizer
from megatron.core.transformer.module import param_is_not_shared
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_lowprec.megatron.checkpoint_state import checkpoint_dtypes, checkpoint_state, restore_checkpoint_state
from megatron_lowprec.megatron import compat
from megatron_lowprec.megatron.conversion import agreed_over, convert_saved_otherwise_, say_conversion
from megatron_lowprec.megatron.layout import ROW
from megatron_lowprec.megatron.distributed import (
    DistributedLowPrecisionOptimizer,
    ExactGradientStatistics,
    build_distributed_optimizer,
    skip_if_any_rank_non_finite,
)
from megatron_lowprec.numerics.rounding import StreamLayout, stream_id
from megatron_lowprec.optim import AdamW, Muon
from megatron_lowprec.optim.muon import NS_COEFFICIENTS, QUINTIC_COEFFICIENT_SETS, ShardedMatrix
from megatron_lowprec.optim.settings import OptimizerPrecision, SettingError, lowprec_field, precision_of
from megatron_lowprec.optim.strategies import PrecisionStrategy, strategy_names
from megatron_lowprec.optim.buckets import PER_GROUP_PARTS
from megatron_lowprec.optim.master import MASTER_KEYS, reset_master_, stored_master
from megatron_lowprec.optim.convert import STOCK_MASTER_KEY


class LowPrecisionOptimizer(ExactGradientStatistics, FP32Optimizer):
    """megatron-core's ``MegatronOptimizer`` interface around a precision-aware :class:`AdamW` or :class:`Muon`."""

    def __init__(
        self, optimizer: AdamW | Muon, config: OptimizerConfig, seed_offset: int = 0, convert_checkpoint: bool = False,
        label: str | None = None,
    ) -> None:
        super().__init__(optimizer, config, init_state_fn=lambda optimizer, config: None)
        self._grad_dtypes: dict[torch.nn.Parameter, torch.dtype | None] = {}
        self.seed_offset = seed_offset
        self.convert_checkpoint = convert_checkpoint
        """:meth:`load_state_dict` converts the state of another option (:func:`convert_saved_otherwise_`)."""
        self.label = label
        """What the conversion's lines name this optimizer by in a chain (``Muon``, ``AdamW``); ``None`` alone."""
        self.conversion_group: torch.distributed.ProcessGroup | None = None
        """Where each rank holds its own share of the parameters (a layer-wise chain's optimizers): the
        ranks whose conversions the lines count together."""

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
            self.release_grads()

    def release_grads(self) -> None:
        """Drop the ``.grad`` that :meth:`prepare_grads` gave a different dtype, restoring ``grad_dtype``."""
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

    def grads_for_norm(self) -> list[torch.Tensor]:
        """The gradients megatron counts in the norm: neither shared (the last stage's copy of a tied
        embedding) nor a tensor-parallel duplicate."""
        return [
            param.grad
            for param in self.get_parameters()
            if param.grad is not None
            and param_is_not_shared(param)
            and tensor_parallel.param_is_not_tensor_parallel_duplicate(param)
        ]

    @property
    def statistics_device(self) -> torch.device:
        return self.get_loss_scale().device

    def grads_to_clip(self) -> list[torch.Tensor]:
        return [p.grad for p in self.get_parameters() if p.grad is not None]

    def update_pieces(self) -> list[torch.Tensor]:
        """Per bucket (data-parallel replicas are identical and are not summed); a bucket of
        tensor-parallel-replicated parameters (buckets are keyed by that) on tensor-parallel rank 0 only."""
        return [
            pieces for bucket, pieces in zip(self.optimizer.buckets, self.optimizer.bucket_update_pieces)
            if tensor_parallel.param_is_not_tensor_parallel_duplicate(bucket.params[0])
        ]

    def update_quality_groups(self) -> list[torch.distributed.ProcessGroup]:
        return [parallel_state.get_model_parallel_group()]

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
        master into its storage by :meth:`AdamW.load_state_dict`). A state dict of another option is
        converted into this one where :attr:`convert_checkpoint` is set (the parameters with it: load
        the model first), else refused with ``ValueError`` in one line; so is a state of this option
        whose FP8 expansion exponents are stored in another format (a res8 state saved while they were FP32)."""
        params = self.get_parameters()
        report = convert_saved_otherwise_(
            state_dict, params, self.optimizer.strategy, self.convert_checkpoint, self._own_common_state
        )
        if report is not None:
            if self.conversion_group is not None:
                report = agreed_over(report, sum(param.numel() for param in params), self.conversion_group)
            say_conversion(report.lines(), self.label)
        for index, entry in state_dict["state"].items():
            if index == "common_step" or not any(key.endswith(PER_GROUP_PARTS) for key in entry):
                continue
            param = params[index]
            moment = self.optimizer.strategy.moment_names[0]
            if entry[f"{moment}_scale"].numel() == param.numel() and entry[f"{moment}_payload"].dtype == torch.uint8:
                restored = {
                    key: value.clone()
                    for key, value in self.optimizer.state[param].items()
                    if torch.is_tensor(value) and key not in MASTER_KEYS.values()
                }
                restore_checkpoint_state(restored, entry, param.numel(), self.optimizer.strategy)
                entry.update(restored)
        super().load_state_dict(state_dict)
        self.optimizer.seed += self.seed_offset


    def _own_common_state(self) -> dict[str, Any]:
        """This optimizer's parameter groups and ``lowprec`` section, which a converted state of
        megatron-core's own optimizer takes (:func:`convert_saved_otherwise_`)."""
        own = self.state_dict()
        return {"param_groups": own["param_groups"], "lowprec": own["lowprec"]}


class LowPrecisionMuonOptimizer(ExactGradientStatistics, ChainedOptimizer):
    """``optimizer="muon"``: :class:`Muon` for the 2-D hidden weights and :class:`AdamW` for the rest,
    both with the same option, each in a :class:`LowPrecisionOptimizer`, chained as megatron-core
    chains its Muon and Adam. The gradients of both are clipped together by their one global norm
    (:class:`~megatron_lowprec.megatron.distributed.ExactGradientStatistics`), and a step with a
    non-finite gradient on any rank is skipped by both."""

    @property
    def statistics_device(self) -> torch.device:
        return self.chained_optimizers[0].statistics_device

    def get_grad_stats_parallel_group(self) -> torch.distributed.ProcessGroup:
        return self.chained_optimizers[0].get_grad_stats_parallel_group()

    def grads_for_norm(self) -> list[torch.Tensor]:
        return [grad for optimizer in self.chained_optimizers for grad in optimizer.grads_for_norm()]

    def grads_to_clip(self) -> list[torch.Tensor]:
        return [grad for optimizer in self.chained_optimizers for grad in optimizer.grads_to_clip()]

    def update_pieces(self) -> list[torch.Tensor]:
        return [piece for optimizer in self.chained_optimizers for piece in optimizer.update_pieces()]

    def update_quality_groups(self) -> list[torch.distributed.ProcessGroup]:
        return self.chained_optimizers[0].update_quality_groups()

    @torch.no_grad()
    def step(self):
        """Megatron's chained step with this class's norm: prepare both, clip both by the norm, update
        both; the gradients are released afterwards as :meth:`LowPrecisionOptimizer.step` does."""
        if self.prepare_grads():
            for optimizer in self.chained_optimizers:
                optimizer.release_grads()
            return False, None, None
        grad_norm = self.clip_grad_norm(self.config.clip_grad) if self.config.clip_grad > 0.0 else self.get_grad_norm()
        num_zeros_in_grad = self.count_zeros() if self.config.log_num_zeros_in_grad else None
        try:
            return self.step_with_ready_grads(), grad_norm, num_zeros_in_grad
        finally:
            for optimizer in self.chained_optimizers:
                optimizer.release_grads()


def layer_wise_owners(params: list[torch.nn.Parameter], world_size: int) -> list[int]:
    """The data-parallel rank that updates each of ``params`` under the layer-wise distributed
    optimizer, as megatron-core's ``LayerWiseDistributedOptimizer`` deals them out without a
    shard-aligned layout: sorted by size (stably), to ranks 0, 1, ..., n-1, n-1, ..., 1, 0, 0, 1, ...
    in turn, so that each rank's share of the elements is about 1/n."""
    turns = [*range(world_size), *reversed(range(world_size))]
    owners = [0] * len(params)
    for turn, index in enumerate(sorted(range(len(params)), key=lambda index: params[index].numel())):
        owners[index] = turns[turn % len(turns)]
    return owners


class LayerWiseLowPrecisionMuonOptimizer(LowPrecisionMuonOptimizer):
    """The Muon chain sharded by whole parameters over the data-parallel ranks, as megatron-core's
    ``LayerWiseDistributedOptimizer`` shards its Muon and Adam (``use_layer_wise_distributed_optimizer``
    or ``optimizer="dist_muon"``): each parameter and all its state are on one rank, whose chained
    optimizers hold only their parameters in megatron's groups (empty where the rank has none of a
    group). Each rank updates its parameters with their reduced gradients, then every rank gets every
    parameter. Two layouts, as in megatron:

    * DDP all-reduces every gradient (``use_distributed_optimizer=False``; megatron's layer-wise path
      without its layout): Muon's and AdamW's parameters are dealt to the ranks by
      :func:`layer_wise_owners`, and :meth:`gather_params` all-gathers them after the step.
    * megatron's shard-aligned layout (DDP reduce-scatters; :func:`layer_wise_layout_owners`): each
      Muon parameter is updated by the rank whose shard holds it whole, AdamW is the distributed
      optimizer over DDP's other buffers, and its all-gather of DDP's buffers after the step carries
      the Muon parameters too.

    The gradient norm and the non-finite check reduce over all ranks, the norm is exact
    (:class:`~megatron_lowprec.megatron.distributed.ExactGradientStatistics`), and stochastic
    rounding draws each element's words by its name and index, so that a step is the unsharded
    chain's bit for bit. In a checkpoint, the state tensors of a layer-wise parameter are written by
    its owner (replica id 0 over data parallelism) under the unsharded chain's keys, so either chain
    loads the other's."""

    def __init__(
        self, chained_optimizers: list[Any], params_by_rank: list[list[torch.nn.Parameter]],
        data_parallel_group: torch.distributed.ProcessGroup, sharded_by_layer: int,
    ) -> None:
        """``params_by_rank``: the parameters of the first ``sharded_by_layer`` chained optimizers
        (the layer-wise ones) that each data-parallel rank updates; the others are megatron's
        distributed optimizer."""
        super().__init__(chained_optimizers)
        self.params_by_rank = params_by_rank
        self.data_parallel_group = data_parallel_group
        self.sharded_by_layer = sharded_by_layer
        for optimizer in chained_optimizers[:sharded_by_layer]:
            optimizer.grad_stats_parallel_group = torch.distributed.group.WORLD
            optimizer.conversion_group = data_parallel_group

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        """Each rank's update of its parameters, then :meth:`gather_params`."""
        success = super().step_with_ready_grads()
        self.gather_params()
        return success

    def load_state_dict(self, state_dict: Any) -> None:
        """The chained optimizers' states, then :meth:`gather_params`: a loaded state may rewrite
        the parameters a rank owns (a remainder master's upper halves, a converted checkpoint's
        rounded masters), which every rank must see before the next forward pass."""
        super().load_state_dict(state_dict)
        self.gather_params()

    @torch.no_grad()
    def gather_params(self) -> None:
        """Where every chained optimizer is layer-wise (DDP all-reduces), every rank's parameters to
        every rank: per dtype, one all-gather over the data-parallel group of each rank's parameters,
        flattened and padded to the longest. (Otherwise the distributed optimizer's all-gather of
        DDP's buffers has brought them.)"""
        world_size = len(self.params_by_rank)
        if world_size == 1 or self.sharded_by_layer < len(self.chained_optimizers):
            return
        rank = torch.distributed.get_rank(self.data_parallel_group)
        for dtype in sorted({param.dtype for params in self.params_by_rank for param in params}, key=str):
            by_rank = [[param for param in params if param.dtype == dtype] for params in self.params_by_rank]
            sizes = [sum(param.numel() for param in params) for params in by_rank]
            own = torch.zeros(max(sizes), dtype=dtype, device=torch.cuda.current_device())
            if by_rank[rank]:
                torch.cat([param.detach().reshape(-1) for param in by_rank[rank]], out=own[: sizes[rank]])
            gathered = [torch.empty_like(own) for _ in range(world_size)]
            torch.distributed.all_gather(gathered, own, group=self.data_parallel_group)
            for owner, (params, size, flat) in enumerate(zip(by_rank, sizes, gathered)):
                if owner != rank:
                    for param, value in zip(params, flat[:size].split([param.numel() for param in params])):
                        param.detach().copy_(value.view(param.shape))

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, **kwargs):
        """The unsharded chain's sharded state dict of this rank's state, each state tensor of the
        layer-wise optimizers with replica id 0 over data parallelism (its owner writes it), an empty
        state kept local."""
        sharded = super().sharded_state_dict(model_sharded_state_dict, is_loading, **kwargs)
        for index in range(self.sharded_by_layer):
            for value in nested_values(sharded[index]):
                if hasattr(value, "replica_id"):
                    value.replica_id = 0 if isinstance(value.replica_id, int) else (*value.replica_id[:-1], 0)
            if not sharded[index]["state"]:
                sharded[index]["state"] = LocalNonpersistentObject(sharded[index]["state"])
        return sharded

    def save_state_dict_to_file(self, filename: str) -> None:
        """This rank's state dict in a file of its own (Megatron-LM's ``--ckpt-format torch`` with the
        layer-wise optimizer writes one per data-parallel rank)."""
        torch.save(self.state_dict(), filename)

    def load_state_dict_from_file(self, filename: str) -> None:
        """The state dict that :meth:`save_state_dict_to_file` wrote on this rank, unpickled with
        ``weights_only=True``: a checkpoint holds tensors and plain containers, never code to run."""
        self.load_state_dict(load_tensors_only(filename))


def saved_option_template(
    sharded_optimizer_state: dict, source: PrecisionStrategy, stock: bool = False, stock_master_key: str = STOCK_MASTER_KEY,
) -> dict:
    """An optimizer's sharded state dict for loading (``sharded_state_dict(..., is_loading=True)``)
    with each parameter's states replaced by those a run of ``source`` saves, in checkpoint form
    (:func:`~megatron_lowprec.megatron.checkpoint_state.checkpoint_dtypes`, each of its parameter's
    shape, under ``optimizer.state.<key>.<parameter key>``): what ``dist_checkpointing.load`` reads
    a checkpoint of another option with, before the optimizer's ``load_state_dict`` converts it
    (:func:`~megatron_lowprec.megatron.conversion.convert_saved_otherwise_`); a chained optimizer's
    prefix (``chained_<i>.``) is kept. ``stock``: megatron-core's
    own optimizer wrote it, its FP32 master under
    :data:`~megatron_lowprec.optim.convert.STOCK_MASTER_KEY` (``source`` is then option D's formats),
    read from ``optimizer.state.<stock_master_key>.<parameter key>`` (megatron-core's
    ``DistributedOptimizer`` saves it under :data:`~megatron_lowprec.megatron.torch_dist.DISTRIBUTED_MASTER_KEY`)."""
    renamed = {MASTER_KEYS["fp32"]: STOCK_MASTER_KEY} if stock else {}
    stored = {MASTER_KEYS["fp32"]: stock_master_key} if stock else {}
    if not isinstance(sharded_optimizer_state["state"], dict):
        return sharded_optimizer_state  # a layer-wise optimizer's rank without states keeps its empty state local
    states = {}
    for index, entry in sharded_optimizer_state["state"].items():
        tensors = [value for value in entry.values() if hasattr(value, "key")] if isinstance(entry, dict) else []
        if not tensors:
            states[index] = entry
            continue
        like = tensors[0]
        prefix, state_and_model_key = like.key.split("optimizer.state.", 1)
        model_key = state_and_model_key.split(".", 1)[1]
        param_dtype = like.data.dtype if like.data.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        states[index] = {
            **{key: value for key, value in entry.items() if not hasattr(value, "key")},
            **{
                renamed.get(key, key): dataclasses.replace(
                    like, key=f"{prefix}optimizer.state.{stored.get(key, key)}.{model_key}", dtype=dtype,
                    data=torch.empty(like.data.shape, dtype=dtype, device=like.data.device),
                )
                for key, dtype in checkpoint_dtypes(source, param_dtype).items()
            },
        }
    return {**sharded_optimizer_state, "state": states}


def load_tensors_only(filename: str) -> Any:
    """``torch.load(filename, weights_only=True)``; a file that asks to build any other object (a
    crafted or foreign pickle) stops with one line naming the file and the object, before anything
    of it runs."""
    try:
        return torch.load(filename, weights_only=True)
    except pickle.UnpicklingError as error:
        torch_advice = ("Weights only load failed", "Please file an issue", "Check the documentation")
        lines = [line.replace("WeightsUnpickler error:", "").strip() for line in str(error).splitlines()]
        refused = next((line for line in lines if line and not line.startswith(torch_advice)), "an object it may not build")
        raise ValueError(
            f"{filename}: refused to unpickle it, the optimizer's state file holds only tensors and plain "
            f"containers ({refused})"
        ) from None


def is_muon_param(param: torch.nn.Parameter) -> bool:
    """Whether Muon updates ``param``: a 2-D weight that is neither the embedding nor the output layer
    (megatron-core's rule); AdamW updates the others."""
    return param.ndim == 2 and not getattr(param, "is_embedding_or_output_parameter", False)


MUON_TP_MODES = ("blockwise", "duplicated")
"""megatron-core's ``muon_tp_mode`` values that :class:`Muon` runs: ``"blockwise"`` orthogonalizes
each tensor-parallel shard on its own (scaled by the shard's shape), ``"duplicated"`` the whole
matrix, all-gathered on every rank, keeping the rank's shard (:class:`ShardedMatrix`). megatron's
``"distributed"`` (Newton-Schulz with sharded matmuls) is refused with TP > 1; at TP = 1 all three
are the same."""


def sharded_matrices(model_chunks: list[torch.nn.Module], tp_mode: str) -> dict[torch.nn.Parameter, ShardedMatrix]:
    """With ``tp_mode="duplicated"`` and tensor parallelism, the :class:`ShardedMatrix` of each
    tensor-parallel shard (``tensor_model_parallel``, cut along ``partition_dim``); else none."""
    world_size = parallel_state.get_tensor_model_parallel_world_size()
    if tp_mode != "duplicated" or world_size == 1:
        return {}
    group = parallel_state.get_tensor_model_parallel_group()
    rank = parallel_state.get_tensor_model_parallel_rank()
    return {
        param: ShardedMatrix(group, param.partition_dim, rank, world_size)
        for chunk in model_chunks
        for param in chunk.parameters()
        if getattr(param, "tensor_model_parallel", False)
    }


def qkv_split_rows(model_chunks: list[torch.nn.Module], split_qkv: bool) -> dict[torch.nn.Parameter, tuple[int, ...]]:
    """With ``split_qkv``, the rows of each query group's query, key and value blocks in every fused
    QKV weight (``linear_qkv.weight``), from the model's ``num_attention_heads``,
    ``num_query_groups`` and ``kv_channels``, as megatron-core's Muon splits them; else none."""
    from megatron.core.utils import get_model_config

    if not split_qkv:
        return {}
    rows = {}
    for chunk in model_chunks:
        model_config = get_model_config(chunk)
        query_groups = model_config.num_query_groups or model_config.num_attention_heads
        kv_channels = model_config.kv_channels
        split = (model_config.num_attention_heads // query_groups * kv_channels, kv_channels, kv_channels)
        rows.update({
            param: split for name, param in chunk.named_parameters() if name.endswith("linear_qkv.weight") and param.ndim == 2
        })
    return rows


MUON_SCALE_MODES = ("spectral", "shape_scaling", "unit_rms_norm")
"""megatron-core's ``muon_scale_mode`` names, which :class:`Muon`'s ``scale_mode`` takes as they are."""

MUON_COEFFICIENT_TYPES = {"quintic": QUINTIC_COEFFICIENT_SETS, "simple": NS_COEFFICIENTS}
"""megatron-core's ``muon_coefficient_type`` names (emerging-optimizers' sets) and :class:`Muon`'s
``ns_coefficients`` for each: ``"quintic"`` (megatron's default) a triple per iteration,
``"simple"`` Keller Jordan's (3.4445, -4.775, 2.0315) at every iteration (``torch.optim.Muon``'s)."""


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


@dataclasses.dataclass
class LowPrecisionOptimizerConfig(OptimizerConfig):
    """megatron-core's ``OptimizerConfig`` with the precision option and its settings, so that a
    caller passing only megatron's arguments gets the option: ``build_optimizer(config, model_chunks,
    ...)`` as ``get_megatron_optimizer`` is called, and :meth:`provide` as Megatron-Bridge calls it.

    Each ``lowprec_KEY`` field is :class:`~megatron_lowprec.optim.settings.OptimizerPrecision`'s
    ``KEY`` (:meth:`precision`), checked when the config is made. Everything else is megatron's:
    ``optimizer`` (``"adam"`` or ``"muon"``), lr, weight decay, Adam's betas and eps, the ``muon_*``
    settings, ``clip_grad``, ``use_distributed_optimizer``, ``decoupled_lr``;
    ``muon_coefficient_type`` on megatron-core 0.16 too.
    """

    lowprec_option: str | None = None
    """:attr:`OptimizerPrecision.option <megatron_lowprec.optim.settings.OptimizerPrecision.option>`; required."""
    lowprec_master_storage: str | None = None
    """:attr:`OptimizerPrecision.master_storage <megatron_lowprec.optim.settings.OptimizerPrecision.master_storage>`."""
    lowprec_moment_storage: str | None = None
    """:attr:`OptimizerPrecision.moment_storage <megatron_lowprec.optim.settings.OptimizerPrecision.moment_storage>`."""
    lowprec_convert_checkpoint: bool = False
    """:attr:`OptimizerPrecision.convert_checkpoint <megatron_lowprec.optim.settings.OptimizerPrecision.convert_checkpoint>`:
    the optimizer's ``load_state_dict`` converts another option's state, or megatron-core's own
    AdamW's, in the plain, the distributed and the Muon chain's optimizers."""
    lowprec_fused: bool | None = None
    """:attr:`OptimizerPrecision.fused <megatron_lowprec.optim.settings.OptimizerPrecision.fused>`."""
    lowprec_background_compile: bool = False
    """:attr:`OptimizerPrecision.background_compile <megatron_lowprec.optim.settings.OptimizerPrecision.background_compile>`;
    off by default here, as in ``AdamW`` (on in ``lowprec-train`` and the Megatron-LM entry)."""
    lowprec_shared_randomness: bool = True
    """:attr:`OptimizerPrecision.shared_randomness <megatron_lowprec.optim.settings.OptimizerPrecision.shared_randomness>`."""
    lowprec_track_update_quality: bool = False
    """:attr:`OptimizerPrecision.track_update_quality <megatron_lowprec.optim.settings.OptimizerPrecision.track_update_quality>`
    (``optimizer.update_quality()``)."""
    lowprec_seed: int = 0
    """:attr:`OptimizerPrecision.seed <megatron_lowprec.optim.settings.OptimizerPrecision.seed>`."""
    muon_coefficient_type: str = "quintic"
    """megatron's own field from megatron-core 0.17 (its default), declared here for 0.16."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.lowprec_option is None:
            raise ValueError(f"LowPrecisionOptimizerConfig needs lowprec_option, one of {', '.join(strategy_names())}")
        try:
            self.precision().check()
        except SettingError as error:
            raise ValueError(error.spelled(lowprec_field)) from None

    def precision(self) -> OptimizerPrecision:
        """The ``lowprec_*`` fields as the settings they spell."""
        return precision_of(self, lowprec_field)

    @classmethod
    def from_optimizer_config(cls, config: OptimizerConfig, **changes: Any) -> LowPrecisionOptimizerConfig:
        """``config``'s megatron fields (the ``timers`` Megatron-LM attaches included, and a
        ``muon_coefficient_type`` set on a megatron-core 0.16 config) with ``changes``
        (``lowprec_option=...``, or any field) applied."""
        names = [field.name for field in dataclasses.fields(OptimizerConfig)] + ["muon_coefficient_type"]
        fields = {name: getattr(config, name) for name in names if hasattr(config, name)}
        return cls(**{**fields, **changes})

    def provide(
        self,
        model_chunks: torch.nn.Module | list[torch.nn.Module],
        config_overrides: dict | None = None,
        use_gloo_process_groups: bool = True,
        pg_collection: Any = None,
    ) -> LowPrecisionOptimizer | DistributedLowPrecisionOptimizer:
        """Megatron-Bridge's optimizer-provider contract (``training/optim.py`` calls it in place of
        ``get_megatron_optimizer`` when the config has it): :func:`build_optimizer` with this config."""
        return build_optimizer(
            self, model_chunks, config_overrides=config_overrides,
            use_gloo_process_groups=use_gloo_process_groups, pg_collection=pg_collection,
        )


UNSUPPORTED_SETTINGS = (
    ("fp16", True, "FP16 loss scaling is not implemented by the precision options; train in BF16 (bf16=True)"),
    ("decoupled_weight_decay", False, "the precision options are AdamW (decoupled weight decay)"),
    ("use_precision_aware_optimizer", True, "Transformer Engine's precision-aware FusedAdam is another optimizer"),
    ("optimizer_cpu_offload", True, "optimizer states stay on the device"),
    ("overlap_param_gather_with_optimizer_step", True, "one optimizer covers all model chunks"),
    ("optimizer_cuda_graph", True, "the step is not captured in a CUDA graph"),
)
"""(field, value, why) of megatron ``OptimizerConfig`` settings the precision options cannot honour."""


def _check_config(config: OptimizerConfig) -> None:
    """One ``ValueError`` naming the first setting of ``config`` that the precision options cannot honour."""
    if config.optimizer not in ("adam", "muon"):
        raise ValueError(
            f"config.optimizer={config.optimizer!r}: the precision options are AdamW or Muon; set optimizer='adam' or "
            "'muon' ('dist_muon': 'muon' with use_layer_wise_distributed_optimizer=True)"
        )
    if config.optimizer == "muon":
        _check_muon_config(config)
    elif getattr(config, "use_layer_wise_distributed_optimizer", False):
        raise ValueError(
            "config.use_layer_wise_distributed_optimizer=True shards the emerging optimizers (Muon) by layer; with "
            "optimizer='adam' use use_distributed_optimizer=True"
        )
    for name, value, why in UNSUPPORTED_SETTINGS:
        if getattr(config, name, not value) == value:
            raise ValueError(f"config.{name}={value!r} is not supported by the precision options: {why}")
    threshold = getattr(config, "grad_norm_skip_threshold", math.inf)
    if threshold != math.inf:
        raise ValueError(f"config.grad_norm_skip_threshold={threshold!r} is not supported by the precision options")


def _check_muon_config(config: LowPrecisionOptimizerConfig) -> None:
    """One ``ValueError`` naming the first Muon setting of ``config`` that :class:`Muon` cannot honour."""
    if config.use_distributed_optimizer:
        raise ValueError(
            "config.use_distributed_optimizer=True is not supported with optimizer='muon' (nor by megatron-core's Muon); "
            "shard Muon with use_layer_wise_distributed_optimizer=True (or optimizer='dist_muon')"
        )
    if config.lowprec_track_update_quality:
        raise ValueError("lowprec_track_update_quality=True is not supported with optimizer='muon' (Muon measures no update quality)")
    if config.muon_scale_mode not in MUON_SCALE_MODES:
        raise ValueError(f"config.muon_scale_mode={config.muon_scale_mode!r} is not valid; choose one of {', '.join(MUON_SCALE_MODES)}")
    coefficient_type = getattr(config, "muon_coefficient_type", "quintic")
    if coefficient_type not in MUON_COEFFICIENT_TYPES:
        raise ValueError(
            f"config.muon_coefficient_type={coefficient_type!r} is not supported by the precision options' Muon; choose "
            f"{' or '.join(repr(name) for name in MUON_COEFFICIENT_TYPES)}"
        )
    scalar_optimizer = getattr(config, "muon_scalar_optimizer", "adam")
    if scalar_optimizer != "adam":
        raise ValueError(
            f"config.muon_scalar_optimizer={scalar_optimizer!r} is not supported by the precision options' Muon; "
            "set muon_scalar_optimizer='adam'"
        )
    tensor_parallel = parallel_state.get_tensor_model_parallel_world_size() > 1
    if config.muon_tp_mode not in MUON_TP_MODES and (tensor_parallel or config.muon_tp_mode != "distributed"):
        raise ValueError(
            f"config.muon_tp_mode={config.muon_tp_mode!r} is not supported by the precision options' Muon; choose "
            f"{' or '.join(repr(mode) for mode in MUON_TP_MODES)} (each tensor-parallel shard orthogonalized on its own, "
            "or the whole matrix gathered on every rank)"
        )


def _check_process_groups(pg_collection: Any) -> None:
    """``pg_collection`` must hold megatron's global (``parallel_state``) groups, which the optimizers use."""
    if pg_collection is None:
        return
    expected = {
        "tp": parallel_state.get_tensor_model_parallel_group(),
        "pp": parallel_state.get_pipeline_model_parallel_group(),
        "mp": parallel_state.get_model_parallel_group(),
        "dp_cp": parallel_state.get_data_parallel_group(with_context_parallel=True),
    }
    different = [name for name, group in expected.items() if getattr(pg_collection, name, group) is not group]
    if different:
        raise ValueError(
            f"pg_collection's {', '.join(different)} differ from megatron's parallel_state groups; the precision "
            "options run on the global groups (ProcessGroupCollection.use_mpu_process_groups())"
        )


def _dump_param_groups(model_chunks: list[torch.nn.Module], groups: list[dict[str, Any]], path: str) -> None:
    """Megatron's ``dump_param_to_param_group_map``: each parameter's global name → its group index."""
    from megatron.core.transformer.fsdp_dtensor_checkpoint import get_global_unique_param_name

    mapping = {
        get_global_unique_param_name(model_chunks, param): index
        for index, group in enumerate(groups)
        for param in group["params"]
    }
    torch.distributed.checkpoint.save(state_dict=mapping, checkpoint_id=path)


def build_optimizer(
    config: OptimizerConfig | str,
    model_chunks: torch.nn.Module | list[torch.nn.Module],
    config_overrides: dict | OptimizerConfig | None = None,
    use_gloo_process_groups: bool = True,
    pg_collection: Any = None,
    dump_param_to_param_group_map: str | None = None,
    *,
    seed: int | None = None,
    shared_randomness: bool | None = None,
    fused: bool | None = None,
    background_compile: bool | None = None,
    track_update_quality: bool | None = None,
    master_storage: str | None = None,
    moment_storage: str | None = None,
    convert_checkpoint: bool | None = None,
) -> LowPrecisionOptimizer | DistributedLowPrecisionOptimizer | LowPrecisionMuonOptimizer:
    """A precision option as the Megatron optimizer of ``model_chunks`` (after megatron DDP wrapping).

    Called as megatron-core's ``get_megatron_optimizer`` is, on every supported version::

        build_optimizer(config, model_chunks, config_overrides=None, use_gloo_process_groups=True,
                        pg_collection=None, dump_param_to_param_group_map=None)

    with ``config`` a :class:`LowPrecisionOptimizerConfig`, which names the option; or with the
    option by name and a plain ``OptimizerConfig``: ``build_optimizer("C", model_chunks, config)``.
    The keywords (:class:`~megatron_lowprec.optim.settings.OptimizerPrecision`'s fields but ``option``)
    override the config's ``lowprec_*`` settings in either form.
    ``convert_checkpoint=True`` lets the optimizer's ``load_state_dict`` take the state of another
    option, or of megatron-core's own AdamW, converted into this one by its meaning
    (:mod:`megatron_lowprec.megatron.conversion`; load the model's state first), in every optimizer
    built here: plain, distributed, and each optimizer of the Muon chain (from this package's Muon
    chain; megatron-core's own Muon is not read); for ``dist_checkpointing``, read such a checkpoint
    with :func:`saved_option_template` (Megatron-LM's entry does:
    :func:`~megatron_lowprec.megatron.megatron_lm.optimizer_template_for`).

    Parameter groups are megatron's own, built as ``get_megatron_optimizer`` builds them on the
    installed megatron-core (:func:`~megatron_lowprec.megatron.compat.param_groups`): with
    ``config_overrides=None`` no weight decay on biases and 1-D parameters and ``decoupled_lr`` for
    the embedding and output layer; a caller's ``config_overrides`` replace these defaults, as in
    megatron (``wd_mult``, ``max_lr``/``min_lr`` for ``OptimizerParamScheduler``, ``eps``...).
    ``config.use_distributed_optimizer`` shards every state across the data-parallel ranks
    (ZeRO-1, :mod:`megatron_lowprec.megatron.distributed`); the chunks must then be DDP built with
    ``use_distributed_optimizer=True`` as well. ``dump_param_to_param_group_map`` is written as
    megatron writes it. ``use_gloo_process_groups`` changes nothing (no gloo group is used);
    ``pg_collection`` must hold megatron's global groups. ``config.optimizer="muon"`` gives
    :class:`LowPrecisionMuonOptimizer`: :class:`~megatron_lowprec.optim.Muon` for the 2-D hidden
    weights and AdamW for the embedding, output layer and 1-D parameters, both with the option and
    megatron's ``muon_*`` settings (``muon_scale_mode`` ``spectral``, ``shape_scaling`` or
    ``unit_rms_norm``; ``muon_coefficient_type`` ``quintic`` or ``simple``, :data:`MUON_COEFFICIENT_TYPES`; ``muon_split_qkv`` orthogonalizing query, key and value rows apart;
    ``muon_tp_mode`` ``blockwise`` or ``duplicated``, :data:`MUON_TP_MODES`; megatron's layer-wise
    distributed optimizer, ``use_layer_wise_distributed_optimizer`` or ``optimizer="dist_muon"``, with
    DDP all-reducing the gradients or in megatron's shard-aligned layout:
    :class:`LayerWiseLowPrecisionMuonOptimizer`; not megatron's distributed optimizer). What cannot be honoured (another
    ``config.optimizer``, expert-parallel parameters, FP16 loss scaling, CPU offloading, ...) raises
    one ``ValueError`` naming it before anything is built, as does an unknown option. Parameters must
    be BF16 (``Float16Module``).
    """
    if isinstance(config, str):
        if not isinstance(config_overrides, OptimizerConfig):
            raise TypeError(
                "build_optimizer(option, model_chunks, config): the third argument must be megatron's OptimizerConfig, "
                f"not {type(config_overrides).__name__}"
            )
        config = LowPrecisionOptimizerConfig.from_optimizer_config(config_overrides, lowprec_option=config)
        config_overrides = None
    if not isinstance(config, LowPrecisionOptimizerConfig):
        raise ValueError(
            f"build_optimizer got a {type(config).__name__} without a precision option: pass a "
            "LowPrecisionOptimizerConfig(lowprec_option=..., ...) or build_optimizer(option, model_chunks, config)"
        )
    given = {"seed": seed, "shared_randomness": shared_randomness, "fused": fused, "background_compile": background_compile,
             "track_update_quality": track_update_quality, "master_storage": master_storage,
             "moment_storage": moment_storage, "convert_checkpoint": convert_checkpoint}
    config = dataclasses.replace(config, **{lowprec_field(name): value for name, value in given.items() if value is not None})
    layer_wise = config.optimizer == "dist_muon" or getattr(config, "use_layer_wise_distributed_optimizer", False)
    if config.optimizer == "dist_muon":
        config = dataclasses.replace(config, optimizer="muon")
    model_chunks = [model_chunks] if isinstance(model_chunks, torch.nn.Module) else list(model_chunks)
    strategy = config.precision().strategy()
    _check_config(config)
    _check_process_groups(pg_collection)
    if (config.use_distributed_optimizer or layer_wise) and not config.lowprec_shared_randomness:
        raise ValueError(
            "shared_randomness=False (the SR paper's drifting replicas) needs use_distributed_optimizer=False and "
            "use_layer_wise_distributed_optimizer=False: sharded, each element is updated on one rank only"
        )
    megatron_groups = compat.param_groups(model_chunks, config, config_overrides)
    for group in megatron_groups:
        if group.get("optimizer", config.optimizer) != config.optimizer:
            raise ValueError(
                f"config_overrides set optimizer={group['optimizer']!r} for a group; the precision options run "
                f"config.optimizer={config.optimizer!r} for all groups"
            )
        if group["is_expert_parallel"] and group["params"]:
            raise ValueError("expert-parallel (MoE expert) parameters are not supported by the precision options")
    if dump_param_to_param_group_map is not None:
        _dump_param_groups(model_chunks, megatron_groups, dump_param_to_param_group_map)
    groups: list[dict[str, Any]] = [
        {**group, "lr": config.lr * group["lr_mult"], "weight_decay": config.weight_decay * group["wd_mult"]}
        for group in megatron_groups
        if group["params"]
    ]
    if config.use_distributed_optimizer:
        return build_distributed_optimizer(
            strategy, model_chunks, config, groups, seed=config.lowprec_seed, fused=config.lowprec_fused,
            track_update_quality=config.lowprec_track_update_quality, stream_layouts=stream_layouts(model_chunks),
            background_compile=config.lowprec_background_compile, convert_checkpoint=config.lowprec_convert_checkpoint,
        )
    seed_offset = 0 if config.lowprec_shared_randomness else torch.distributed.get_rank() * 1_000_003
    if config.optimizer == "muon":
        return _build_muon(config, strategy, model_chunks, groups, seed_offset, layer_wise)
    return LowPrecisionOptimizer(
        _adamw(config, strategy, model_chunks, groups, seed_offset), config, seed_offset, config.lowprec_convert_checkpoint
    )


def _adamw(
    config: LowPrecisionOptimizerConfig, strategy: PrecisionStrategy, model_chunks: list[torch.nn.Module], groups: list[dict[str, Any]], seed_offset: int
) -> AdamW:
    """The plain (not distributed) AdamW of ``groups`` with megatron's Adam settings."""
    return AdamW(
        groups,
        lr=config.lr,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_eps,
        weight_decay=config.weight_decay,
        option=strategy,
        seed=config.lowprec_seed + seed_offset,
        fused=config.lowprec_fused,
        background_compile=config.lowprec_background_compile,
        track_update_quality=config.lowprec_track_update_quality,
        check_grads_finite=False,
        stream_layout=stream_layouts(model_chunks).__getitem__,
        bucket_key=tensor_parallel.param_is_not_tensor_parallel_duplicate,
    )


def _build_muon(
    config: LowPrecisionOptimizerConfig, strategy: PrecisionStrategy, model_chunks: list[torch.nn.Module], groups: list[dict[str, Any]],
    seed_offset: int, layer_wise: bool,
) -> LowPrecisionMuonOptimizer:
    """Muon for each group's 2-D hidden weights (:func:`is_muon_param`), AdamW for its other
    parameters, with the group's settings, megatron's Muon settings and the same option; with
    ``layer_wise``, :class:`LayerWiseLowPrecisionMuonOptimizer`: Muon holds only this data-parallel
    rank's parameters, and AdamW too where DDP all-reduces the gradients, or is the distributed
    optimizer over DDP's other buffers where megatron's shard-aligned layout reduce-scatters them.
    Muon takes ``lowprec_fused`` as AdamW does: its fused step owns flat parameter buffers, but in
    that shard-aligned layout, whose Muon parameters stay in DDP's buffer for its all-gather, it
    reads and writes them there in place (``params_in_buffer``)."""
    muon_groups = [{**group, "params": [p for p in group["params"] if is_muon_param(p)]} for group in groups]
    adam_groups = [{**group, "params": [p for p in group["params"] if not is_muon_param(p)]} for group in groups]
    muon_groups = [group for group in muon_groups if group["params"]]
    adam_groups = [group for group in adam_groups if group["params"]]
    layout_owners = layer_wise_layout_owners(model_chunks) if layer_wise else None
    if layer_wise:
        data_parallel = parallel_state.get_data_parallel_group(with_context_parallel=True)
        world_size, rank = torch.distributed.get_world_size(data_parallel), torch.distributed.get_rank(data_parallel)
        sharded = muon_groups if layout_owners is not None else muon_groups + adam_groups
        every_param = [param for group in sharded for param in group["params"]]
        owners = layout_owners if layout_owners is not None else dict(zip(every_param, layer_wise_owners(every_param, world_size)))
        missing = [tuple(param.shape) for param in every_param if param not in owners]
        if missing:
            raise ValueError(
                f"Muon parameters of shapes {missing} are not in a buffer of megatron's layer-wise layout; tag the parameters "
                "(tag_params_for_buffer_routing) before DDP builds its buffers, as Megatron-LM does"
            )
        params_by_rank = [[param for param in every_param if owners[param] == owner] for owner in range(world_size)]
        muon_groups = [{**group, "params": [p for p in group["params"] if owners[p] == rank]} for group in muon_groups]
        if layout_owners is None:
            adam_groups = [{**group, "params": [p for p in group["params"] if owners[p] == rank]} for group in adam_groups]
    muon = Muon(
        muon_groups,
        lr=config.lr,
        weight_decay=config.weight_decay,
        momentum=config.muon_momentum,
        nesterov=getattr(config, compat.muon_nesterov_field()),
        ns_coefficients=MUON_COEFFICIENT_TYPES[getattr(config, "muon_coefficient_type", "quintic")],
        ns_steps=config.muon_num_ns_steps,
        scale_mode=config.muon_scale_mode,
        extra_scale_factor=config.muon_extra_scale_factor,
        option=strategy,
        fused=config.lowprec_fused,
        params_in_buffer=layout_owners is not None,
        buffer_row=ROW,
        background_compile=config.lowprec_background_compile,
        seed=config.lowprec_seed + seed_offset,
        check_grads_finite=False,
        stream_layout=stream_layouts(model_chunks).__getitem__,
        sharded_matrix=sharded_matrices(model_chunks, config.muon_tp_mode).get,
        split_rows=qkv_split_rows(model_chunks, config.muon_split_qkv).get,
    )
    muon_optimizer = LowPrecisionOptimizer(muon, config, seed_offset, config.lowprec_convert_checkpoint, label="Muon")
    if layout_owners is not None:
        adam = build_distributed_optimizer(
            strategy, model_chunks, config, adam_groups, seed=config.lowprec_seed, fused=config.lowprec_fused,
            track_update_quality=False, stream_layouts=stream_layouts(model_chunks),
            background_compile=config.lowprec_background_compile, convert_checkpoint=config.lowprec_convert_checkpoint,
            label="AdamW",
            buffers=[buffer for chunk in model_chunks for buffer in chunk.buffers if not _in_layer_wise_buffer(buffer.params[0])],
        )
        return LayerWiseLowPrecisionMuonOptimizer([muon_optimizer, adam], params_by_rank, data_parallel, sharded_by_layer=1)
    adamw = LowPrecisionOptimizer(
        _adamw(config, strategy, model_chunks, adam_groups, seed_offset), config, seed_offset,
        config.lowprec_convert_checkpoint, label="AdamW",
    )
    if layer_wise:
        return LayerWiseLowPrecisionMuonOptimizer([muon_optimizer, adamw], params_by_rank, data_parallel, sharded_by_layer=2)
    return LowPrecisionMuonOptimizer([muon_optimizer, adamw])


def _in_layer_wise_buffer(param: torch.nn.Parameter) -> bool:
    """Whether megatron tagged ``param`` for its layer-wise layout's buffers (``tag_params_for_buffer_routing``)."""
    return getattr(param, "is_managed_by_layer_wise_optimizer", False)


def layer_wise_layout_owners(model_chunks: list[torch.nn.Module]) -> dict[torch.nn.Parameter, int] | None:
    """Where DDP reduce-scatters the gradients (``use_distributed_optimizer``) in megatron's
    shard-aligned layer-wise layout (megatron-core 0.19+, Megatron-LM's default under
    ``--use-distributed-optimizer`` with Muon), the data-parallel shard that holds each parameter of
    its layer-wise buffers, whole (megatron's ``LayerWiseDistributedOptimizer`` assigns them so);
    ``None`` where DDP all-reduces every gradient. ``ValueError`` where DDP reduce-scatters without
    that layout."""
    owners: dict[torch.nn.Parameter, int] = {}
    scattering = False
    for chunk in model_chunks:
        ddp_config = getattr(chunk, "ddp_config", None)
        if ddp_config is None or not ddp_config.use_distributed_optimizer:
            continue
        scattering = True
        layout = getattr(chunk, "full_param_layout", None)
        for key, buffer_layout in (layout.layouts.items() if layout is not None else ()):
            if not getattr(key, "is_managed_by_layer_wise_optimizer", False):
                continue
            for param, (start, _, bucket_id) in buffer_layout.param_index_map.items():
                bucket_start, bucket_end = buffer_layout.bucket_indices[bucket_id]
                owners[param] = (start - bucket_start) // ((bucket_end - bucket_start) // buffer_layout.num_optimizer_shards)
    if scattering and not owners:
        raise ValueError(
            "use_layer_wise_distributed_optimizer=True with a DDP that reduce-scatters the gradients (use_distributed_optimizer=True) "
            "needs megatron's layer-wise layout (full_param_layout from LayerWiseDistributedOptimizer.compute_full_param_layout, "
            "as Megatron-LM builds it); or build DDP with use_distributed_optimizer=False"
        )
    return owners if scattering else None
