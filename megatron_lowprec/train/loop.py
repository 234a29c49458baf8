"""The training run: distributed setup, model, optimizer hook, data, the loop, evaluation, summary.

Megatron-LM's ``pretrain`` flow on megatron-core: ``parallel_state`` with TP x PP and the rest data
parallel, a BF16 ``GPTModel`` in ``Float16Module`` wrapped by megatron's
``DistributedDataParallel``, ``get_forward_backward_func()`` over the micro-batches of a global
batch (gradient accumulation; 1F1B across pipeline stages), ``finalize_model_grads`` for the
data-parallel reduction, the precision option as a ``MegatronOptimizer``
(:func:`megatron_lowprec.megatron.optimizer.build_optimizer`; megatron-core's own
``get_megatron_optimizer`` with ``precision.megatron_optimizer``, the stock baseline) and megatron's
``OptimizerParamScheduler`` (warmup, then cosine decay). Without CUDA the CPU bridge is active and
the backend is gloo.

SIGTERM or ``trainer.exit_signal`` on any rank stops every rank after the same step with a
checkpoint (:mod:`megatron_lowprec.train.signals`); Ctrl-C raises :class:`Interrupted`, which says
where the run stopped and which checkpoint a rerun resumes from. A loss or gradient norm that is not
finite for ``trainer.max_nonfinite_steps`` steps in a row raises :class:`Diverged`; no checkpoint is
saved after a step whose loss or gradient norm is not finite, so the last one saved is a good one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import os
import random
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import numpy
import torch

from megatron_lowprec.megatron.exit_signals import start_writer_service
from megatron_lowprec.train import checkpoint, profiling
from megatron_lowprec.train.config import (
    ConfigError, TrainConfig, data_parallel_size, precision_strategy, reduces_grads_in_fp32,
)
from megatron_lowprec.train.config import OptimizerConfig as AppOptimizerConfig
from megatron_lowprec.train.data import TrainingData, batches, build_training_data
from megatron_lowprec.train.determinism import enable_determinism
from megatron_lowprec.train.metrics import MetricsLogger, finite_record
from megatron_lowprec.train.model import gpt_model, padded_vocab_size
from megatron_lowprec.train.signals import ExitSignals, end_with_launcher


DIVERGED_EXIT_CODE = 3
"""Exit status of a run stopped by :class:`Diverged`."""

MEGATRON_OPTIMIZER_FIELDS = ("lr", "min_lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad")
"""Fields of the app's optimizer config that megatron's ``OptimizerConfig`` has under the same name."""
MEGATRON_MUON_FIELDS = (
    "muon_momentum", "muon_use_nesterov", "muon_num_ns_steps", "muon_scale_mode", "muon_extra_scale_factor",
    "muon_split_qkv", "muon_tp_mode",
)
"""The same for Muon's (``optimizer.name=muon``; ``muon_use_nesterov`` is ``muon_nesterov`` from megatron-core 0.19;
``muon_coefficient_type`` is set on the config apart, a field only from 0.17)."""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def distributed_environment(config: TrainConfig) -> Iterator[None]:
    """Process group (NCCL on GPUs, gloo with the CPU bridge otherwise) and megatron's parallel state.

    A plain ``lowprec-train`` (no torchrun) is a world of one. A process group that already exists
    (a trainer embedding this loop) is used as it is and left open.
    """
    from megatron.core import parallel_state

    from megatron_lowprec.megatron.cpu import cpu_bridge

    if "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    if config.trainer.deterministic:
        enable_determinism()
    with cpu_bridge(), contextlib.ExitStack() as cleanup:
        if not torch.distributed.is_initialized():
            cuda = torch.cuda.is_available()
            if cuda:
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            torch.distributed.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(minutes=10))
            cleanup.callback(torch.distributed.destroy_process_group)
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=config.trainer.tensor_model_parallel_size,
            pipeline_model_parallel_size=config.trainer.pipeline_model_parallel_size,
        )
        cleanup.callback(parallel_state.destroy_model_parallel)
        yield


def seed_everything(seed: int) -> None:
    """Megatron's ``_set_random_seed``: one seed per pipeline stage, megatron's RNG tracker streams."""
    from megatron.core import parallel_state, tensor_parallel

    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def _run_dir(config: TrainConfig) -> Path:
    """``config.run_dir``, or a fresh ``runs/<time>-<model>-<option>`` chosen by rank 0 for all."""
    chosen = [config.run_dir]
    if chosen[0] is None and torch.distributed.get_rank() == 0:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        chosen[0] = f"runs/{stamp}-{config.model.name}-{config.precision.option}"
    torch.distributed.broadcast_object_list(chosen, src=0)
    return Path(chosen[0]).absolute()


class Diverged(Exception):
    """The loss or the gradient norm was NaN or infinite for ``trainer.max_nonfinite_steps`` steps in a row."""

    def __init__(self, run_dir: Path, steps: list[int], record: dict) -> None:
        super().__init__(f"diverged at step {steps[-1]} in {run_dir}")
        self.run_dir, self.steps, self.record = run_dir, steps, record

    def report(self) -> str:
        """One line: the steps, the last values, and the checkpoint a rerun resumes from."""
        path = checkpoint.latest_checkpoint(self.run_dir)
        kept = f"the last good checkpoint is {path}" if path is not None else "no checkpoint was saved"
        grad_norm = "" if self.record["grad_norm"] is None else f", grad norm {self.record['grad_norm']:g}"
        return (
            f"diverged: the loss or the gradient norm was not finite for {len(self.steps)} steps in a row "
            f"(steps {self.steps[0]}-{self.steps[-1]}; last: loss {self.record['loss']:g}{grad_norm}); stopped "
            f"without saving them; {kept} (a lower optimizer.lr, or trainer.max_nonfinite_steps=0 to train on)"
        )


class Interrupted(Exception):
    """Ctrl-C (``KeyboardInterrupt``) during a run: the step it reached and where a rerun resumes."""

    def __init__(self, run_dir: Path, step: int | None, max_steps: int) -> None:
        super().__init__(f"interrupted at step {step} in {run_dir}")
        self.run_dir, self.step, self.max_steps = run_dir, step, max_steps

    def report(self) -> str:
        """One line: the step reached, and the checkpoint a rerun with this run directory resumes from."""
        reached = "during start-up" if self.step is None else f"after step {self.step}/{self.max_steps}"
        path = checkpoint.latest_checkpoint(self.run_dir)
        if path is None:
            resume = f"no checkpoint in {self.run_dir} yet, so a rerun starts from scratch"
        else:
            resume = f"a rerun with run_dir={self.run_dir} resumes from {path}"
        return f"interrupted {reached}; {resume}"


@dataclasses.dataclass
class Run:
    """What the loop works with."""

    config: TrainConfig
    run_dir: Path
    data: TrainingData
    model: torch.nn.Module
    optimizer: object
    scheduler: object
    num_microbatches: int
    iteration: int = 0


def megatron_optimizer_config(optim: AppOptimizerConfig):
    """megatron's ``OptimizerConfig`` for the app's ``optimizer`` settings: Adam, or Muon with its
    ``muon_*`` settings; ``use_distributed_optimizer`` is megatron's distributed optimizer for Adam and its
    layer-wise distributed optimizer for Muon (:func:`~megatron_lowprec.megatron.compat.layer_wise_fields`)."""
    from megatron.core.optimizer import OptimizerConfig

    from megatron_lowprec.megatron import compat

    fields = {name: getattr(optim, name) for name in MEGATRON_OPTIMIZER_FIELDS}
    if optim.name != "muon":
        return OptimizerConfig(optimizer="adam", bf16=True, params_dtype=torch.bfloat16, use_distributed_optimizer=optim.use_distributed_optimizer, **fields)
    muon = {name: getattr(optim, name) for name in MEGATRON_MUON_FIELDS}
    muon[compat.muon_nesterov_field()] = muon.pop("muon_use_nesterov")
    config = OptimizerConfig(
        **{"optimizer": "muon", "bf16": True, "params_dtype": torch.bfloat16, **fields, **muon,
           **(compat.layer_wise_fields() if optim.use_distributed_optimizer else {})}
    )
    config.muon_coefficient_type = optim.muon_coefficient_type  # a config field from megatron-core 0.17, read where present
    return config


def build_run(config: TrainConfig, run_dir: Path) -> Run:
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_lowprec.megatron.option_check import optimizer_in_use
    from megatron_lowprec.megatron.optimizer import build_optimizer

    trainer, optim = config.trainer, config.optimizer
    strategy = precision_strategy(config.precision)
    data = build_training_data(config)
    if config.model.vocab_size is not None and config.model.vocab_size < data.tokenizer.vocab_size:
        raise ConfigError(
            f"model.vocab_size={config.model.vocab_size} is below the tokenizer's {data.tokenizer.vocab_size} tokens; "
            f"set model.vocab_size >= {data.tokenizer.vocab_size}, or null for the tokenizer's"
        )
    vocab_size = padded_vocab_size(
        config.model.vocab_size or data.tokenizer.vocab_size,
        config.model.make_vocab_size_divisible_by,
        trainer.tensor_model_parallel_size,
    )
    seed_everything(trainer.seed)
    module = gpt_model(
        config,
        vocab_size,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )
    optimizer_config = megatron_optimizer_config(optim)
    model = DistributedDataParallel(
        config=module.config,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=reduces_grads_in_fp32(config.precision),
            use_distributed_optimizer=optimizer_config.use_distributed_optimizer,
        ),
        module=module,
    )
    if config.precision.megatron_optimizer:
        optimizer = get_megatron_optimizer(optimizer_config, [model])
    else:
        optimizer = build_optimizer(
            strategy.name,
            [model],
            optimizer_config,
            seed=trainer.seed,
            shared_randomness=config.precision.shared_randomness,
            fused=config.precision.fused,
            background_compile=config.precision.background_compile,
            track_update_quality=config.precision.track_update_quality,
            master_storage=config.precision.master_storage,
            moment_storage=config.precision.moment_storage,
        )
        optimizer_in_use(optimizer, [model], strategy.name, asked_by="precision.option", path="lowprec-train's build_run",
                         remedy="build_optimizer left them to another optimizer: report this line", error=ConfigError)
    module.config.finalize_model_grads_func = finalize_model_grads
    module.config.grad_scale_func = optimizer.scale_loss
    decay_steps = optim.lr_decay_steps or max(trainer.max_steps, 1)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=optim.lr,
        min_lr=optim.min_lr,
        lr_warmup_steps=min(optim.lr_warmup_steps, decay_steps - 1),
        lr_decay_steps=decay_steps,
        lr_decay_style=optim.lr_decay_style,
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=optim.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=optim.override_opt_param_scheduler,
    )
    dp = data_parallel_size(config, torch.distributed.get_world_size())
    return Run(config, run_dir, data, model, optimizer, scheduler, trainer.global_batch_size // (trainer.micro_batch_size * dp))


def _forward_step(data_iterator, model):
    """Megatron's GPT forward step: the loss is the mean over the tokens the loss mask keeps."""
    batch = next(data_iterator)
    per_token_loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    def loss_func(output: torch.Tensor):
        mask = batch["loss_mask"].float()
        loss = (output.float() * mask).sum() / mask.sum()
        return loss, {"lm loss": loss.detach().clone()}

    return per_token_loss, loss_func


