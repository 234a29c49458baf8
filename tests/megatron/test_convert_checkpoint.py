"""``lowprec-convert``: a torch_dist checkpoint of one option converted into another, or into one that
megatron-core's own optimizer resumes (``stock``), and back."""

from __future__ import annotations

import math
import shutil
import weakref

import pytest
import torch

from tests.megatron.test_convert_optimizer import MODEL, _built, _step


def _save(model, optimizer, directory, **metadata) -> None:
    from megatron.core import dist_checkpointing

    directory.mkdir()
    model_state = model.module.sharded_state_dict()
    optimizer_state = optimizer.sharded_state_dict(model_state, **({"metadata": metadata} if metadata else {}))
    dist_checkpointing.save({"model": model_state, "optimizer": optimizer_state}, str(directory))


def _load(model, optimizer, directory) -> None:
    from megatron.core import dist_checkpointing

    model_state = model.module.sharded_state_dict()
    template = {"model": model_state, "optimizer": optimizer.sharded_state_dict(model_state, is_loading=True)}
    loaded = dist_checkpointing.load(template, str(directory))
    model.module.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])


def _stock_built(distributed: bool = False):
    """The tiny GPT with megatron-core's own optimizer, as megatron-core builds it (bf16 parameters:
    ``Float16OptimizerWithFloat16Params``, chained; ``distributed``: its ``DistributedOptimizer``)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import get_megatron_optimizer

    from megatron_lowprec.train.app import compose
    from megatron_lowprec.train.loop import megatron_optimizer_config
    from megatron_lowprec.train.model import gpt_model

    config = compose(["baseline=megatron", *MODEL, f"optimizer.use_distributed_optimizer={str(distributed).lower()}"])
    torch.manual_seed(5)
    module = gpt_model(config, config.model.vocab_size)
    model = DistributedDataParallel(config=module.config, module=module,
                                    ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=distributed))
    return model, get_megatron_optimizer(megatron_optimizer_config(config.optimizer), [model])


def _stock_states(optimizer) -> list[tuple[torch.Tensor, torch.Tensor, dict]]:
    """(the bf16 parameter, its FP32 master, its torch AdamW state) for each parameter of megatron-core's optimizer."""
    (inner,) = optimizer.chained_optimizers
    return [
        (param, master, inner.optimizer.state[master])
        for params, masters in zip(inner.float16_groups, inner.fp32_from_float16_groups)
        for param, master in zip(params, masters)
    ]


@pytest.fixture(scope="module")
def saved_b(megatron_rank, tmp_path_factory):
    """A checkpoint of option B after one step, and each parameter's FP64 value and moments (θ + δθ,
    m, v) read from the optimizer that saved it, by parameter name."""
    model, optimizer = _built("B")
    _step(model, optimizer, 0)
    directory = tmp_path_factory.mktemp("convert") / "b"
    _save(model, optimizer, directory)
    names = {param: name for name, param in model.module.named_parameters()}
    reference = {}
    for param in optimizer.get_parameters():
        state = optimizer.optimizer.state[param]
        reference[names[param]] = {
            "value": param.double() + state["param_lo"].double(),
            "exp_avg": state["exp_avg"].double(), "exp_avg_sq": state["exp_avg_sq"].double(),
        }
    return directory, reference


def test_an_option_b_checkpoint_converted_to_stock_resumes_in_megatron_cores_own_optimizer(saved_b, tmp_path):
    """B -> stock: megatron-core's optimizer loads the converted checkpoint; each FP32 master is the
    FP64 value θ + δθ correctly rounded to FP32, each bf16 parameter that master rounded to bf16, the
    moments the BF16 ones exactly, the step carried; it then steps on."""
    from megatron_lowprec.train.convert import convert_checkpoint

    directory, reference = saved_b
    lines = convert_checkpoint(directory, tmp_path / "stock", "stock")
    assert [line.split(": ")[:2] for line in lines] == [["converted B -> stock", kind] for kind in ("value", "exp_avg", "exp_avg_sq")]
    assert all(line.endswith("exact") for line in lines[1:]), lines
    model, optimizer = _stock_built()
    _load(model, optimizer, tmp_path / "stock")
    names = {param: name for name, param in model.module.named_parameters()}
    states = _stock_states(optimizer)
    assert len(states) == len(reference)
    for param, master, state in states:
        expected = reference[names[param]]
        assert torch.equal(master.view(-1), expected["value"].view(-1).float()), names[param]
        assert torch.equal(param.view(-1), master.view(-1).bfloat16()), names[param]
        assert torch.equal(state["exp_avg"].view(-1), expected["exp_avg"].view(-1).float())
        assert torch.equal(state["exp_avg_sq"].view(-1), expected["exp_avg_sq"].view(-1).float())
        assert float(state["step"]) == 1.0
    _step(model, optimizer, 1)
    assert all(master.isfinite().all() for _, master, _ in states)


