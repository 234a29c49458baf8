"""``lowprec-train`` resumes a checkpoint of another option with ``precision.convert_checkpoint=true``."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from tests.megatron.launch import run_ranks
from tests.train.test_fault_handling import WORKER, _tiny

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("megatron.core") is None, reason="megatron-core is not installed"),
    pytest.mark.skipif(importlib.util.find_spec("hydra") is None, reason="hydra-core is not installed"),
]


def _saved_dtypes(checkpoint: Path) -> dict[str, str]:
    """Each optimizer state's stored dtype in a ``torch_dist`` checkpoint, by state key (read from
    torch.distributed.checkpoint's metadata, as the bytes were written)."""
    from torch.distributed.checkpoint import FileSystemReader

    found: dict[str, set[str]] = {}
    for key, item in FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata.items():
        if key.startswith("optimizer.state.") and hasattr(item, "properties"):
            found.setdefault(key.split(".")[2], set()).add(str(item.properties.dtype))
    assert all(len(dtypes) == 1 for dtypes in found.values()), found
    return {key: dtypes.pop() for key, dtypes in found.items()}


def test_checkpoints_of_option_d_of_megatron_core_and_of_muon_resume_converted_and_train_on(tmp_path, cache_dir):
    """D for 2 steps (saved), then: D straight on to step 4; coat without the setting (one line, the
    checkpoint untouched); coat with it, whose FP32 masters carry over exactly (the conversion says
    so per state kind) and whose losses stay within 1% of D's continuation; D-BF16 with it, whose
    masters carry over exactly too. The converted runs save each state at its own precision: FP8
    codes (as uint8) beside FP32 scales and exponents, BF16 moments as BF16. A checkpoint of
    megatron-core's own optimizer (``baseline=megatron``) resumes converted into B, within 1% of its
    own continuation. D's checkpoint converted offline (``lowprec-convert --to stock``, exactly) resumes
    in megatron-core's own optimizer (``baseline=megatron``), its step 3 within 1% of D's. Muon
    (chained with AdamW for the rest) in D resumes converted into B, both optimizers' states each by
    its own moments (AdamW's m and v, Muon's momentum), one line per kind over both, its step 3
    within 1% of D's continuation."""
    straight, refused, converted, bf16, stock, from_stock, to_stock = (
        tmp_path / name for name in ("straight", "refused", "converted", "bf16", "stock", "from_stock", "to_stock"))
    offline = tmp_path / "offline" / "iter_0000002"
    muon_saved, muon_converted = tmp_path / "muon_saved", tmp_path / "muon_converted"
    muon = ["optimizer=muon"]
    steps = [
        {"overrides": _tiny(cache_dir, straight, "precision=D", "trainer.max_steps=2", "trainer.save=true")},
        {"convert": [str(straight / "checkpoints" / "iter_0000002"), str(offline), "stock"]},
        {"overrides": _tiny(cache_dir, to_stock, "baseline=megatron", "trainer.max_steps=3", f"resume_from={offline}")},
        {"copy": [str(straight), str(refused)]},
        {"copy": [str(straight), str(converted)]},
        {"copy": [str(straight), str(bf16)]},
        {"overrides": _tiny(cache_dir, straight, "precision=D", "trainer.max_steps=4", "resume=true")},
        {"overrides": _tiny(cache_dir, refused, "precision=coat", "trainer.max_steps=4", "resume=true")},
        {"overrides": _tiny(cache_dir, converted, "precision=coat", "trainer.max_steps=4", "resume=true",
                            "precision.convert_checkpoint=true", "trainer.save=true")},
        {"overrides": _tiny(cache_dir, bf16, "precision=D-BF16", "trainer.max_steps=3", "resume=true",
                            "precision.convert_checkpoint=true", "trainer.save=true")},
        {"overrides": _tiny(cache_dir, stock, "baseline=megatron", "trainer.max_steps=1", "trainer.save=true")},
        {"copy": [str(stock), str(from_stock)]},
        {"overrides": _tiny(cache_dir, stock, "baseline=megatron", "trainer.max_steps=3", "resume=true")},
        {"overrides": _tiny(cache_dir, from_stock, "precision=B", "trainer.max_steps=3", "resume=true",
                            "precision.convert_checkpoint=true")},
        {"overrides": _tiny(cache_dir, muon_saved, *muon, "precision=D", "trainer.max_steps=2", "trainer.save=true")},
        {"copy": [str(muon_saved), str(muon_converted)]},
        {"overrides": _tiny(cache_dir, muon_saved, *muon, "precision=D", "trainer.max_steps=3", "resume=true")},
        {"overrides": _tiny(cache_dir, muon_converted, *muon, "precision=B", "trainer.max_steps=3", "resume=true",
                            "precision.convert_checkpoint=true")},
    ]
    result_dir = tmp_path / "results"
    result_dir.mkdir()
    (_, offline_stock, continued, refusal, conversion, _, _, stock_continued, stock_converted, _, muon_continued,
     muon_conversion) = run_ranks(
        WORKER, result_dir, 1, json.dumps(steps), timeout_seconds=600)[0]
    assert refusal["error"].endswith(
        "was trained with option 'D', not 'coat'; precision.convert_checkpoint=true converts its optimizer state to this option")
    assert refusal["latest"] == "iter_0000002"
    log = (result_dir / "rank0.log").read_text()
    lines = [line for line in log.splitlines() if "converted D -> coat:" in line]
    assert len(lines) == 3, log[-3000:]
    assert "value: FP32 master (fp32) -> FP32 master (fp32)" in lines[0] and lines[0].endswith("exact")
    assert "exp_avg: FP32 -> FP8 e4m3 1x128 groups with range expansion" in lines[1]
    assert "largest error" in lines[1]
    losses = [row["loss"] for row in conversion["train_rows"]][-2:]
    expected = [row["loss"] for row in continued["train_rows"]][-2:]
    assert [row["step"] for row in conversion["train_rows"]][-2:] == [3, 4]
    assert all(math.isfinite(loss) for loss in losses)
    assert losses == pytest.approx(expected, rel=1e-2)
    bf16_lines = [line for line in log.splitlines() if "converted D -> D-BF16:" in line]
    assert "value: FP32 master (fp32) -> FP32 master (remainder)" in bf16_lines[0] and bf16_lines[0].endswith("exact")

    assert _saved_dtypes(converted / "checkpoints" / "iter_0000004") == {
        "master": "torch.float32", **{f"{moment}_{part}": dtype for moment in ("exp_avg", "exp_avg_sq") for part, dtype in
                                     (("payload", "torch.uint8"), ("scale", "torch.float32"),
                                      ("expansion_exponent", "torch.float32"))}}
    assert _saved_dtypes(bf16 / "checkpoints" / "iter_0000003") == {
        "master": "torch.float32", "exp_avg": "torch.bfloat16", "exp_avg_sq": "torch.bfloat16"}

    stock_lines = [line for line in log.splitlines() if "converted stock -> B:" in line]
    assert [line.split(": ")[2] for line in stock_lines] == ["value", "exp_avg", "exp_avg_sq"], log[-3000:]
    assert "FP32 master (fp32) -> BF16 pair (θ, δθ)" in stock_lines[0]
    assert [row["step"] for row in stock_converted["train_rows"]][-2:] == [2, 3]
    assert [row["loss"] for row in stock_converted["train_rows"]][-2:] == pytest.approx(
        [row["loss"] for row in stock_continued["train_rows"]][-2:], rel=1e-2)

    offline_lines = [line for line in log.splitlines() if line.startswith("lowprec-convert: converted D -> stock: ")]
    assert len(offline_lines) == 3 and all(line.endswith("exact") for line in offline_lines), log[-3000:]
    assert [row["step"] for row in offline_stock["train_rows"]] == [3]
    d_losses = {row["step"]: row["loss"] for row in continued["train_rows"]}
    assert offline_stock["train_rows"][0]["loss"] == pytest.approx(d_losses[3], rel=1e-2)

    muon_lines = [line for line in log.splitlines() if "converted D -> B:" in line]
    assert [line.split(": ")[2] for line in muon_lines] == ["value", "momentum", "exp_avg", "exp_avg_sq"], log[-3000:]
    assert "value: FP32 master (fp32) -> BF16 pair (θ, δθ)" in muon_lines[0]
    assert [row["step"] for row in muon_conversion["train_rows"]][-1] == 3
    muon_expected = {row["step"]: row["loss"] for row in muon_continued["train_rows"]}[3]
    assert muon_conversion["train_rows"][-1]["loss"] == pytest.approx(muon_expected, rel=1e-2)


