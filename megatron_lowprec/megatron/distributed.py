"""ZeRO-1 for every precision option: megatron's distributed optimizer with a precision-aware AdamW.

megatron-core's ``DistributedDataParallel`` with ``use_distributed_optimizer=True`` keeps the
16-bit parameters and their gradients in contiguous buffers cut into buckets, each padded so that
it splits evenly across the data-parallel ranks; it reduce-scatters each bucket's gradients (rank
r receives the reduced shard ``[r·S, (r+1)·S)``) and all-gathers the parameters from the same
shards (``start_param_sync``). :class:`DistributedLowPrecisionOptimizer` updates this rank's shard
with its shard of every state of the precision option (m, v, δθ, δv, Kahan compensation, FP32
master, FP8 payloads with their group scales and expansion exponents), as megatron's
``DistributedOptimizer`` does for its FP32 main parameters. The optimizer is the plain path's
:class:`~megatron_lowprec.optim.AdamW`, stepping this rank's shards as its layout
(:class:`DistributedShards`): the same step, the same per-parameter state-dict format (each owned
piece's state, flat), one implementation of every option.

Reused from megatron-core: the DDP buffers, their bucketing, padding, reduce-scatter and
all-gather; ``Range`` and ``DistributedOptimizer._build_model_gbuf_param_range_map`` (which
parameter elements a bucket range holds); the ``MegatronOptimizer`` interface (scheduler, training
loop, ``dist_checkpointing``). Not reused: megatron's main-parameter groups and its wrapped torch
optimizer (the precision options keep no hidden FP32 copy except the masters of D, coat and
D-BF16, which are optimizer state here, whole or as 16-bit remainders below the owned parameters), and its gradient-norm code, whose FP32 sums depend on how the elements
are split (see :func:`global_grad_norm`).

Bit-identical to the unsharded optimizer: every element goes through the same kernel
(:func:`megatron_lowprec.optim.kernel.adamw_kernel_`); stochastic rounding draws each element's
word from its global index in its logical tensor (:class:`StreamLayout`), whichever rank and
slice holds it; and FP8 groups (coat's 1x128) follow each parameter's flattened elements, so a
shard boundary that falls inside a group moves to the group's end: the rank before it owns the
whole group, receives the reduced gradients of the group's tail from its neighbour (one small
all-gather per step over all buckets) and hands the updated tail back before megatron's
all-gather (another).
"""

from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer.optimizer import MegatronOptimizer
from megatron.core.transformer.module import param_is_not_shared

from megatron_lowprec.megatron.checkpoint_state import checkpoint_dtypes, checkpoint_state, restore_checkpoint_state
from megatron_lowprec.megatron.compat import GradNormInterface
from megatron_lowprec.megatron.conversion import agreed_over, convert_saved_otherwise_, say_conversion
from megatron_lowprec.megatron.layout import build_shard_bucket, owned_bounds
from megatron_lowprec.megatron.torch_dist import STOCK_FORM_KEY
from megatron_lowprec.metrics import UpdateQuality
from megatron_lowprec.numerics.rounding import StreamLayout
from megatron_lowprec.optim import statistics
from megatron_lowprec.optim.adamw import AdamW, non_finite_flag
from megatron_lowprec.optim.buckets import Bucket, BufferRows, elements_per_value
from megatron_lowprec.optim.layouts import BucketGrads, Layout
from megatron_lowprec.optim.master import reset_master_, stored_master
from megatron_lowprec.optim.statistics import Reduce
from megatron_lowprec.optim.strategies import PrecisionStrategy, check_exponent_storage, exponent_storage_record


EXPONENT_STORAGE_REMEDY = "lowprec-train's precision.convert_checkpoint=true converts a checkpoint of it"
"""What a checkpoint of another FP8 exponent storage than the optimizer's takes to load
(:func:`~megatron_lowprec.optim.strategies.check_exponent_storage`)."""