def _mean_loss(losses: list[dict]) -> float:
    """Mean loss of the micro-batches over the data-parallel ranks, seen by every rank.

    Only the last pipeline stage computes losses; the first tensor-parallel rank of each
    last-stage replica contributes its sum, the others contribute zero.
    """
    from megatron.core import parallel_state

    contributes = parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0
    totals = torch.zeros(2, dtype=torch.float64, device=torch.cuda.current_device())
    if contributes:
        totals[0] = sum(float(entry["lm loss"]) for entry in losses)
        totals[1] = len(losses)
    torch.distributed.all_reduce(totals)
    return float(totals[0] / totals[1])


def _forward_backward(run: Run, step_batches, forward_only: bool) -> float:
    """The micro-batches of one step through megatron's schedule; the FP8 linears quantize each
    weight once for all of them (``fp8_weight_cache``)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_lowprec.layers import fp8_weight_cache

    with fp8_weight_cache():
        losses = get_forward_backward_func()(
            forward_step_func=_forward_step,
            data_iterator=iter(step_batches),
            model=[run.model],
            num_microbatches=len(step_batches),
            seq_length=run.config.model.seq_length,
            micro_batch_size=run.config.trainer.micro_batch_size,
            forward_only=forward_only,
        )
    return _mean_loss(losses)


def train_step(run: Run) -> dict:
    """One optimizer step over a global batch; the loss, LR, grad norm and update quality."""
    run.model.zero_grad_buffer()
    run.optimizer.zero_grad()
    step_batches = batches(run.data.train, run.config, run.iteration * run.config.trainer.global_batch_size, run.num_microbatches)
    with torch.profiler.record_function(profiling.FORWARD_BACKWARD):
        loss = _forward_backward(run, step_batches, forward_only=False)
    with torch.profiler.record_function(profiling.OPTIMIZER_STEP):
        success, grad_norm, _ = run.optimizer.step()
    record = {"loss": loss, "lr": run.optimizer.param_groups[0]["lr"], "grad_norm": grad_norm, "skipped": not success}
    if success:
        run.scheduler.step(increment=1)
        if run.config.precision.track_update_quality:
            with torch.profiler.record_function(profiling.UPDATE_QUALITY):
                quality = run.optimizer.update_quality()
            record.update(edq=quality.edq, imprecision_percent=quality.imprecision_percent)
    run.iteration += 1
    return record


@torch.no_grad()
def evaluate(run: Run) -> float:
    """Mean validation loss over the first ``eval_iters`` global batches of the validation split."""
    run.model.eval()
    try:
        per_batch = run.config.trainer.global_batch_size
        losses = [
            _forward_backward(run, batches(run.data.valid, run.config, index * per_batch, run.num_microbatches), forward_only=True)
            for index in range(run.config.trainer.eval_iters)
        ]
    finally:
        run.model.train()
    return sum(losses) / len(losses)


def _last_token_forward_step(captured: list[tuple[torch.Tensor, torch.Tensor]]):
    """A forward step that keeps the last position's full-vocabulary logits and its target."""
    from megatron.core import tensor_parallel

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        logits = model(batch["tokens"], batch["position_ids"], None)

        def keep_last_token(output: torch.Tensor):
            last = tensor_parallel.gather_from_tensor_model_parallel_region(output[:, -1, :].contiguous())
            captured.append((last.float(), batch["labels"][:, -1]))
            return output.new_zeros((), dtype=torch.float32), {}

        return logits, keep_last_token

    return forward_step


