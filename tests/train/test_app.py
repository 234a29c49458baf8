"""``lowprec-train`` end to end: every option, TP/PP/DP layouts, resume, torchrun, fail-fast; on CPU with
gloo, or with NCCL on one GPU per rank where CUDA is present."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_lowprec.optim.strategies import available_strategies
from tests.megatron.launch import run_ranks
from tests.options import one_per_kind

WORKER = Path(__file__).with_name("_app_worker.py")
OPTIONS = [strategy.name for strategy in available_strategies()]
OPTIONS_AND_STOCK = [*OPTIONS, "megatron"]
"""The precision options and megatron-core's own optimizer (``baseline=megatron``)."""
LAYOUT_OPTIONS = ("A", "C", "D", "sr")
UNCOMPILED = "precision.fused=false"
"""For the tests whose subject is a layout, a layer flow, resharding or resume, not the compiled step: each
rank would compile each option's step (tens of CPU-seconds apiece on CI's 2 cores), and fused and
uncompiled steps give the same bits (tests/optim/test_fused.py, in one process and at DP=2 in
tests/megatron/test_distributed_optimizer.py)."""

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("megatron.core") is None, reason="megatron-core is not installed"),
    pytest.mark.skipif(importlib.util.find_spec("hydra") is None, reason="hydra-core is not installed"),
]


def _tiny(cache_dir: Path, run_dir: Path, *overrides: str, background_compile: bool = False) -> list[str]:
    """A 2-layer, 32-wide GPT on 32-token sequences, 2 micro-batches of 2 per data-parallel rank
    and step, a metrics row per step, no wandb, no checkpoint unless asked; a fused step compiled at
    the first step unless ``background_compile`` (the app's default: its steps then run uncompiled
    until a child process has compiled it, which in a run of a few steps is never)."""
    return [
        f"precision.background_compile={str(background_compile).lower()}",
        "model.num_layers=2",
        "model.hidden_size=32",
        "model.seq_length=32",
        "trainer.micro_batch_size=2",
        "trainer.global_batch_size=8",
        "trainer.log_interval=1",
        "trainer.eval_interval=1000",
        "trainer.eval_iters=1",
        "trainer.save=false",
        "optimizer.lr_warmup_steps=1",
        "optimizer.lr_decay_steps=8",
        "logging.wandb=false",
        f"data.cache_dir={cache_dir}",
        f"run_dir={run_dir}",
        *overrides,
    ]


def _run(tmp_path: Path, world_size: int, steps: list[dict], timeout_seconds: float = 600) -> list[dict]:
    """The rank-0 results of ``steps`` (see ``_app_worker``) on ``world_size`` ranks."""
    result_dir = tmp_path / "results"
    result_dir.mkdir(exist_ok=True)
    return run_ranks(WORKER, result_dir, world_size, json.dumps(steps), timeout_seconds=timeout_seconds)[0]


def _train_losses(result: dict) -> list[float]:
    return [row["loss"] for row in result["rows"] if row["split"] == "train"]


COMPILED_IN_APP = one_per_kind(OPTIONS, lambda strategy: strategy.moments)
"""The options whose step ``test_every_option_trains_in_one_process`` compiles (the app's default,
``precision.fused=true``): one with 16-bit moments, one with FP8 moments (A and coat; coat's step
is the one ``tests/optim/test_fused.py``'s shared-buffer test compiles, so CI compiles it once). The
other options run there uncompiled: each one's compiled step is its eager step bit for bit (the
contract matrix, ``tests/optim/test_contract.py``), and the app code around the step is the same."""

MUON_OPTIONS = ("C", "sr")
"""Options also run with ``optimizer=muon`` (Muon for the hidden weights, AdamW for the rest)."""