def megatron_sharding_api() -> tuple[type, type]:
    """megatron-core's ``Range`` and ``DistributedOptimizer``, checked for what this module uses;
    ``ValueError`` naming the installed version and the missing pieces otherwise."""
    import megatron.core
    from megatron.core import distributed

    version = getattr(megatron.core, "__version__", "unknown")
    try:
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer, Range
    except ImportError as error:
        raise ValueError(
            f"use_distributed_optimizer=True needs megatron-core's distributed optimizer (>= 0.16); "
            f"megatron-core {version} has none ({error})"
        ) from None
    missing = [
        name
        for name, present in (
            ("DistributedOptimizer._build_model_gbuf_param_range_map", hasattr(DistributedOptimizer, "_build_model_gbuf_param_range_map")),
            ("DistributedDataParallel.start_param_sync", hasattr(distributed.DistributedDataParallel, "start_param_sync")),
            ("DistributedDataParallelConfig.use_distributed_optimizer",
             "use_distributed_optimizer" in getattr(distributed.DistributedDataParallelConfig, "__dataclass_fields__", {})),
            ("parallel_state.get_intra_distributed_optimizer_instance_group",
             hasattr(parallel_state, "get_intra_distributed_optimizer_instance_group")),
        )
        if not present
    ]
    if missing:
        raise ValueError(
            f"use_distributed_optimizer=True needs megatron-core >= 0.16; megatron-core {version} lacks {', '.join(missing)}"
        )
    return Range, DistributedOptimizer


def all_reduce_over(group: torch.distributed.ProcessGroup) -> Reduce:
    """The :data:`~megatron_lowprec.optim.statistics.Reduce` of a megatron process group: an all-reduce."""
    return lambda tensor: torch.distributed.all_reduce(tensor, group=group)


def global_grad_norm(grads: list[torch.Tensor], group: torch.distributed.ProcessGroup, device: torch.device) -> float:
    """L2 norm of ``grads`` over the ranks of ``group`` (:func:`~megatron_lowprec.optim.statistics.grad_norm`:
    the exact Σ x², one all-reduce of its integer bins), so that the sharded and the unsharded
    optimizer, which hold the same gradients split differently, find the same bits for FP32 and
    16-bit gradients."""
    return statistics.grad_norm(grads, device, all_reduce_over(group))


class ExactGradientStatistics(GradNormInterface):
    """Gradient norm, clipping and update quality of both megatron optimizers (unsharded and
    distributed): :mod:`megatron_lowprec.optim.statistics` over megatron's process groups. A subclass says which gradients and pieces are its own:
    :meth:`grads_for_norm` (counted once over the model), :meth:`grads_to_clip` (every gradient it
    updates), :meth:`update_pieces` (the pieces of the last step that count on this rank),
    :meth:`update_quality_groups` (the process groups whose pieces add up) and :attr:`statistics_device`."""

    statistics_device: torch.device

    @abc.abstractmethod
    def grads_to_clip(self) -> list[torch.Tensor]:
        """Every gradient this optimizer updates with."""

    @abc.abstractmethod
    def update_pieces(self) -> list[torch.Tensor]:
        """The update-quality pieces of the last step that count on this rank: each bucket's, a
        tensor-parallel-replicated parameter's on one tensor-parallel rank only."""

    @abc.abstractmethod
    def update_quality_groups(self) -> list[torch.distributed.ProcessGroup]:
        """The process groups over which the update-quality pieces add up."""

    def get_grad_norm(self) -> float:
        """The global L2 norm of :meth:`grads_for_norm` (:func:`global_grad_norm`): the same bits for
        the unsharded and the distributed optimizer, for FP32 and 16-bit gradients alike. Labelled
        :data:`~megatron_lowprec.optim.statistics.GRAD_NORM_LABEL` for torch.profiler (``lowprec-train
        trainer.profile``, Megatron-LM's ``--use-pytorch-profiler``)."""
        return global_grad_norm(self.grads_for_norm(), self.get_grad_stats_parallel_group(), self.statistics_device)

    def clip_grad_norm(self, clip_grad: float) -> float:
        """Clipping by the global L2 norm (:meth:`get_grad_norm`), as megatron clips: every gradient
        times ``clip_grad / (norm + 1e-6)`` when that is below 1
        (:func:`~megatron_lowprec.optim.statistics.clip_grads_`)."""
        grad_norm = self.get_grad_norm()
        statistics.clip_grads_(self.grads_to_clip(), clip_grad, grad_norm)
        return grad_norm

    def update_quality(self) -> UpdateQuality:
        """EDQ and imprecision pieces of the last step for the whole model (``track_update_quality``):
        summed over the buckets and :meth:`update_quality_groups`
        (:func:`~megatron_lowprec.optim.statistics.summed_update_quality`), a
        tensor-parallel-replicated parameter counted once."""
        groups = self.update_quality_groups()

        def reduce(pieces: torch.Tensor) -> None:
            for group in groups:
                torch.distributed.all_reduce(pieces, group=group)

        return statistics.summed_update_quality(self.update_pieces(), self.statistics_device, reduce)