def test_res8_checkpoints_record_their_exponent_storage_and_megatron_lm_converts_fp32_ones_on_request(
    saved_b, tmp_path, monkeypatch, capsys
):
    """B -> res8: the converted checkpoint's optimizer section records res8's BF16 exponent storage,
    whose tensors it holds, and res8's optimizer loads it as its own. B -> res8 as it was while its
    FP8 exponents were FP32 (no record, FP32 tensors): Megatron-LM's load stops in one line naming
    ``--lowprec-convert-checkpoint``, and with it reads the FP32 exponents and loads the moments
    quantized afresh with BF16 ones, a line per state kind."""
    from dataclasses import replace

    from megatron.core import dist_checkpointing

    from megatron_lowprec.megatron.megatron_lm import optimizer_template_for
    from megatron_lowprec.optim import get_strategy
    from megatron_lowprec.train import convert

    directory, _ = saved_b
    convert.convert_checkpoint(directory, tmp_path / "res8", "res8")
    record = dist_checkpointing.load_common_state_dict(str(tmp_path / "res8"))["optimizer"]["lowprec"]
    assert (record["option"], record["fp8_exponent_storage"]) == ("res8", "bf16")
    model, optimizer = _built("res8")
    _load(model, optimizer, tmp_path / "res8")
    assert all(optimizer.optimizer.state[param]["exp_avg_expansion_exponent"].dtype == torch.bfloat16
               for param in optimizer.get_parameters())

    old = replace(get_strategy("res8"), fp8_exponent_storage="fp32")
    resolve = convert.resolve_target
    monkeypatch.setattr(convert, "resolve_target", lambda name, *args: old if name == "res8" else resolve(name, *args))
    convert.convert_checkpoint(directory, tmp_path / "old", "res8")
    monkeypatch.undo()
    assert "fp8_exponent_storage" not in dist_checkpointing.load_common_state_dict(str(tmp_path / "old"))["optimizer"]["lowprec"]
    model_state = model.module.sharded_state_dict()
    with pytest.raises(SystemExit) as stopped:
        optimizer_template_for(optimizer, optimizer.sharded_state_dict(model_state, is_loading=True), str(tmp_path / "old"))
    assert str(stopped.value) == (f"{tmp_path / 'old'} stores the FP8 expansion exponents of --lowprec-option res8 in fp32, "
                                  "this run in bf16: --lowprec-convert-checkpoint converts its optimizer state "
                                  "(its FP8 moments quantized afresh)")
    optimizer.convert_checkpoint = True
    template = optimizer_template_for(optimizer, optimizer.sharded_state_dict(model_state, is_loading=True), str(tmp_path / "old"))
    loaded = dist_checkpointing.load({"model": model_state, "optimizer": template}, str(tmp_path / "old"))
    assert loaded["optimizer"]["state"][0]["exp_avg_expansion_exponent"].dtype == torch.float32
    model.module.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    lines = [line for line in capsys.readouterr().out.splitlines() if "converted res8 -> res8" in line]
    assert "exp_avg: FP8 e4m3 1x128 groups with range expansion (k in FP32) -> FP8 e4m3 1x128 groups with range " \
           "expansion (k in BF16)" in lines[1]
    assert lines[0].endswith("exact")
    assert all(optimizer.optimizer.state[param]["exp_avg_expansion_exponent"].dtype == torch.bfloat16
               for param in optimizer.get_parameters())
    _step(model, optimizer, 1)
    assert all(param.isfinite().all() for param in optimizer.get_parameters())


@pytest.fixture(scope="module")
def saved_stock(megatron_rank, tmp_path_factory):
    """A checkpoint of megatron-core's own optimizer after one step, with that model and optimizer."""
    stock_model, stock_optimizer = _stock_built()
    _step(stock_model, stock_optimizer, 2)
    directory = tmp_path_factory.mktemp("convert") / "stock"
    _save(stock_model, stock_optimizer, directory)
    return directory, stock_model, stock_optimizer


