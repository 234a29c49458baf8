"""Rank 0's record of a run: one console line per interval, ``metrics.jsonl``, wandb, the summary.

Every line of ``metrics.jsonl`` is one JSON object with ``step``, ``split`` (``train``, ``valid``
or ``sharpness``) and ``option``. Train lines hold ``loss``, ``lr``, ``grad_norm``,
``tokens_per_second`` (over the training steps alone: evaluation and checkpoints are not counted),
``tflops_per_gpu`` (model FLOPs, :mod:`megatron_lowprec.train.throughput`; per process on CPUs, where
the console says ``TFLOP/s/process``), ``mfu`` (on GPUs whose
BF16 peak is known), the peak memory so far (``peak_allocated_gib`` and ``peak_reserved_gib`` on
GPUs, ``peak_rss_gib`` on CPUs; the largest rank's), ``skipped_steps`` and, with
``precision.track_update_quality``, ``edq`` and ``imprecision_percent`` (means over the interval);
valid lines hold ``loss`` and ``perplexity``; sharpness lines hold ``sharpness`` and its box
half-width ``eps``. The option is ``megatron`` for megatron-core's own optimizer. The file and
``summary.json`` are strict JSON: a value that is NaN or infinite is written as ``null``. The summary's
``status`` says how the run ended: ``finished`` (``trainer.max_steps`` reached), ``stopped by SIGTERM``
(or the ``trainer.exit_signal``; with the checkpoint it saved) or ``diverged`` (with the last finite
step, the steps that were not finite and their last values); a run removes an earlier run's summary
as it starts, and Ctrl-C writes none. A resumed
run first drops the rows after the step it resumes from (a run started over in the same directory,
``resume=false``, all of them), so the file holds one row per step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import uuid
from pathlib import Path
from statistics import fmean

import torch

from megatron_lowprec.train import throughput
from megatron_lowprec.train.config import (
    ConfigError, TrainConfig, data_parallel_size, option_label, precision_strategy, reduces_grads_in_fp32, to_yaml,
)
from megatron_lowprec.train.model import attention_backend, padded_vocab_size

SUMMARY_FILE = "summary.json"
FINISHED = "finished"
"""The summary's ``status`` of a run that reached ``trainer.max_steps``."""
DIVERGED = "diverged"
"""The summary's ``status`` of a run stopped by ``trainer.max_nonfinite_steps`` non-finite steps in a row."""


def strict_json(value):
    """``value`` with every float that is NaN or infinite replaced by None, so that ``json.dumps``
    writes strict JSON (Python's default writes ``NaN`` and ``Infinity``, which JSON does not have)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(item) for item in value]
    return value


def finite_record(record: dict) -> bool:
    """A step's loss and gradient norm (where the optimizer reports one) are finite."""
    return math.isfinite(record["loss"]) and (record["grad_norm"] is None or math.isfinite(record["grad_norm"]))


def _write_atomically(path: Path, text: str) -> None:
    """Write ``text`` beside ``path`` and rename it over ``path``: a reader sees the old file or the new one."""
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, path)


def _keep_rows_up_to(path: Path, step: int) -> None:
    """Drop the rows of ``path`` after ``step``: a run resumed from the checkpoint of ``step`` (or
    started over, ``step`` 0) redoes those steps and writes their rows again."""
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
    if len(kept) == len(lines):
        return
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text("".join(kept), encoding="utf-8")
    os.replace(temporary, path)


def _mean(records: list[dict], key: str) -> float | None:
    values = [record[key] for record in records if record.get(key) is not None]
    return fmean(values) if values else None


def _open_wandb(config: TrainConfig, run_dir: Path):
    """An offline (unless ``WANDB_MODE`` says otherwise) wandb run in ``run_dir``, resumed with the run."""
    try:
        import wandb
    except ImportError:
        raise ConfigError(
            "logging.wandb=true needs wandb: pip install 'megatron-lowprec[train]', or set logging.wandb=false"
        ) from None
    id_file = run_dir / "wandb_id.txt"
    run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
    id_file.write_text(run_id)
    return wandb.init(
        project=config.logging.wandb_project,
        name=run_dir.name,
        id=run_id,
        resume="allow",
        dir=str(run_dir),
        mode=os.environ.get("WANDB_MODE", config.logging.wandb_mode),
        config=dataclasses.asdict(config),
        settings=wandb.Settings(quiet=True),
    )