def test_every_option_trains_in_one_process(tmp_path, cache_dir):
    """Every option and megatron-core's own optimizer train 3 steps in one process: finite losses and
    validation loss, the option in the summary (compiled: :data:`COMPILED_IN_APP`; the others
    uncompiled); Muon with two options, its first loss AdamW's and fewer bytes per parameter; option
    D close to megatron-core's optimizer."""
    steps = [
        {"overrides": _tiny(cache_dir, tmp_path / option, f"precision={option}", "trainer.max_steps=3",
                            *(() if option in COMPILED_IN_APP or option not in OPTIONS else (UNCOMPILED,)))}
        for option in OPTIONS_AND_STOCK
    ] + [
        {"overrides": _tiny(cache_dir, tmp_path / f"muon-{option}", f"precision={option}", "optimizer=muon",
                            "trainer.max_steps=3", UNCOMPILED)}
        for option in MUON_OPTIONS
    ]
    results = _run(tmp_path, 1, steps)
    muon_results = dict(zip(MUON_OPTIONS, results[len(OPTIONS_AND_STOCK):]))
    for option, result in muon_results.items():
        adamw = results[OPTIONS_AND_STOCK.index(option)]
        losses = _train_losses(result)
        assert result["summary"]["optimizer"] == "muon" and adamw["summary"]["optimizer"] == "adamw"
        assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses), (option, losses)
        assert losses[0] == _train_losses(adamw)[0] and losses[1:] != _train_losses(adamw)[1:]
        assert result["summary"]["bytes_per_param"] < adamw["summary"]["bytes_per_param"]
    for option, result in zip(OPTIONS_AND_STOCK, results):
        losses = _train_losses(result)
        assert result["summary"]["option"] == option
        assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses), (option, losses)
        assert math.isfinite(result["summary"]["final_valid_loss"])
    # Option D is megatron-core's BF16 optimizer (FP32 masters, torch's Adam); it clips by the exact
    # gradient norm, which megatron's FP32 norm approximates to 1e-6, so the runs agree closely here
    # (bit for bit when both clip by the same norm: tests/megatron/test_optimizer_hook.py).
    by_option = dict(zip(OPTIONS_AND_STOCK, results))
    assert _train_losses(by_option["megatron"]) == pytest.approx(_train_losses(by_option["D"]), rel=1e-4)


def test_layouts_train_and_match_tensor_parallel_one(tmp_path, cache_dir):
    """From one initial checkpoint (saved at DP=2, resharded by dist_checkpointing), option D trains
    the same data at TP=1 (DP=2), TP=2 and PP=2; then A, C and sr train at each layout, logging EDQ
    and the last-token sharpness (gathered from the last stage's tensor-parallel shards), uncompiled. At
    DP=2, ``optimizer=muon`` (megatron's defaults: QKV split) with ``optimizer.use_distributed_optimizer=true``
    (megatron's layer-wise distributed optimizer) trains as without it, bit for bit."""
    init = tmp_path / "init"
    layouts = {
        "dp2": [],
        "tp2": ["trainer.tensor_model_parallel_size=2"],
        "pp2": ["trainer.pipeline_model_parallel_size=2"],
    }
    steps = [{"overrides": _tiny(cache_dir, init, "precision=D", "trainer.max_steps=0", "trainer.save=true")}]
    for name, layout in layouts.items():
        steps.append({"copy_checkpoint": {"run_dir": str(init), "iteration": 0, "to": str(tmp_path / name)}})
        steps.append({"overrides": _tiny(cache_dir, tmp_path / name, "precision=D", "trainer.max_steps=4", *layout)})
    for name, layout in layouts.items():
        for option in ("A", "C", "sr"):
            steps.append(
                {"overrides": _tiny(cache_dir, tmp_path / f"{name}-{option}", f"precision={option}", "trainer.max_steps=2",
                                    "precision.track_update_quality=true", "trainer.sharpness_interval=2", UNCOMPILED,
                                    *layout)}
            )
    for distributed in ("false", "true"):
        steps.append({"overrides": _tiny(cache_dir, tmp_path / f"muon-distributed-{distributed}", "precision=sr", "optimizer=muon",
                                         f"optimizer.use_distributed_optimizer={distributed}", "trainer.max_steps=2", UNCOMPILED)})
    results = _run(tmp_path, 2, steps)
    muon, muon_layer_wise = results[-2:]
    results = results[:-2]
    assert len(_train_losses(muon)) == 2 and _train_losses(muon_layer_wise) == _train_losses(muon)
    assert muon_layer_wise["summary"]["parameter_digest"] == muon["summary"]["parameter_digest"]
    reference, tensor_parallel, pipeline_parallel = (_train_losses(result) for result in results[1:4])
    assert len(reference) == 4 and all(math.isfinite(loss) for loss in reference)
    # Pipeline stages run the same kernels on the same data: bit-identical losses. Tensor
    # parallelism splits the matmuls and all-reduces BF16 partial sums in another order, within
    # FP32-level tolerance (5e-6 relative measured).
    assert pipeline_parallel == reference
    assert tensor_parallel == pytest.approx(reference, rel=5e-5)
    for result in results[4:]:
        losses = _train_losses(result)
        assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses), result["summary"]
        assert all(math.isfinite(row["edq"]) for row in result["rows"] if row["split"] == "train")
        sharpness = [row["sharpness"] for row in result["rows"] if row["split"] == "sharpness"]
        assert len(sharpness) == 1 and 0 <= sharpness[0] < 100, sharpness