@torch.no_grad()
def evaluate_sharpness(run: Run) -> float:
    """Mean last-token sharpness (``metrics.last_token_sharpness``) over the first
    ``trainer.sharpness_sequences`` validation sequences of data-parallel rank 0, computed where the
    logits are (the last pipeline stage; its tensor-parallel shards gathered) and shared with all."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_lowprec.metrics import last_token_sharpness

    trainer = run.config.trainer
    captured: list[tuple[torch.Tensor, torch.Tensor]] = []
    microbatches = -(-trainer.sharpness_sequences // trainer.micro_batch_size)
    run.model.eval()
    try:
        get_forward_backward_func()(
            forward_step_func=_last_token_forward_step(captured),
            data_iterator=iter(batches(run.data.valid, run.config, 0, microbatches)),
            model=[run.model],
            num_microbatches=microbatches,
            seq_length=run.config.model.seq_length,
            micro_batch_size=trainer.micro_batch_size,
            forward_only=True,
        )
    finally:
        run.model.train()
    value = torch.zeros(1, dtype=torch.float64, device=torch.cuda.current_device())
    computes = (
        parallel_state.is_pipeline_last_stage()
        and parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_data_parallel_rank() == 0
    )
    if computes:
        logits = torch.cat([logits for logits, _ in captured])[: trainer.sharpness_sequences]
        targets = torch.cat([targets for _, targets in captured])[: trainer.sharpness_sequences]
        value[0] = last_token_sharpness(logits, targets, trainer.sharpness_eps)
    torch.distributed.all_reduce(value)
    return float(value[0])


def train(config: TrainConfig) -> dict:
    """Run the training of ``config``; returns the summary (saved by rank 0 as ``summary.json``): its
    ``status`` is ``finished``, or ``stopped by <signal>`` when an exit signal stopped it (with
    ``stopped_by``, ``steps``, ``checkpoint``). Ctrl-C raises :class:`Interrupted`; a checkpoint that
    cannot be resumed ``checkpoint.ResumeError``, one that cannot be written ``checkpoint.SaveError``;
    a diverged run :class:`Diverged` (after saving the summary, status ``diverged``); a run
    directory another job holds, or a vocabulary below the tokenizer's, ``ConfigError``."""
    end_with_launcher(launched="TORCHELASTIC_RUN_ID" in os.environ)
    with distributed_environment(config):
        run_dir = _run_dir(config)
        with checkpoint.run_dir_lock(run_dir):
            return _train_in(config, run_dir)