@dataclass(frozen=True)
class ShardPiece:
    """The part of one parameter that this rank updates: a contiguous run of its flattened elements."""

    param: torch.nn.Parameter
    group_index: int
    param_start: int
    """First element of the run in the parameter's flattened (local) tensor."""
    bucket_start: int
    """Position of that element in the megatron bucket's parameter and gradient buffers."""
    numel: int
    owned_start: int
    """Position of that element in this rank's owned range of the bucket."""


@dataclass
class Shard:
    """This rank's part of one megatron bucket: the owned range, its pieces, and their state in one
    optim bucket (:func:`~megatron_lowprec.megatron.layout.build_shard_bucket`: laid out in place in
    megatron's buffers, or packed)."""

    bucket: Any
    """megatron's ``_ParamAndGradBucket`` (``param_data`` and ``grad_data`` are bucket views)."""
    group: torch.distributed.ProcessGroup
    rank: int
    bounds: list[int]
    """Owned range of every data-parallel rank r: ``[bounds[r], bounds[r + 1])`` of the bucket."""
    pieces: list[ShardPiece]
    state_bucket: Bucket | None
    """The pieces' state (``None``: the range holds no parameter of the optimizer's groups), with the
    bucket's parameters and gradients read and written where they are in megatron's buffers."""
    grad: torch.Tensor | BufferRows | None
    """The state bucket's gradients, in ``grad_data``: its range, or its rows (packed)."""

    @property
    def megatron_shard_numel(self) -> int:
        return self.bucket.grad_data.numel() // len(self.bounds[1:])

    @property
    def start(self) -> int:
        return self.bounds[self.rank]

    @property
    def end(self) -> int:
        return self.bounds[self.rank + 1]

    def grads(self) -> list[torch.Tensor]:
        return [self.bucket.grad_data[p.bucket_start : p.bucket_start + p.numel] for p in self.pieces]

    def params(self) -> list[torch.Tensor]:
        return [self.bucket.param_data[p.bucket_start : p.bucket_start + p.numel] for p in self.pieces]


def skip_if_any_rank_non_finite(optimizer, grads: list[torch.Tensor], device: torch.device) -> bool:
    """Whether any rank of ``optimizer``'s grad-stats group holds inf/NaN in its ``grads`` (one
    all-reduce of a flag); counts the skipped step in the inner optimizer when so."""
    found_inf = non_finite_flag(grads, device)
    torch.distributed.all_reduce(found_inf, op=torch.distributed.ReduceOp.MAX, group=optimizer.get_grad_stats_parallel_group())
    if found_inf.item():
        optimizer.optimizer.skipped_steps += 1
        return True
    return False