def test_tensor_and_data_parallel_together(tmp_path, cache_dir):
    steps = [
        {"overrides": _tiny(cache_dir, tmp_path / option, f"precision={option}", "trainer.max_steps=2",
                            "trainer.tensor_model_parallel_size=2", UNCOMPILED)}
        for option in LAYOUT_OPTIONS
    ]
    for option, result in zip(LAYOUT_OPTIONS, _run(tmp_path, 4, steps)):
        losses = _train_losses(result)
        assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses), option


def test_resume_is_bit_identical_for_every_option(tmp_path, cache_dir):
    """DP=2: 4 steps straight (checkpoints at 2 and 4) against resuming a copy of the step-2
    checkpoint for the last 2 steps: same losses, same parameters bit for bit (megatron-core's
    optimizer too). Uncompiled: what resumes is the checkpoint's state, which both paths keep alike;
    the compiled step's own resume is tests/optim/test_adamw.py's state dict round trip (each kind of
    state), and test_every_option_trains_in_one_process runs compiled steps in the app (:data:`COMPILED_IN_APP`)."""
    steps = []
    for option in OPTIONS_AND_STOCK:
        straight, resumed = tmp_path / f"{option}-straight", tmp_path / f"{option}-resumed"
        steps.append({"overrides": _tiny(cache_dir, straight, f"precision={option}", "trainer.max_steps=4",
                                         "trainer.save=true", "trainer.save_interval=2", UNCOMPILED)})
        steps.append({"copy_checkpoint": {"run_dir": str(straight), "iteration": 2, "to": str(resumed)}})
        steps.append({"overrides": _tiny(cache_dir, resumed, f"precision={option}", "trainer.max_steps=4", "resume=true",
                                         UNCOMPILED)})
    results = _run(tmp_path, 2, steps)
    for option, straight, resumed in zip(OPTIONS_AND_STOCK, results[0::2], results[1::2]):
        assert _train_losses(resumed) == _train_losses(straight)[2:], option
        assert resumed["summary"]["parameter_digest"] == straight["summary"]["parameter_digest"], option
        assert resumed["summary"]["final_valid_loss"] == straight["summary"]["final_valid_loss"], option


@pytest.mark.skipif(0 < torch.cuda.device_count() < 2, reason="torchrun at DP=2 needs a GPU per NCCL rank: 2 GPUs")
def test_torchrun_runs_the_console_entry_point(tmp_path, cache_dir):
    """``torchrun -m megatron_lowprec.train`` at DP=2 with wandb offline: metrics, summary, wandb files
    and a final checkpoint in the run directory; the plotting example draws its metrics; both ranks
    profile step 2 (``trainer.profile``): a trace and a table with the step's phases each."""
    run_dir = tmp_path / "run"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "-m", "megatron_lowprec.train",
        *_tiny(cache_dir, run_dir, "precision=sr", "trainer.max_steps=2", "trainer.save=true", "logging.wandb=true",
               "trainer.profile=true", "trainer.profile_step_start=1", "trainer.profile_step_end=2",
               "trainer.profile_ranks=[0,1]", background_compile=True),
    ]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "PYTHONWARNINGS": "ignore"}
    finished = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300,
                              env=environment)
    assert finished.returncode == 0, finished.stdout[-3000:]
    assert "summary: option sr" in finished.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and math.isfinite(summary["final_valid_loss"])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if row["split"] == "train"] == [1, 2]
    # Throughput and memory as Megatron-LM reports them; no MFU without a GPU whose peak is known.
    for record in [summary, *(row for row in rows if row["split"] == "train")]:
        assert record["tokens_per_second"] > 0 and record["tflops_per_gpu"] > 0 and record["peak_rss_gib"] > 0
        assert "mfu" not in record
    assert summary["tflops_per_gpu"] == pytest.approx(summary["flops_per_token"] * summary["tokens_per_second"] / 2e12)
    assert "TFLOP/s/process" in finished.stdout and "peak RSS" in finished.stdout
    # The summary is the last line of stdout and stderr, after wandb's (which says where it saves at the
    # start, and nothing at the end).
    last_line = finished.stdout.splitlines()[-1]
    assert last_line.startswith("summary: option sr") and "train loss" in last_line, finished.stdout[-2000:]
    assert f"train loss {summary['final_train_loss']:.4f} (last step)" in last_line
    assert (run_dir / "checkpoints" / "latest").read_text() == "iter_0000002"
    assert list((run_dir / "wandb").glob("offline-run-*"))
    for rank in (0, 1):
        table = (run_dir / "profile" / f"rank{rank}.txt").read_text()
        assert all(label in table for label in ("lowprec.forward_backward", "lowprec.optimizer_step", "lowprec.grad_norm")), table
        assert (run_dir / "profile" / f"rank{rank}.pt.trace.json").stat().st_size > 0
        assert f"profile of steps 2-2 (rank {rank}): {run_dir / 'profile' / f'rank{rank}.txt'}" in finished.stdout
    plot = tmp_path / "loss.png"
    example = Path(__file__).parents[2] / "examples" / "plot_metrics.py"
    plotted = subprocess.run([sys.executable, str(example), str(run_dir), "--output", str(plot)], capture_output=True, text=True, timeout=120)
    assert plotted.returncode == 0, plotted.stderr
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_fp8_layer_flow_and_exmy_emulation(tmp_path, cache_dir):
    """precision=coat (FP8 states and FP8 layer flow) at TP=2 against TP=1 (DP=2) from the same
    initial weights (megatron initialises full weights on CPU, then splits them); E8M7 emulation
    against none, bit for bit; E8M3 on every linear, LM head included, changes the losses. Uncompiled."""
    runs = {
        "coat_tp1": ["precision=coat"],
        "coat_tp2": ["precision=coat", "trainer.tensor_model_parallel_size=2"],
        "plain": ["precision=A"],
        "e8m7": ["precision=A", "precision.emulate=E8M7", "precision.layers_exclude=[]"],
        "e8m3": ["precision=A", "precision.emulate=E8M3", "precision.layers_exclude=[]"],
    }
    steps = [{"overrides": _tiny(cache_dir, tmp_path / name, "trainer.max_steps=3", UNCOMPILED, *overrides)}
             for name, overrides in runs.items()]
    losses = {name: _train_losses(result) for name, result in zip(runs, _run(tmp_path, 2, steps))}
    assert all(len(values) == 3 and all(math.isfinite(v) for v in values) for values in losses.values()), losses
    # Each TP shard takes its own per-tensor FP8 scales, so TP=2 rounds differently from TP=1: one
    # E4M3 step (2^-3 relative) per operand bounds the per-element error; the loss moves far less.
    assert losses["coat_tp2"] == pytest.approx(losses["coat_tp1"], rel=1e-2)
    assert losses["e8m7"] == losses["plain"]
    assert losses["e8m3"] != losses["plain"]