def _train_in(config: TrainConfig, run_dir: Path) -> dict:
    """:func:`train` in the locked ``run_dir``."""
    try:
        run = build_run(config, run_dir)
        resumed = checkpoint.resume_if_present(run)
        logger = MetricsLogger(config, run_dir, run, resumed_from=resumed)
    except KeyboardInterrupt:
        raise Interrupted(run_dir, None, config.trainer.max_steps) from None
    try:
        with ExitSignals(config.trainer.exit_signal) as exit_signals:
            if config.trainer.save:
                start_writer_service(exit_signals.signals)
            return _train_loop(run, logger, exit_signals, resumed)
    except KeyboardInterrupt:
        logger.close(exit_code=130)
        raise Interrupted(run_dir, run.iteration, config.trainer.max_steps) from None


def _train_loop(run: Run, logger: MetricsLogger, exit_signals: ExitSignals, resumed: int | None) -> dict:
    """:func:`_train_steps` under ``trainer.profile``'s profiler (``train/profiling.py``)."""
    trainer = run.config.trainer
    profiler = profiling.StepProfiler(
        trainer.profile, trainer.profile_step_start, trainer.profile_step_end, list(trainer.profile_ranks),
        torch.distributed.get_rank(), run.run_dir,
    )
    try:
        return _train_steps(run, logger, exit_signals, resumed, profiler)
    finally:
        profiler.close()