class DistributedShards(Layout):
    """This rank's shards of megatron's DDP buffers as the layout an :class:`~megatron_lowprec.optim.AdamW`
    steps: per megatron bucket, the pieces of this rank's owned range (:func:`owned_bounds`) as the
    entries of one optim bucket (:func:`~megatron_lowprec.megatron.layout.build_shard_bucket`: laid out
    in place in megatron's buffers where its layout allows, else packed rows), each entry's state
    flat, with the entries of every parameter group, each taking its group's scalars; a
    tensor-parallel replica's update counts in the update quality on tensor-parallel rank 0 only.
    The gradients are read where DDP reduce-scattered them (:attr:`Shard.grad`)."""

    def __init__(self, buffers: list[Any]) -> None:
        self.buffers = buffers
        self.shards: list[Shard] = []
        self._shard_of: dict[int, Shard] = {}

    def build(
        self,
        strategy: PrecisionStrategy,
        param_groups: list[dict[str, Any]],
        streams: dict[torch.nn.Parameter, StreamLayout],
    ) -> list[tuple[Bucket, list[dict[str, Any]]]]:
        group_of = {param: index for index, group in enumerate(param_groups) for param in group["params"]}
        group_size = strategy.moment_codec.group_size
        self.shards = [
            self._build_shard(strategy, streams, buffer, bucket, group_of, group_size)
            for buffer in self.buffers for bucket in buffer.buckets
        ]
        built = []
        for shard in self.shards:
            state_bucket = shard.state_bucket
            if state_bucket is None:
                continue
            self._shard_of[id(state_bucket)] = shard
            states = [
                {"step": 0, **{
                    key: state_bucket.view(buffer, index, elements_per_value(key, strategy))
                    for key, buffer in state_bucket.state.items()
                }}
                for index in range(len(shard.pieces))
            ]
            built.append((state_bucket, states))
        return built

    def bucket_grads(self, bucket: Bucket) -> BucketGrads:
        shard = self._shard_of[id(bucket)]
        return shard.grad, shard.grads()

    @staticmethod
    def _build_shard(strategy, streams, buffer, bucket, group_of: dict[torch.nn.Parameter, int], group_size: int) -> Shard:
        range_type, distributed_optimizer = megatron_sharding_api()
        group = buffer.data_parallel_group
        world_size, rank = group.size(), group.rank()
        in_bucket = {
            param: (start - bucket.offset, end - bucket.offset)
            for param, (start, end, bucket_id) in buffer.param_index_map.items()
            if bucket_id == bucket.bucket_id
        }
        bounds = owned_bounds(bucket.grad_data.numel(), world_size, sorted(in_bucket.values()), group_size)
        ranges = distributed_optimizer._build_model_gbuf_param_range_map(
            {param: (*in_bucket[param], bucket.bucket_id) for param in in_bucket},
            range_type(bounds[rank], bounds[rank + 1]),
            0,
        )
        runs = [
            (param, param_ranges) for param, param_ranges in sorted(ranges.items(), key=lambda item: item[1]["gbuf_local"].start)
            if param in group_of
        ]
        pieces = [
            ShardPiece(
                param, group_of[param], param_ranges["param"].start, param_ranges["gbuf_world"].start,
                param_ranges["param"].size, param_ranges["gbuf_local"].start,
            )
            for param, param_ranges in runs
        ]
        if not pieces:
            return Shard(bucket, group, rank, bounds, pieces, None, None)
        state_bucket, grad = build_shard_bucket(
            strategy, [piece.param for piece in pieces], [(piece.param_start, piece.numel) for piece in pieces],
            [piece.bucket_start for piece in pieces], [piece.group_index for piece in pieces],
            [streams[piece.param] for piece in pieces], bucket.param_data, bucket.grad_data,
            bounds[rank], bounds[rank + 1],
        )
        state_bucket.entry_counted = [tensor_parallel.param_is_not_tensor_parallel_duplicate(piece.param) for piece in pieces]
        return Shard(bucket, group, rank, bounds, pieces, state_bucket, grad)