def test_stock_to_d_and_back_is_bit_exact_and_d_resumes_it(saved_stock, tmp_path):
    """A checkpoint of megatron-core's own optimizer -> D -> stock gives every stored tensor back bit
    for bit; the D checkpoint loads into this package's optimizer with the same FP32 masters."""
    from megatron_lowprec.train.convert import ConvertError, convert_checkpoint

    stock, stock_model, stock_optimizer = saved_stock
    shutil.copytree(stock, tmp_path / "stock")
    with pytest.raises(ConvertError, match=r"\(exp_avg, exp_avg_sq, fp32_param\) are not option B's .*by --from$"):
        convert_checkpoint(tmp_path / "stock", tmp_path / "wrong", "D", source_name="B")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["stock"]
    lines = convert_checkpoint(tmp_path / "stock", tmp_path / "d", "D")
    assert all(line.startswith("converted stock -> D: ") and line.endswith("exact") for line in lines), lines
    convert_checkpoint(tmp_path / "d", tmp_path / "back", "stock")

    _assert_same_stored_tensors(tmp_path / "stock", tmp_path / "back", "fp32_param")

    model, optimizer = _built("D")
    _load(model, optimizer, tmp_path / "d")
    names = {name: param for name, param in stock_model.module.named_parameters()}
    masters = {param: master for param, master, _ in _stock_states(stock_optimizer)}
    for name, param in model.module.named_parameters():
        assert torch.equal(optimizer.optimizer.state[param]["master"].view(-1), masters[names[name]].view(-1)), name
        assert torch.equal(param, names[name])


def test_the_converter_holds_one_shard_of_a_parameter_at_a_time(saved_b, tmp_path, monkeypatch):
    """Every shard the converter reads is released before it reads the next parameter's: the bytes
    alive at any read never exceed one parameter's shard with its states."""
    import megatron_lowprec.train.convert as convert
    from megatron_lowprec.megatron.torch_dist import read_chunk, read_metadata

    directory, _ = saved_b
    alive: list[weakref.ref] = []
    sizes: dict[int, int] = {}
    peak = [0]

    def tracked(*args):
        tensor = read_chunk(*args)
        live = sum(sizes[id(ref)] for ref in alive if ref() is not None)
        peak[0] = max(peak[0], live + tensor.nbytes)
        ref = weakref.ref(tensor)
        sizes[id(ref)] = tensor.nbytes
        alive.append(ref)
        return tensor

    monkeypatch.setattr(convert, "read_chunk", tracked)
    convert.convert_checkpoint(directory, tmp_path / "out", "D")
    metadata = read_metadata(directory)
    entries = metadata.state_dict_metadata
    states = [key for key in entries if key.startswith("optimizer.state.")]
    largest = max(
        sum(math.prod(chunk.sizes) * entries[key].properties.dtype.itemsize
            for key in [parameter, *[state for state in states if state.endswith(f".{parameter}")]])
        for parameter in entries if f"optimizer.state.exp_avg.{parameter}" in entries
        for chunk in entries[parameter].chunks
    )
    assert 0 < peak[0] <= largest
    total = sum(sizes.values())
    assert total > 3 * largest  # the checkpoint is several times what was alive at once