def test_distributed_optimizer_trains_resumes_and_reshards_coat(tmp_path, cache_dir):
    """``optimizer.use_distributed_optimizer=true`` at DP=2 with coat: the same losses and parameters as the
    unsharded run, resuming a copy of its step-2 checkpoint gives the straight run bit for bit, and
    the same checkpoint resumes at TP=2 (DP=1, unsharded), which coat could not before. Gradients
    are reduced in BF16: with FP32 gradients the unsharded optimizer clips by megatron's FP32 norm,
    which depends on how the elements are split into tensors, and the two runs drift by rounding.
    Uncompiled: the compiled shard step of FP8 groups at DP=2 is tested in
    tests/megatron/test_distributed_optimizer.py, coat's fused shard layouts in tests/optim/test_contract.py."""
    straight, resumed, unsharded, resharded = (tmp_path / name for name in ("straight", "resumed", "unsharded", "tp2"))
    common = ("precision=coat", "trainer.max_steps=4", "precision.grad_reduce_in_fp32=false", UNCOMPILED)
    steps = [
        {"overrides": _tiny(cache_dir, straight, *common, "optimizer.use_distributed_optimizer=true", "trainer.save=true",
                            "trainer.save_interval=2")},
        {"overrides": _tiny(cache_dir, unsharded, *common)},
        {"copy_checkpoint": {"run_dir": str(straight), "iteration": 2, "to": str(resumed)}},
        {"overrides": _tiny(cache_dir, resumed, *common, "optimizer.use_distributed_optimizer=true", "resume=true")},
        {"copy_checkpoint": {"run_dir": str(straight), "iteration": 2, "to": str(resharded)}},
        {"overrides": _tiny(cache_dir, resharded, *common, "trainer.tensor_model_parallel_size=2", "resume=true")},
    ]
    straight_run, unsharded_run, resumed_run, resharded_run = _run(tmp_path, 2, steps)
    assert _train_losses(straight_run) == _train_losses(unsharded_run)
    assert straight_run["summary"]["parameter_digest"] == unsharded_run["summary"]["parameter_digest"]
    assert _train_losses(resumed_run) == _train_losses(straight_run)[2:]
    assert resumed_run["summary"]["parameter_digest"] == straight_run["summary"]["parameter_digest"]
    resharded_losses = _train_losses(resharded_run)
    assert len(resharded_losses) == 2 and all(math.isfinite(loss) for loss in resharded_losses)
    assert resharded_losses == pytest.approx(_train_losses(straight_run)[2:], rel=1e-2)