class DistributedLowPrecisionOptimizer(ExactGradientStatistics, MegatronOptimizer):
    """megatron-core's ``MegatronOptimizer`` interface around a precision-aware
    :class:`~megatron_lowprec.optim.AdamW` that steps this rank's shards (:class:`DistributedShards`)
    of DDP chunks built with ``use_distributed_optimizer=True`` (see the module docstring).

    A step: (the training loop's ``finish_grad_sync`` has reduce-scattered the gradients) FP8 group
    tails exchanged, a non-finite gradient on any rank skips the step everywhere, gradients clipped
    by their global norm, every owned piece updated, FP8 group tails handed back, and the
    parameters all-gathered (at once, or overlapped with the next forward pass when DDP's
    ``overlap_param_gather`` is set, as megatron does)."""

    def __init__(
        self, optimizer: AdamW, config: OptimizerConfig, model_chunks: list[torch.nn.Module], convert_checkpoint: bool = False,
        label: str | None = None,
    ) -> None:
        super().__init__(optimizer, config)
        self.convert_checkpoint = convert_checkpoint
        """:meth:`load_state_dict` converts a checkpoint of another option (:func:`convert_saved_otherwise_`)."""
        self.label = label
        """What the conversion's lines name this optimizer by in a chain (``AdamW``); ``None`` alone."""
        self.shards: list[Shard] = optimizer.layout.shards
        self.is_stub_optimizer = False
        self.model_chunks = model_chunks
        self.ddp_config = model_chunks[0].ddp_config
        self.grad_stats_parallel_group = parallel_state.get_intra_distributed_optimizer_instance_group()
        self._halo = [shard for shard in self.shards if any(b % shard.megatron_shard_numel for b in shard.bounds[:-1])]
        self._halo_exchange: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        return self.shards[0].bucket.grad_data.device

    @property
    def group_size(self) -> int:
        """Elements of the strategy's FP8 groups (1 without FP8 state)."""
        strategy = self.optimizer.strategy
        return strategy.moment_codec.group_size

    def state_buckets(self) -> list[Bucket]:
        """The state bucket of every shard that has one."""
        return [shard.state_bucket for shard in self.shards if shard.state_bucket is not None]

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds."""
        return sum(
            buffer.numel() * buffer.element_size() for state_bucket in self.state_buckets() for buffer in state_bucket.state.values()
        )

    def piece_state(self, piece: ShardPiece) -> dict[str, torch.Tensor]:
        """The piece's state: flat views of its state bucket's buffers."""
        return {key: value for key, value in self.optimizer.state[piece.param].items() if key != "step"}

    def common_step(self) -> int:
        """The step every owned piece is at (0 on a rank that owns none)."""
        return next((self.optimizer.state[piece.param]["step"] for shard in self.shards for piece in shard.pieces), 0)

    @property
    def statistics_device(self) -> torch.device:
        return self.device

    def get_loss_scale(self) -> torch.Tensor:
        return torch.ones(1, device=self.device)

    def reload_model_params(self, state_dict=None) -> None:
        """The FP32 masters (D, coat, D-BF16) restart from the model's parameters."""
        for state_bucket in self.state_buckets():
            stored = stored_master(state_bucket.state)
            if stored is not None:
                for index, param in enumerate(state_bucket.entry_params()):
                    reset_master_(param, state_bucket.view(stored, index))
                state_bucket.repeat_into_padding_()

    def release_grads(self) -> None:
        """Nothing to release: the step reads the gradients in DDP's buffer, no parameter gets a ``.grad``."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The gradients live in DDP's buffer (``zero_grad_buffer``); model ``.grad`` are released."""
        for param in self.get_parameters():
            param.grad = None

    def _owned_grads(self, for_norm: bool) -> list[torch.Tensor]:
        grads = []
        for shard in self.shards:
            for piece, grad in zip(shard.pieces, shard.grads()):
                param = piece.param
                if not for_norm or (param_is_not_shared(param) and tensor_parallel.param_is_not_tensor_parallel_duplicate(param)):
                    grads.append(grad)
        return grads

    def grads_for_norm(self) -> list[torch.Tensor]:
        return self._owned_grads(for_norm=True)

    def grads_to_clip(self) -> list[torch.Tensor]:
        return self._owned_grads(for_norm=False)

    def update_pieces(self) -> list[torch.Tensor]:
        """Per state bucket of the owned pieces (summed over the data-parallel ranks as well)."""
        return self.optimizer.bucket_update_pieces

    def update_quality_groups(self) -> list[torch.distributed.ProcessGroup]:
        return [
            parallel_state.get_model_parallel_group(),
            parallel_state.get_data_parallel_group(with_context_parallel=True),
        ]

    def _exchange_group_tails(self, grads: bool) -> None:
        """FP8 groups cut by a megatron shard boundary: before the step, every rank sends the
        reduced gradients of its shard's head (which the previous rank owns) to it; after the step,
        every rank sends the updated parameters past its shard's end (which it owns) to the next.
        One all-gather of ``group_size`` elements per bucket each way (FP32, exact for 16-bit), in
        place in one buffer of [ranks, buckets x group_size] that the first exchange allocates and
        every later one reuses: a step allocates nothing for it, so no temporary of the step outlives
        it while a gloo worker thread, which releases a finished collective's tensors after
        the caller has returned, still holds it. A receiver reads only the head's length of its
        sender's slot, so what earlier exchanges left beyond it is never read."""
        if not self._halo:
            return
        size = self.group_size
        group = self._halo[0].group
        if self._halo_exchange is None:
            self._halo_exchange = torch.zeros(group.size(), len(self._halo) * size, dtype=torch.float32, device=self.device)
        received = self._halo_exchange
        sending = received[group.rank()]
        for index, shard in enumerate(self._halo):
            edge, buffer = shard.megatron_shard_numel * shard.rank, shard.bucket.grad_data
            if grads:
                head = buffer[edge : shard.start]
            else:
                buffer = shard.bucket.param_data
                head = buffer[edge + shard.megatron_shard_numel : shard.end]
            sending[index * size : index * size + head.numel()] = head
        torch.distributed.all_gather_into_tensor(received.view(-1), sending, group=group)
        for index, shard in enumerate(self._halo):
            rank, numel = shard.rank, shard.megatron_shard_numel
            if grads and rank + 1 < group.size():
                tail = shard.bucket.grad_data[numel * (rank + 1) : shard.end]
                tail.copy_(received[rank + 1, index * size : index * size + tail.numel()])
            elif not grads and rank > 0:
                head = shard.bucket.param_data[numel * rank : shard.start]
                head.copy_(received[rank - 1, index * size : index * size + head.numel()])

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """Group tails exchanged; returns whether any rank found inf/NaN in its owned gradients."""
        self._exchange_group_tails(grads=True)
        return skip_if_any_rank_non_finite(self, self._owned_grads(for_norm=False), self.device)

    @torch.no_grad()
    def count_zeros(self) -> float:
        zeros = torch.zeros(1, dtype=torch.float64, device=self.device)
        for grad in self.grads_for_norm():
            zeros += grad.numel() - torch.count_nonzero(grad)
        torch.distributed.all_reduce(zeros, group=self.get_grad_stats_parallel_group())
        return zeros.item()

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        self.optimizer.step()
        self._exchange_group_tails(grads=False)
        if not self.ddp_config.overlap_param_gather:
            for chunk in self.model_chunks:
                chunk.start_param_sync()
        return True

    @torch.no_grad()
    def step(self):
        """Megatron's step: prepare (skip on inf/NaN), clip, count zeros, update, all-gather."""
        if self.prepare_grads():
            return False, None, None
        grad_norm = self.clip_grad_norm(self.config.clip_grad) if self.config.clip_grad > 0.0 else None
        zeros = self.count_zeros() if self.config.log_num_zeros_in_grad else None
        return self.step_with_ready_grads(), grad_norm, zeros

    def state_dict(self) -> dict[str, Any]:
        """The AdamW state dict, the plain optimizer's format: each owned piece's state (flat) under
        its parameter's index."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A per-rank :meth:`state_dict` (or one in the earlier per-shard format: :meth:`_load_per_shard`),
        or what ``dist_checkpointing.load`` returned for :meth:`sharded_state_dict`: where another option
        or megatron-core's own optimizer saved it (read with
        :func:`~megatron_lowprec.megatron.optimizer.saved_option_template`), converted into this option
        where :attr:`convert_checkpoint` is set (load the model first), one line per state kind over
        every data-parallel rank; else refused with ``ValueError`` in one line."""
        if "shards" in state_dict:
            self._load_per_shard(state_dict)
        elif STOCK_FORM_KEY in state_dict or "common_step" in state_dict.get("state", {}):
            report = convert_saved_otherwise_(
                state_dict, self.get_parameters(), self.optimizer.strategy, self.convert_checkpoint, self._own_common_state
            )
            if report is not None:
                owned = sum(piece.numel for shard in self.shards for piece in shard.pieces)
                group = parallel_state.get_data_parallel_group(with_context_parallel=True)
                say_conversion(agreed_over(report, owned, group).lines(), self.label)
            self._load_sharded(state_dict)
        else:
            self.optimizer.load_state_dict(state_dict)

    def _own_common_state(self) -> dict[str, Any]:
        """This optimizer's parameter groups (without their parameters) and ``lowprec`` section."""
        return {
            "param_groups": [{key: value for key, value in group.items() if key != "params"} for group in self.param_groups],
            "lowprec": self._lowprec_section(),
        }

    def _lowprec_section(self) -> dict[str, Any]:
        """The option, its 8-bit moments' storage, the skipped steps and the SR seed, as saved."""
        return {"option": self.optimizer.strategy.name, **exponent_storage_record(self.optimizer.strategy),
                "skipped_steps": self.optimizer.skipped_steps, "seed": self.optimizer.seed, "generator_state": None}

    def _load_per_shard(self, state_dict: dict[str, Any]) -> None:
        """Restore a per-rank state dict in the per-shard format (each shard's state bucket's
        buffers under ``shards``, the step under ``lowprec``) of the same option, layout and
        data-parallel rank; a mismatch raises ``ValueError`` before anything changes."""
        extra = state_dict.get("lowprec", {})
        strategy = self.optimizer.strategy
        if extra.get("option") != strategy.name:
            raise ValueError(f"state dict was saved for option {extra.get('option')!r}, this optimizer runs {strategy.name!r}")
        check_exponent_storage(extra, strategy, EXPONENT_STORAGE_REMEDY)
        if extra.get("bounds") != [shard.bounds for shard in self.shards]:
            raise ValueError("state dict was saved with another bucket layout or data-parallel size; "
                             "reshard it through sharded_state_dict (dist_checkpointing)")
        if [saved is None for saved in state_dict["shards"]] != [shard.state_bucket is None for shard in self.shards]:
            raise ValueError("state dict was saved with another shard layout; reshard it through sharded_state_dict (dist_checkpointing)")
        pairs = [(saved, shard.state_bucket) for saved, shard in zip(state_dict["shards"], self.shards) if shard.state_bucket]
        for saved, state_bucket in pairs:
            for key, buffer in state_bucket.state.items():
                if key not in saved or saved[key].shape != buffer.shape or saved[key].dtype != buffer.dtype:
                    raise ValueError(f"state {key!r} of a shard does not match: expected {buffer.dtype}{tuple(buffer.shape)}")
        for saved_group, group in zip(state_dict["param_groups"], self.param_groups):
            group.update({key: value for key, value in saved_group.items() if key != "params"})
        for saved, state_bucket in pairs:
            for key, buffer in state_bucket.state.items():
                buffer.copy_(saved[key])
            state_bucket.repeat_into_padding_()
        self._set_steps(extra["step"])
        self.optimizer.skipped_steps = extra["skipped_steps"]
        self.optimizer.seed = extra["seed"]

    def _set_steps(self, step: int) -> None:
        for shard in self.shards:
            for piece in shard.pieces:
                self.optimizer.state[piece.param]["step"] = step

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, metadata: dict | None = None):
        """The optimizer state in model space for ``dist_checkpointing``: every state of a
        parameter as one tensor of the parameter's shape (FP8 states per element,
        :func:`checkpoint_state`), under the keys the unsharded hook saves, so that either
        optimizer loads the other's checkpoints at any data-parallel size and TP/PP layout.

        Saving gathers each bucket's state over the data-parallel ranks one bucket and one state at
        a time (megatron-core 0.16 no longer saves flattened ranges) and keeps each parameter's
        state on the rank that owns its first element, which writes it: a rank holds about its
        share plus one bucket's worth. Loading reads, on each rank, the whole state of every
        parameter it owns a piece of; ``load_state_dict`` takes the loaded result."""
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject
        from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

        model_tensors = {
            id(tensor.data): tensor for tensor in nested_values(extract_sharded_tensors_and_factories(model_sharded_state_dict)[0])
        }
        param_ids = {param: index for index, param in enumerate(self.get_parameters())}
        state: dict[Any, Any] = {}
        for shard in self.shards:
            tensors = self._loading_tensors(shard) if is_loading else self._gathered_tensors(shard)
            first_owned = {piece.param for piece in shard.pieces if piece.param_start == 0}
            for param, entry in tensors.items():
                replica = 0 if param in first_owned else shard.rank
                model_tensor = model_tensors.get(id(param))
                if model_tensor is None:
                    raise ValueError(f"a parameter of shape {tuple(param.shape)} is not in the model's sharded state dict")
                state[param_ids[param]] = {
                    key: dataclasses.replace(
                        model_tensor, key=f"optimizer.state.{key}.{model_tensor.key}", data=value, dtype=value.dtype,
                        replica_id=(*model_tensor.replica_id[:2], replica),
                    )
                    for key, value in entry.items()
                }
        state["common_step"] = self.common_step()
        groups = []
        for group in self.param_groups:
            saved = {key: value for key, value in group.items() if key != "params"}
            saved["params"] = LocalNonpersistentObject([param_ids[param] for param in group["params"]])
            groups.append(saved)
        return {
            "state": state,
            "param_groups": groups,
            "lowprec": self._lowprec_section(),
        }

    def _loading_tensors(self, shard: Shard) -> dict[torch.nn.Parameter, dict[str, torch.Tensor]]:
        """Empty parameter-shaped checkpoint-form tensors for every parameter with a piece here."""
        tensors = {}
        for piece in shard.pieces:
            param = piece.param
            form = checkpoint_state(self.piece_state(piece), 1, self.optimizer.strategy, is_loading=True)
            tensors[param] = {
                key: torch.empty(param.shape, dtype=value.dtype, device=value.device) for key, value in form.items()
            }
        return tensors

    def _gathered_tensors(self, shard: Shard) -> dict[torch.nn.Parameter, dict[str, torch.Tensor]]:
        """The whole checkpoint-form state of each parameter whose first element this rank owns."""
        strategy = self.optimizer.strategy
        owned_numel = shard.end - shard.start
        local = {
            key: torch.zeros(owned_numel, dtype=dtype, device=self.device)
            for key, dtype in checkpoint_dtypes(strategy, shard.bucket.param_data.dtype).items()
        }
        params = shard.params()
        for piece, param in zip(shard.pieces, params):
            form = checkpoint_state(self.piece_state(piece), piece.numel, strategy, param=param)
            for key, value in form.items():
                local[key][piece.owned_start : piece.owned_start + piece.numel] = value
        written = [piece for piece in shard.pieces if piece.param_start == 0]
        tensors: dict[torch.nn.Parameter, dict[str, torch.Tensor]] = {piece.param: {} for piece in written}
        world_size = len(shard.bounds) - 1
        longest = max(shard.bounds[r + 1] - shard.bounds[r] for r in range(world_size))
        for key in sorted(local):
            sending = torch.zeros(longest, dtype=local[key].dtype, device=self.device)
            sending[:owned_numel] = local[key]
            received = torch.empty(world_size * longest, dtype=sending.dtype, device=self.device)
            torch.distributed.all_gather_into_tensor(received, sending, group=shard.group)
            rows = received.view(world_size, longest)
            bucket = torch.cat([rows[r, : shard.bounds[r + 1] - shard.bounds[r]] for r in range(world_size)])
            for piece in written:
                numel = piece.param.numel()
                tensors[piece.param][key] = bucket[piece.bucket_start : piece.bucket_start + numel].clone().view(piece.param.shape)
        return tensors

    def _load_sharded(self, loaded: dict[str, Any]) -> None:
        """Copy what ``dist_checkpointing.load`` returned for :meth:`sharded_state_dict` into the shards."""
        extra = loaded["lowprec"]
        param_ids = {param: index for index, param in enumerate(self.get_parameters())}
        for shard in self.shards:
            for piece, param in zip(shard.pieces, shard.params()):
                whole = loaded["state"][param_ids[piece.param]]
                run = {key: value.reshape(-1)[piece.param_start : piece.param_start + piece.numel] for key, value in whole.items()}
                restore_checkpoint_state(
                    self.piece_state(piece), run, piece.numel, self.optimizer.strategy, param=param
                )
            if shard.state_bucket is not None:
                shard.state_bucket.repeat_into_padding_()
        for saved, group in zip(loaded["param_groups"], self.param_groups):
            group.update({key: value for key, value in saved.items() if key != "params"})
        self._set_steps(loaded["state"]["common_step"])
        self.optimizer.skipped_steps = extra["skipped_steps"]
        self.optimizer.seed = extra["seed"]
        self._sync_params()

    def _sync_params(self) -> None:
        """All-gather the parameters from their owners now, as after a step: a loaded state may
        rewrite the owned parameters (a remainder master's upper halves, the parameter of an MCF
        pair or a converted checkpoint's masters rounded into this option's parameter), which every
        replica must see before the next forward pass."""
        self._exchange_group_tails(grads=False)
        for chunk in self.model_chunks:
            chunk.start_param_sync(force_sync=True)