class _RunsACommand:
    """What a crafted checkpoint holds: an object whose unpickling calls ``os.system``."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def _files(directory):
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def test_lowprec_convert_stops_in_one_line_with_exit_2_and_leaves_the_source_as_it_was(saved_b, tmp_path, capsys):
    """A bad path, a non-empty destination, an unknown option (the valid ones named), a damaged
    source (a checksum mismatch) and a crafted ``.metadata`` each stop with one line and exit 2,
    writing nothing; the source's files are unchanged; a good run writes a checkpoint whose checksums
    verify and says what it converted."""
    import pickle

    from megatron_lowprec.train.checkpoint import checkpoint_problem
    from megatron_lowprec.train.convert import main

    directory, _ = saved_b
    before = _files(directory)
    good = tmp_path / "good"
    assert main([str(directory), str(good), "--to", "D"]) == 0
    out, err = capsys.readouterr()
    assert "converted B -> D: value: BF16 pair (θ, δθ) -> FP32 master (fp32)" in out
    assert err.splitlines()[-1].startswith("lowprec-convert: ") and " keys, " in err  # progress, on stderr
    assert checkpoint_problem(good, share=(0, 1)) is None

    damaged = tmp_path / "damaged"
    shutil.copytree(good, damaged)
    shard = damaged / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    crafted = tmp_path / "crafted"
    shutil.copytree(directory, crafted)
    marker = tmp_path / "ran"
    (crafted / ".metadata").write_bytes(pickle.dumps(_RunsACommand(marker)))
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "file").write_text("x")
    cases = [
        ([str(tmp_path / "missing"), str(tmp_path / "a"), "--to", "D"], "is not a directory"),
        ([str(tmp_path), str(tmp_path / "b"), "--to", "D"], "is not a torch_dist checkpoint (no .metadata)"),
        ([str(directory), str(occupied), "--to", "D"], "exists and is not an empty directory"),
        ([str(directory), str(tmp_path / "c"), "--to", "E"], "--to: unknown precision option 'E'; valid: A, bf16, B,"),
        ([str(directory), str(tmp_path / "c"), "--to", "E"], ", stock\n"),
        ([str(damaged), str(tmp_path / "d"), "--to", "stock"],
         "is damaged: __0_0.distcp does not match its xxh3_128 checksum"),
        ([str(crafted), str(tmp_path / "e"), "--to", "D"], "refused to unpickle it"),
        ([str(directory), str(tmp_path / "f"), "--to", "D", "--from", "stock"],
         "it records its option (B): --from names the option of a checkpoint that records none"),
    ]
    for argv, expected in cases:
        assert main(argv) == 2, argv
        out, err = capsys.readouterr()
        assert out == "" and len(err.splitlines()) == 1 and err.startswith("lowprec-convert: ") and expected in err + "\n", (argv, err)
    assert not marker.exists()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["crafted", "damaged", "good", "occupied"]
    assert _files(directory) == before


def test_the_megatron_lm_load_reads_another_options_checkpoint_on_request_only(saved_stock, saved_b, capsys):
    """What Megatron-LM's ``load_checkpoint`` reads with the entry installed
    (:func:`~megatron_lowprec.megatron.megatron_lm.optimizer_template_for`): a checkpoint of
    megatron-core's own optimizer loads into option B's optimizer built with ``convert_checkpoint``
    (``--lowprec-convert-checkpoint``), each (θ, δθ) the FP32 master's nearest BF16 and the BF16 rest,
    each moment the FP32 one rounded to BF16, a line per state kind; without the flag the run stops
    with one line naming it, and megatron's own optimizer stops on B's checkpoint naming lowprec-convert."""
    from megatron.core import dist_checkpointing

    from megatron_lowprec.megatron.megatron_lm import optimizer_template_for

    stock, stock_model, stock_optimizer = saved_stock
    names = {param: name for name, param in stock_model.module.named_parameters()}
    masters = {names[param]: master for param, master, _ in _stock_states(stock_optimizer)}
    moments = {names[param]: state for param, _, state in _stock_states(stock_optimizer)}
    model, optimizer = _built("B", convert_checkpoint=True)
    model_state = model.module.sharded_state_dict()
    template = optimizer_template_for(optimizer, optimizer.sharded_state_dict(model_state, is_loading=True), str(stock))
    loaded = dist_checkpointing.load({"model": model_state, "optimizer": template}, str(stock))
    model.module.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    assert [line.split(": ")[2] for line in capsys.readouterr().out.splitlines() if "converted stock -> B" in line] == [
        "value", "exp_avg", "exp_avg_sq"]
    for name, param in model.module.named_parameters():
        state, master = optimizer.optimizer.state[param], masters[name].double()
        assert torch.equal(param.double(), master.bfloat16().double()), name
        assert torch.equal(state["param_lo"].double(), (master - param.double()).bfloat16().double()), name
        assert torch.equal(state["exp_avg"], moments[name]["exp_avg"].bfloat16())
        assert torch.equal(state["exp_avg_sq"], moments[name]["exp_avg_sq"].bfloat16())
    assert optimizer.optimizer.state[param]["step"] == 1

    model, refusing = _built("B")
    with pytest.raises(SystemExit) as stopped:
        optimizer_template_for(refusing, refusing.sharded_state_dict(model.module.sharded_state_dict(), is_loading=True), str(stock))
    assert str(stopped.value) == (f"{stock} was saved with megatron's own optimizer, this run has --lowprec-option B: "
                                  "--lowprec-convert-checkpoint converts its optimizer state to B")
    directory, _ = saved_b
    with pytest.raises(SystemExit) as stopped:
        optimizer_template_for(stock_optimizer, {}, str(directory))
    assert str(stopped.value).endswith("resume with --lowprec-option B, or convert it with `lowprec-convert SRC DST --to stock`")


@pytest.fixture(scope="module")
def saved_distributed(tmp_path_factory):
    """Checkpoints of megatron-core's own ``DistributedOptimizer`` at DP=2 after two steps, in the
    ``fully_reshardable`` and the ``dp_reshardable`` form, the first converted to D and back to
    ``stock`` with the distributed optimizer and resumed by it (:mod:`tests.megatron._stock_distributed_worker`):
    (the directory, each rank's results, each parameter's FP64 master and moments assembled from the
    elements each rank's optimizer owned, by checkpoint key)."""
    import json
    from pathlib import Path

    from .launch import run_ranks

    directory = tmp_path_factory.mktemp("distributed")
    ranks = run_ranks(Path(__file__).with_name("_stock_distributed_worker.py"), directory, 2, "round_trip",
                      json.dumps({"directory": str(directory)}), timeout_seconds=300, on_cpu=True)
    owned = [torch.load(directory / f"rank{rank}.pt", weights_only=True) for rank in range(2)]
    reference = {}
    with torch._C.DisableTorchFunction():  # the rank's tensors keep the CPU bridge check's records (see _tensors)
        for name, param in owned[0]["params"].items():
            values = {key: torch.full((param.numel(),), math.nan, dtype=torch.float64) for key in ("param", "exp_avg", "exp_avg_sq")}
            for saved in owned:
                if name in saved["owned"]:
                    start, end = saved["owned"][name]["range"]
                    for key, value in values.items():
                        value[start:end] = saved["owned"][name][key].double()
            assert not any(value.isnan().any() for value in values.values()), name  # the two ranks own every element
            reference[owned[0]["keys"][name]] = values
    return directory, ranks, reference


def _assert_same_stored_tensors(original_dir, back_dir, master_key: str) -> None:
    """The checkpoints hold the same tensors, byte for byte and dtype for dtype, FP32 masters among
    them under ``optimizer.state.<master_key>``."""
    original, back = _tensors(original_dir), _tensors(back_dir)
    assert sorted(original) == sorted(back)
    assert any(key.startswith(f"optimizer.state.{master_key}.") for key in back)
    for key, chunks in original.items():
        assert all(a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                   for a, b in zip(chunks, back[key], strict=True)), key


def _tensors(directory):
    """Every stored shard of every tensor of the checkpoint ``directory``, by key (copies made outside
    the CPU bridge's check: a tensor that a rank on the bridge saved keeps the check's record of
    where it was made)."""
    from megatron_lowprec.megatron.torch_dist import read_chunk, read_metadata

    metadata = read_metadata(directory)
    with torch._C.DisableTorchFunction():
        return {key: [read_chunk(directory, metadata, key, chunk).clone() for chunk in entry.chunks]
                for key, entry in metadata.state_dict_metadata.items() if hasattr(entry, "chunks")}


def test_megatrons_distributed_optimizer_checkpoint_converts_to_d_and_back_and_resumes_bit_for_bit(saved_distributed):
    """megatron-core's ``DistributedOptimizer`` at DP=2, saved as Megatron-LM's
    ``--dist-ckpt-optim-fully-reshardable`` saves it -> D -> ``stock`` with ``use_distributed_optimizer``:
    exact, every stored tensor and the optimizer's common state as megatron saved them, bit for bit;
    a new ``DistributedOptimizer`` resumes it on both ranks with each owned master and moment and
    the step as saved, and steps on as from megatron's own checkpoint."""
    from megatron_lowprec.megatron.torch_dist import read_common, read_metadata

    directory, ranks, _ = saved_distributed
    lines = ranks[0]["lines"]
    assert [line.split(": ")[:2] for line in lines] == [
        [f"converted {pair}", kind] for pair in ("stock -> D", "D -> stock") for kind in ("value", "exp_avg", "exp_avg_sq")]
    assert all(line.endswith("exact") for line in lines), lines
    for rank in ranks:
        assert rank["states_identical"] and rank["params_identical"] and rank["continued_identical"], rank
        assert rank["steps"] == rank["loaded_steps"] == [2.0]
    _assert_same_stored_tensors(directory / "fully_reshardable", directory / "back", "param")
    commons = [read_common(path, read_metadata(path)) for path in (directory / "fully_reshardable", directory / "back")]
    assert commons[0]["optimizer"] == commons[1]["optimizer"]
    assert commons[0]["content_metadata"] == commons[1]["content_metadata"]


def _checkpoint_keys(model_state) -> dict:
    """Each parameter's key in a model's sharded state dict."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    return {sharded.data: sharded.key for sharded in nested_values(model_state)
            if isinstance(getattr(sharded, "data", None), torch.nn.Parameter)}


def _check_b(reference, directory_or_states) -> None:
    """Option B's state of each parameter against megatron's FP32 master and moments: θ the master
    rounded to nearest BF16, δθ the rest rounded to BF16, m and v rounded to BF16 (each exact from FP64)."""
    for key, (param, state) in directory_or_states.items():
        expected = reference[key]
        master = expected["param"]
        assert torch.equal(param.double().view(-1), master.float().bfloat16().double()), key
        assert torch.equal(state["param_lo"].double().view(-1), (master - param.double().view(-1)).float().bfloat16().double()), key
        assert torch.equal(state["exp_avg"].view(-1), expected["exp_avg"].float().bfloat16()), key
        assert torch.equal(state["exp_avg_sq"].view(-1), expected["exp_avg_sq"].float().bfloat16()), key


def test_a_distributed_optimizer_checkpoint_converts_to_b_offline_each_value_correctly_rounded(saved_distributed, tmp_path):
    """fully_reshardable -> B: each (θ, δθ) and moment from the masters and moments the two ranks'
    optimizers held (FP64), the step carried; the bucket form (Megatron-LM's default) and
    ``--use-distributed-optimizer`` toward an option each stop in one line, writing nothing."""
    from megatron_lowprec.megatron.torch_dist import read_common, read_metadata
    from megatron_lowprec.train.convert import ConvertError, convert_checkpoint

    directory, _, reference = saved_distributed
    with torch._C.DisableTorchFunction():  # lowprec-convert runs outside the CPU bridge (see _tensors)
        lines = convert_checkpoint(directory / "fully_reshardable", tmp_path / "b", "B")
    assert [line.split(": ")[:2] for line in lines] == [["converted stock -> B", kind] for kind in ("value", "exp_avg", "exp_avg_sq")]
    tensors = _tensors(tmp_path / "b")
    _check_b(reference, {key: (tensors[key][0], {state: tensors[f"optimizer.state.{state}.{key}"][0]
                                                   for state in ("param_lo", "exp_avg", "exp_avg_sq")})
                         for key in reference})
    common = read_common(tmp_path / "b", read_metadata(tmp_path / "b"))
    assert common["optimizer"]["state"]["common_step"] == 2 and common["optimizer"]["lowprec"]["option"] == "B"
    assert all("step" not in group for group in common["optimizer"]["param_groups"])

    with pytest.raises(ConvertError, match=r"^it holds megatron's DistributedOptimizer state in form 'dp_reshardable', .*"
                                           r"once saved with Megatron-LM's --dist-ckpt-optim-fully-reshardable "):
        convert_checkpoint(directory / "dp_reshardable", tmp_path / "refused", "B")
    with pytest.raises(ConvertError, match=r"^--use-distributed-optimizer writes megatron's own DistributedOptimizer state \(--to stock\)"):
        convert_checkpoint(directory / "fully_reshardable", tmp_path / "refused", "B", use_distributed_optimizer=True)
    assert not (tmp_path / "refused").exists()


def test_a_distributed_optimizer_checkpoint_resumes_into_b_and_into_megatrons_plain_optimizer(
    saved_distributed, megatron_rank, tmp_path, capsys,
):
    """The Megatron-LM load with ``--lowprec-convert-checkpoint`` reads megatron's ``DistributedOptimizer``
    checkpoint (fully_reshardable) into option B, values as offline, the step carried: into the plain
    optimizer here, and at DP=2 into the distributed one (``_stock_distributed_worker.py``), each rank's
    runs and every whole parameter the saved FP32 masters and moments rounded by torch's casts, one
    line per state kind over both ranks' elements; its bucket form
    stops in one line naming the save flag. ``--to stock`` without ``use_distributed_optimizer`` gives
    megatron's ``Float16OptimizerWithFloat16Params`` the same masters and moments, bit for bit."""
    from megatron.core import dist_checkpointing

    from megatron_lowprec.megatron.megatron_lm import optimizer_template_for
    from megatron_lowprec.train.convert import convert_checkpoint

    directory, ranks, reference = saved_distributed
    for rank in ranks:
        into_distributed = rank["into_distributed_b"]
        assert into_distributed["runs"] > 0 and into_distributed["wrong"] == {} and into_distributed["step"] == 2, into_distributed
    lines = ranks[0]["into_distributed_b"]["lines"]
    assert [line.split(": ")[2] for line in lines] == ["value", "exp_avg", "exp_avg_sq"]
    assert all(line.startswith("megatron-lowprec: converted stock -> B: ") and
               f", {ranks[0]['into_distributed_b']['elements']} elements, " in line for line in lines), lines
    source = str(directory / "fully_reshardable")
    model, optimizer = _built("B", convert_checkpoint=True)
    model_state = model.module.sharded_state_dict()
    template = optimizer_template_for(optimizer, optimizer.sharded_state_dict(model_state, is_loading=True), source)
    loaded = dist_checkpointing.load({"model": model_state, "optimizer": template}, source)
    model.module.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    assert [line.split(": ")[2] for line in capsys.readouterr().out.splitlines() if "converted stock -> B" in line] == [
        "value", "exp_avg", "exp_avg_sq"]
    keys = _checkpoint_keys(model.module.sharded_state_dict())
    _check_b(reference, {keys[param]: (param, optimizer.optimizer.state[param]) for param in optimizer.get_parameters()})
    assert all(state["step"] == 2 for state in optimizer.optimizer.state.values())
    with pytest.raises(SystemExit) as stopped:
        optimizer_template_for(optimizer, {}, str(directory / "dp_reshardable"))
    assert str(stopped.value).startswith(f"{directory / 'dp_reshardable'}: it holds megatron's DistributedOptimizer state in form 'dp_reshardable'")

    with torch._C.DisableTorchFunction():  # lowprec-convert runs outside the CPU bridge (see _tensors)
        convert_checkpoint(directory / "fully_reshardable", tmp_path / "stock", "stock")
    stock_model, stock_optimizer = _stock_built()
    _load(stock_model, stock_optimizer, tmp_path / "stock")
    keys = _checkpoint_keys(stock_model.module.sharded_state_dict())
    for param, master, state in _stock_states(stock_optimizer):
        expected = reference[keys[param]]
        assert torch.equal(master.view(-1).double(), expected["param"]), keys[param]
        assert torch.equal(state["exp_avg"].view(-1).double(), expected["exp_avg"])
        assert torch.equal(state["exp_avg_sq"].view(-1).double(), expected["exp_avg_sq"])
        assert float(state["step"]) == 2.0


def test_an_option_b_checkpoint_converted_for_the_distributed_optimizer_resumes_in_megatrons(saved_b, tmp_path):
    """B -> ``stock`` with ``use_distributed_optimizer``: megatron-core's ``DistributedOptimizer``
    (here at DP=1) finds this package's parameter groups and resumes each FP32 master as θ + δθ
    rounded to FP32 and the moments exactly, the step carried."""
    from tests.megatron._stock_distributed_worker import _load, _step as step_with

    from megatron_lowprec.train.convert import convert_checkpoint

    directory, reference = saved_b
    lines = convert_checkpoint(directory, tmp_path / "stock", "stock", use_distributed_optimizer=True)
    assert [line.split(": ")[:2] for line in lines] == [["converted B -> stock", kind] for kind in ("value", "exp_avg", "exp_avg_sq")]
    model, optimizer = _stock_built(distributed=True)
    step_with(model, optimizer, 7)  # torch's AdamW has a step to load over only once it stepped
    _load(model, optimizer, tmp_path / "stock")
    (inner,) = optimizer.chained_optimizers
    names = {param: name for name, param in model.module.named_parameters()}
    for param in model.module.parameters():
        tensors = inner._get_main_param_and_optimizer_states(param)
        expected = reference[names[param]]
        assert torch.equal(tensors["param"].view(-1), expected["value"].view(-1).float()), names[param]
        assert torch.equal(tensors["exp_avg"].view(-1), expected["exp_avg"].view(-1).float())
        assert torch.equal(tensors["exp_avg_sq"].view(-1), expected["exp_avg_sq"].view(-1).float())
        assert float(tensors["step"]) == 1.0


def _built_muon(option: str):
    """The tiny GPT with this package's Muon chain under ``option`` (Muon for the hidden weights,
    AdamW for the rest), stepping eagerly."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_lowprec.megatron.optimizer import build_optimizer
    from megatron_lowprec.train.app import compose
    from megatron_lowprec.train.loop import megatron_optimizer_config
    from megatron_lowprec.train.model import gpt_model

    config = compose([f"precision={option}", "optimizer=muon", *MODEL])
    torch.manual_seed(3)
    module = gpt_model(config, config.model.vocab_size)
    model = DistributedDataParallel(config=module.config, ddp_config=DistributedDataParallelConfig(), module=module)
    optimizer = build_optimizer(option, [model], megatron_optimizer_config(config.optimizer), fused=False, background_compile=False)
    return model, optimizer


def _chain_states(model, optimizer) -> dict[str, tuple[str, torch.Tensor, dict]]:
    """Per parameter name: (``Muon`` or ``AdamW``, the parameter, its state) in the chain."""
    names = {param: name for name, param in model.module.named_parameters()}
    return {
        names[param]: (type(chained.optimizer).__name__, param, chained.optimizer.state[param])
        for chained in optimizer.chained_optimizers
        for param in chained.get_parameters()
    }


def test_a_muon_checkpoint_converts_into_another_option_and_resumes(megatron_rank, tmp_path):
    """The Muon chain of option B -> D offline: each optimizer's states converted by their meaning
    (the FP32 master θ + δθ correctly rounded from FP64, the BF16 momentum and moments exactly), one
    line per state kind and optimizer; D's Muon chain loads it and steps on. Into megatron-core's own
    Muon (``stock``) it stops in one line."""
    from megatron_lowprec.optim.master import MASTER_KEYS
    from megatron_lowprec.train.convert import ConvertError, convert_checkpoint

    model, optimizer = _built_muon("B")
    _step(model, optimizer, 0)
    _save(model, optimizer, tmp_path / "b")
    saved = {
        name: (kind, param.double() + state["param_lo"].double(),
               {moment: state[moment].double() for moment in ("momentum", "exp_avg", "exp_avg_sq") if moment in state})
        for name, (kind, param, state) in _chain_states(model, optimizer).items()
    }
    assert {kind for kind, _, _ in saved.values()} == {"Muon", "AdamW"}
    lines = convert_checkpoint(tmp_path / "b", tmp_path / "d", "D")
    assert [line.split(": ")[:3] for line in lines] == [
        ["Muon", "converted B -> D", "value"], ["Muon", "converted B -> D", "momentum"],
        ["AdamW", "converted B -> D", "value"], ["AdamW", "converted B -> D", "exp_avg"],
        ["AdamW", "converted B -> D", "exp_avg_sq"],
    ]
    assert all(line.endswith("exact") for line in lines if ": value: " not in line), lines
    resumed_model, resumed = _built_muon("D")
    _load(resumed_model, resumed, tmp_path / "d")
    states = _chain_states(resumed_model, resumed)
    assert states.keys() == saved.keys()
    for name, (kind, param, state) in states.items():
        saved_kind, value, moments = saved[name]
        assert kind == saved_kind, name
        master = state[MASTER_KEYS["fp32"]]
        assert torch.equal(master.view(-1), value.view(-1).float()), name
        assert torch.equal(param.view(-1), master.view(-1).bfloat16()), name
        for moment, expected in moments.items():
            assert torch.equal(state[moment].view(-1), expected.view(-1).float()), (name, moment)
    _step(resumed_model, resumed, 1)
    assert all(state[MASTER_KEYS["fp32"]].isfinite().all() for _, _, state in states.values())
    with pytest.raises(ConvertError, match=r"^it holds a chain of optimizers .*not into megatron-core's own Muon \(--to stock\)$"):
        convert_checkpoint(tmp_path / "b", tmp_path / "stock", "stock")
    assert not (tmp_path / "stock").exists()