def _train_steps(
    run: Run, logger: MetricsLogger, exit_signals: ExitSignals, resumed: int | None, profiler: profiling.StepProfiler
) -> dict:
    """Steps until ``trainer.max_steps`` (then evaluation, the last checkpoint and the summary) or until
    an exit signal (then a checkpoint and one line)."""
    config, trainer = run.config, run.config.trainer
    tokens_per_step = trainer.global_batch_size * config.model.seq_length
    interval: list[dict] = []
    step_seconds: list[float] = []
    saved_at = None
    nonfinite_steps: list[int] = []
    while run.iteration < trainer.max_steps:
        profiler.before_step(run.iteration)
        started = time.perf_counter()
        interval.append(train_step(run))
        step_seconds.append(time.perf_counter() - started)
        profiler.after_step(run.iteration)
        nonfinite_steps = [] if finite_record(interval[-1]) else [*nonfinite_steps, run.iteration]
        diverged = trainer.max_nonfinite_steps and len(nonfinite_steps) >= trainer.max_nonfinite_steps
        stop_signal = exit_signals.received()
        if run.iteration % trainer.log_interval == 0 or run.iteration == trainer.max_steps or stop_signal or diverged:
            logger.train(run.iteration, interval, tokens_per_step * len(interval) / sum(step_seconds[-len(interval):]))
            record, interval = interval[-1], []
        if diverged:
            logger.diverged(nonfinite_steps, record, tokens_per_step * len(step_seconds) / sum(step_seconds))
            logger.close(exit_code=DIVERGED_EXIT_CODE)
            raise Diverged(run.run_dir, nonfinite_steps, record)
        if stop_signal:
            if trainer.save and saved_at != run.iteration and not nonfinite_steps:
                checkpoint.save(run)
                saved_at = run.iteration
            saved = checkpoint.checkpoint_path(run.run_dir, run.iteration) if saved_at == run.iteration else None
            return logger.stop(stop_signal, saved, tokens_per_step * len(step_seconds) / sum(step_seconds))
        if run.iteration % trainer.eval_interval == 0 and run.iteration < trainer.max_steps:
            logger.valid(run.iteration, evaluate(run))
        if trainer.sharpness_interval and run.iteration % trainer.sharpness_interval == 0:
            logger.sharpness(run.iteration, evaluate_sharpness(run))
        if trainer.save and trainer.save_interval and run.iteration % trainer.save_interval == 0 and not nonfinite_steps:
            checkpoint.save(run)
            saved_at = run.iteration
    valid_loss = evaluate(run)
    logger.valid(run.iteration, valid_loss)
    if trainer.save and saved_at != run.iteration and (step_seconds or resumed is None) and not nonfinite_steps:
        checkpoint.save(run)
    tokens_per_second = tokens_per_step * len(step_seconds) / sum(step_seconds) if step_seconds else math.nan
    return logger.finish(valid_loss, tokens_per_second)