def build_distributed_optimizer(
    strategy: PrecisionStrategy,
    model_chunks: list[torch.nn.Module],
    config: OptimizerConfig,
    groups: list[dict[str, Any]],
    *,
    seed: int,
    fused: bool | None,
    track_update_quality: bool,
    stream_layouts: dict[torch.nn.Parameter, StreamLayout],
    background_compile: bool = False,
    convert_checkpoint: bool = False,
    label: str | None = None,
    buffers: list[Any] | None = None,
) -> DistributedLowPrecisionOptimizer:
    """Checks that the chunks are megatron DDP with the distributed optimizer, then builds it over
    ``buffers`` (default: every buffer of the chunks); ``convert_checkpoint`` and ``label``:
    :class:`DistributedLowPrecisionOptimizer`'s."""
    megatron_sharding_api()
    for index, chunk in enumerate(model_chunks):
        ddp_config = getattr(chunk, "ddp_config", None)
        if ddp_config is None or not ddp_config.use_distributed_optimizer:
            raise ValueError(
                f"use_distributed_optimizer=True: model chunk {index} must be megatron's DistributedDataParallel "
                "built with DistributedDataParallelConfig(use_distributed_optimizer=True)"
            )
        if ddp_config.num_distributed_optimizer_instances != 1 or getattr(ddp_config, "use_megatron_fsdp", False):
            raise ValueError(
                "use_distributed_optimizer=True with the precision options needs num_distributed_optimizer_instances=1 "
                "and use_megatron_fsdp=False"
            )
        if chunk.expert_parallel_buffers:
            raise ValueError("use_distributed_optimizer=True with the precision options does not shard expert-parallel parameters")
    if buffers is None:
        buffers = [buffer for chunk in model_chunks for buffer in chunk.buffers]
    adamw = AdamW(
        groups, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps, weight_decay=config.weight_decay,
        option=strategy, seed=seed, fused=fused, background_compile=background_compile,
        track_update_quality=track_update_quality, check_grads_finite=False, stream_layout=stream_layouts.__getitem__,
        layout=DistributedShards(buffers),
    )
    return DistributedLowPrecisionOptimizer(adamw, config, model_chunks, convert_checkpoint, label)