def test_a_checkpoint_of_megatron_cores_distributed_optimizer_resumes_converted(tmp_path, cache_dir):
    """``baseline=megatron`` with megatron-core's own DistributedOptimizer at DP=2 saves its state per
    parameter (the FP32 master under ``param``, as Megatron-LM's ``--dist-ckpt-optim-fully-reshardable``;
    megatron-core's default form cannot be saved), and the checkpoint resumes converted into B: one
    line per state kind, training on from step 1."""
    run_dir = tmp_path / "run"
    steps = [
        {"overrides": _tiny(cache_dir, run_dir, "baseline=megatron", "optimizer.use_distributed_optimizer=true",
                            "trainer.max_steps=1", "trainer.save=true")},
        {"overrides": _tiny(cache_dir, run_dir, "precision=B", "trainer.max_steps=2", "resume=true",
                            "precision.convert_checkpoint=true")},
    ]
    result_dir = tmp_path / "results"
    result_dir.mkdir()
    _, converted = run_ranks(WORKER, result_dir, 2, json.dumps(steps), timeout_seconds=600)[0]
    assert set(_saved_dtypes(run_dir / "checkpoints" / "iter_0000001")) == {"param", "exp_avg", "exp_avg_sq"}
    log = (result_dir / "rank0.log").read_text()
    lines = [line for line in log.splitlines() if "converted stock -> B:" in line]
    assert [line.split(": ")[2] for line in lines] == ["value", "exp_avg", "exp_avg_sq"], log[-3000:]
    assert converted["train_rows"][-1]["step"] == 2
    assert math.isfinite(converted["train_rows"][-1]["loss"])