def parameter_digest(model: torch.nn.Module) -> str:
    """SHA-256 over every rank's parameter bytes in rank order: equal digests mean bit-identical
    models at the same layout (resume checks, reproducibility)."""
    local = hashlib.sha256()
    for name, param in model.named_parameters():
        local.update(name.encode())
        local.update(param.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    digests = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(digests, local.hexdigest())
    return hashlib.sha256("".join(digests).encode()).hexdigest()


def allocated_bytes_per_param(config: TrainConfig, parameters: list[torch.nn.Parameter], world_size: int) -> float:
    """Bytes per parameter on each rank as allocated, for the summary: the 16-bit parameter, DDP's
    gradient buffer (4 bytes where ``precision.grad_reduce_in_fp32``) and the option's optimizer
    state, divided over the data-parallel ranks with ``optimizer.use_distributed_optimizer``; with
    Muon, its one momentum for the hidden weights among ``parameters`` and AdamW's two moments for the
    rest, by element count."""
    strategy = precision_strategy(config.precision)
    shards = data_parallel_size(config, world_size) if config.optimizer.use_distributed_optimizer else 1
    allocated = {"grad_reduce_in_fp32": reduces_grads_in_fp32(config.precision), "state_shards": shards}
    if config.optimizer.name != "muon":
        return strategy.bytes_per_param(**allocated)
    from megatron_lowprec.megatron.optimizer import is_muon_param
    from megatron_lowprec.optim.muon import muon_strategy

    hidden = sum(p.numel() for p in parameters if is_muon_param(p))
    total = sum(p.numel() for p in parameters)
    muon_bytes = muon_strategy(strategy).bytes_per_param(**allocated)
    return (hidden * muon_bytes + (total - hidden) * strategy.bytes_per_param(**allocated)) / total


def _performance_text(performance: dict) -> str:
    """``12.3 TFLOP/s/GPU | MFU 1.2% | peak 3.40 GiB allocated, 4.00 GiB reserved``; on CPUs
    ``TFLOP/s/process`` and ``peak RSS`` (a rank is a process there, not a GPU)."""
    device = "GPU" if "peak_allocated_gib" in performance else "process"
    parts = [f"{performance['tflops_per_gpu']:.3g} TFLOP/s/{device}"]
    if "mfu" in performance:
        parts.append(f"MFU {100 * performance['mfu']:.1f}%")
    if "peak_rss_gib" in performance:
        parts.append(f"peak RSS {performance['peak_rss_gib']:.2f} GiB")
    else:
        parts.append(
            f"peak {performance['peak_allocated_gib']:.2f} GiB allocated, {performance['peak_reserved_gib']:.2f} GiB reserved"
        )
    return " | ".join(parts)


class MetricsLogger:
    """Writes on global rank 0 only; the other ranks pass through."""

    def __init__(self, config: TrainConfig, run_dir: Path, run, resumed_from: int | None) -> None:
        self.config = config
        self.run_dir = run_dir
        self.run = run
        self.active = torch.distributed.get_rank() == 0
        self.last_train_loss = math.nan
        self.last_finite_train_loss = math.nan
        self.skipped_steps_logged = 0
        self.wandb = None
        self.parameters = self.parameter_count()
        vocab_size = padded_vocab_size(
            config.model.vocab_size or run.data.tokenizer.vocab_size,
            config.model.make_vocab_size_divisible_by,
            config.trainer.tensor_model_parallel_size,
        )
        self.flops_per_token = throughput.training_flops_per_token(config.model, vocab_size)
        self.peak_flops = throughput.peak_bf16_flops()
        if not self.active:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(to_yaml(config))
        _keep_rows_up_to(run_dir / config.logging.metrics_file, resumed_from or 0)
        (run_dir / SUMMARY_FILE).unlink(missing_ok=True)  # an earlier run's: this one writes its own as it ends
        self.metrics = (run_dir / config.logging.metrics_file).open("a", encoding="utf-8")
        if config.logging.wandb:
            self.wandb = _open_wandb(config, run_dir)
        strategy = precision_strategy(config.precision)
        optimizer = " with megatron-core's optimizer" if config.precision.megatron_optimizer else ""
        optimizer += " with Muon" if config.optimizer.name == "muon" else ""
        start = f"resumed from step {resumed_from}" if resumed_from is not None else "from scratch"
        print(
            f"lowprec-train: {config.model.name} ({self.parameters / 1e6:.2f}M parameters), "
            f"option {strategy.name}{optimizer} ({self._bytes_per_param():g} bytes/param), "
            f"attention {attention_backend(config)}, "
            f"world size {torch.distributed.get_world_size()} (TP {config.trainer.tensor_model_parallel_size}, "
            f"PP {config.trainer.pipeline_model_parallel_size}), {config.trainer.max_steps} steps {start}; "
            f"run dir {run_dir}",
            flush=True,
        )

    def parameter_count(self) -> int:
        """Parameters of the whole model (summed over pipeline stages, tensor-parallel shards once)."""
        from megatron.core import parallel_state, tensor_parallel

        count = torch.tensor(
            [
                sum(p.numel() for p in self.run.model.parameters() if tensor_parallel.param_is_not_tensor_parallel_duplicate(p))
                if parallel_state.get_data_parallel_rank() == 0
                else 0
            ],
            dtype=torch.int64,
            device=torch.cuda.current_device(),
        )
        torch.distributed.all_reduce(count)
        return int(count)

    def _write(self, row: dict) -> None:
        row = {"step": row.pop("step"), "split": row.pop("split"), "option": option_label(self.config.precision), **row}
        self.metrics.write(json.dumps(strict_json(row), allow_nan=False) + "\n")
        self.metrics.flush()
        if self.wandb is not None:
            split = row["split"]
            self.wandb.log({f"{split}/{key}": value for key, value in row.items() if isinstance(value, (int, float))}, step=row["step"])

    def _performance(self, tokens_per_second: float) -> dict:
        """TFLOP/s per GPU, MFU where the peak is known, and peak memory (collective)."""
        world_size = torch.distributed.get_world_size()
        return {
            **throughput.throughput(self.flops_per_token, tokens_per_second, world_size, self.peak_flops),
            **throughput.peak_memory(),
        }

    def train(self, step: int, records: list[dict], tokens_per_second: float) -> None:
        """The interval ending at ``step``: console line and metrics row."""
        self.last_train_loss = records[-1]["loss"]
        finite_losses = [record["loss"] for record in records if finite_record(record)]
        if finite_losses:
            self.last_finite_train_loss = finite_losses[-1]
        self.skipped_steps_logged += sum(record["skipped"] for record in records)
        performance = self._performance(tokens_per_second)
        if not self.active:
            return
        row = {
            "step": step,
            "split": "train",
            "loss": _mean(records, "loss"),
            "lr": records[-1]["lr"],
            "grad_norm": _mean(records, "grad_norm"),
            "tokens_per_second": tokens_per_second,
            **performance,
            "skipped_steps": sum(record["skipped"] for record in records),
        }
        line = (
            f"step {step:>6}/{self.config.trainer.max_steps} | loss {row['loss']:.4f} | lr {row['lr']:.3e} | "
            f"grad norm {row['grad_norm'] or math.nan:.3f} | {tokens_per_second:,.0f} tokens/s | "
            f"{_performance_text(performance)}"
        )
        if self.config.precision.track_update_quality:
            row.update(edq=_mean(records, "edq"), imprecision_percent=_mean(records, "imprecision_percent"))
            line += f" | EDQ {row['edq'] or math.nan:.4f} | imprecision {row['imprecision_percent'] or math.nan:.2f}%"
        if row["skipped_steps"]:
            line += f" | {row['skipped_steps']} skipped (non-finite gradients)"
        print(line, flush=True)
        self._write(row)

    def valid(self, step: int, loss: float) -> None:
        """A validation result at ``step``."""
        if not self.active:
            return
        perplexity = math.exp(min(loss, 700.0))
        print(f"step {step:>6}/{self.config.trainer.max_steps} | validation loss {loss:.4f} | perplexity {perplexity:.2f}", flush=True)
        self._write({"step": step, "split": "valid", "loss": loss, "perplexity": perplexity})

    def sharpness(self, step: int, value: float) -> None:
        """A last-token sharpness measurement at ``step``."""
        if not self.active:
            return
        eps = self.config.trainer.sharpness_eps
        print(f"step {step:>6}/{self.config.trainer.max_steps} | last-token sharpness {value:.4f} (eps {eps:g})", flush=True)
        self._write({"step": step, "split": "sharpness", "sharpness": value, "eps": eps})

    def _skipped_steps(self) -> int:
        """Steps skipped for non-finite gradients: the precision options count them in their state
        (so a resumed run counts the earlier ones too); megatron-core's optimizer reports each step's
        success, counted over the steps logged by this process."""
        if self.config.precision.megatron_optimizer:
            return self.skipped_steps_logged
        optimizer = self.run.optimizer
        if self.config.optimizer.name == "muon":
            optimizer = optimizer.chained_optimizers[0]
        return optimizer.optimizer.skipped_steps

    def _bytes_per_param(self) -> float:
        return allocated_bytes_per_param(self.config, list(self.run.model.parameters()), torch.distributed.get_world_size())

    def _summary(self, status: str, tokens_per_second: float) -> dict:
        """The fields every summary has: how the run ended, what was trained, how far and how fast
        (collective)."""
        return {
            "status": status,
            "option": option_label(self.config.precision),
            "optimizer": self.config.optimizer.name,
            "bytes_per_param": self._bytes_per_param(),
            "grad_reduce_in_fp32": reduces_grads_in_fp32(self.config.precision),
            "model": self.config.model.name,
            "parameters": self.parameters,
            "steps": self.run.iteration,
            "tokens_per_second": tokens_per_second,
            "flops_per_token": self.flops_per_token,
            **({"peak_bf16_tflops": self.peak_flops / 1e12} if self.peak_flops else {}),
            **self._performance(tokens_per_second),
            "skipped_steps": self._skipped_steps(),
        }

    def _save_summary(self, summary: dict) -> None:
        """Write ``summary.json`` (strict JSON) and hand its numbers to wandb (rank 0)."""
        if not self.active:
            return
        _write_atomically(self.run_dir / SUMMARY_FILE, json.dumps(strict_json(summary), indent=1, allow_nan=False))
        if self.wandb is not None:
            self.wandb.summary.update({key: value for key, value in summary.items() if isinstance(value, (int, float))})

    def finish(self, valid_loss: float, tokens_per_second: float) -> dict:
        """Save the summary, close the metrics file and wandb, then print the summary: the run's last
        line. Its train loss is the last step's (the step lines show means over their interval)."""
        summary = self._summary(FINISHED, tokens_per_second)
        summary.update(
            final_train_loss=self.last_train_loss,
            final_valid_loss=valid_loss,
            parameter_digest=parameter_digest(self.run.model),
            run_dir=str(self.run_dir),
        )
        self._save_summary(summary)
        self.close(exit_code=0)
        if self.active:
            print(
                f"summary: option {summary['option']} ({summary['bytes_per_param']:g} bytes/param) | "
                f"{summary['model']} {summary['parameters'] / 1e6:.2f}M params | {summary['steps']} steps | "
                f"train loss {summary['final_train_loss']:.4f} (last step) | validation loss {valid_loss:.4f} | "
                f"{tokens_per_second:,.0f} tokens/s | {_performance_text(summary)} | {self.run_dir}",
                flush=True,
            )
        return summary

    def stop(self, signal_name: str, checkpoint: Path | None, tokens_per_second: float) -> dict:
        """An exit signal stopped the run after ``run.iteration``: the summary (status ``stopped by
        <signal>``, the checkpoint saved), files closed, one line; returns the summary."""
        step, rerun = self.run.iteration, f"run_dir={self.run_dir}"
        summary = self._summary(f"stopped by {signal_name}", tokens_per_second)
        summary.update(
            stopped_by=signal_name,
            final_train_loss=self.last_train_loss,
            parameter_digest=parameter_digest(self.run.model),
            checkpoint=None if checkpoint is None else str(checkpoint),
            run_dir=str(self.run_dir),
        )
        self._save_summary(summary)
        self.close(exit_code=0)
        if self.config.resume_from is not None:
            rerun += " and without resume_from"
        if checkpoint is None:
            saved = "without a checkpoint (trainer.save=false)"
        else:
            saved = f"and saved {checkpoint}; a rerun with {rerun} resumes from it"
        if self.active:
            print(
                f"lowprec-train: {signal_name} received: stopped after step {step}/{self.config.trainer.max_steps} {saved}",
                flush=True,
            )
        return summary

    def diverged(self, nonfinite_steps: list[int], record: dict, tokens_per_second: float) -> dict:
        """The loss or the gradient norm was not finite at ``nonfinite_steps`` (consecutive, the last
        one's ``record``): the summary (status ``diverged``; ``last_finite_step`` is null where no step
        of the run was finite; ``final_train_loss`` is the loss of this run's last finite step; ``last_loss`` and
        ``last_grad_norm`` the last step's, null where not finite, as ``reason`` writes them out;
        ``checkpoint`` the last intact one, which a rerun resumes from); returns the summary. The caller
        closes the files with the run's exit status."""
        from megatron_lowprec.train.checkpoint import latest_checkpoint

        grad_norm = "" if record["grad_norm"] is None else f", grad norm {record['grad_norm']:g}"
        summary = self._summary(DIVERGED, tokens_per_second)
        summary.update(
            reason=(
                f"the loss or the gradient norm was not finite for {len(nonfinite_steps)} steps in a row "
                f"(trainer.max_nonfinite_steps={self.config.trainer.max_nonfinite_steps}; last: loss {record['loss']:g}{grad_norm})"
            ),
            last_finite_step=nonfinite_steps[0] - 1 if nonfinite_steps[0] > 1 else None,
            nonfinite_steps=list(nonfinite_steps),
            final_train_loss=self.last_finite_train_loss,
            last_loss=record["loss"],
            last_grad_norm=record["grad_norm"],
            checkpoint=None,
            run_dir=str(self.run_dir),
        )
        if self.active:
            kept = latest_checkpoint(self.run_dir)
            summary["checkpoint"] = None if kept is None else str(kept)
        self._save_summary(summary)
        return summary

    def close(self, exit_code: int) -> None:
        """Close the metrics file and finish the wandb run (quietly: it prints nothing at the end)."""
        if not self.active or self.metrics.closed:
            return
        self.metrics.close()
        if self.wandb is not None:
            self.wandb.finish(exit_code=exit_code)
