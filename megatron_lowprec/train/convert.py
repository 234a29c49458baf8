"""``lowprec-convert SRC DST --to OPTION|stock``: a checkpoint's optimizer state in another option's formats.

SRC is a ``torch_dist`` checkpoint of the AdamW optimizer, or of this package's Muon chain (Muon
for the hidden weights, AdamW for the rest: each optimizer's states under ``chained_<i>.``, converted
between options; megatron-core's own Muon is not read): one of ``lowprec-train``
(``<run_dir>/checkpoints/iter_<N>``), or one that Megatron-LM or megatron-core saved with this
package's optimizer or with megatron-core's own (``stock``: an FP32 master under ``fp32_param`` and
FP32 moments; or its ``DistributedOptimizer``'s per-parameter form, the master under ``param``:
:data:`~megatron_lowprec.megatron.torch_dist.MODEL_SPACE_FORM`. Its default form, by gradient
bucket, records no parameter's place in the buckets and is refused in one line naming the save
flag that gives the per-parameter form). Each parameter's states are carried by their meaning into
the target's formats (:mod:`megatron_lowprec.optim.convert`: exactly where the target represents them, else correctly
rounded), and its 16-bit value with them, one stored shard at a time: the conversion holds one
shard of a parameter with its states in memory, never the checkpoint. Everything else (other model
tensors, objects, per-rank files) is copied byte for byte. The checkpoint then holds the target's
state as that optimizer saves it: this package's ``optimizer.state.<state>.<parameter>`` keys and
``lowprec`` record, or megatron-core's ``Float16OptimizerWithFloat16Params`` (``fp32_param``, its
parameter groups and step), which megatron-core's optimizer and ``lowprec-train baseline=megatron``
resume, or with ``--use-distributed-optimizer`` its ``DistributedOptimizer``'s per-parameter form
(``param``, the step in each parameter group, the form named in the content metadata from which
Megatron-LM's resume takes it).

The source option is the one the checkpoint records (the optimizer's ``lowprec`` section; none:
megatron-core's own), or ``--from``. Checksums (``complete.json``,
:func:`~megatron_lowprec.train.checkpoint.checkpoint_problem`) are verified before anything is read
and written for DST, whose files are verified against them before DST appears: it is written into a
temporary directory beside it and renamed, into a path that does not exist or an empty directory.
SRC is only read. Every file is unpickled with ``weights_only=True`` or an allowlist
(:mod:`megatron_lowprec.megatron.torch_dist`). A bad path, a non-empty DST, a damaged or unsafe
source and an option it cannot reach stop with one line (exit 2).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_lowprec.megatron.checkpoint_state import checkpoint_state
from megatron_lowprec.megatron.torch_dist import (
    COMMON_FILE, CONTENT_METADATA_KEY, DISTRIBUTED_FORM_KEY, DISTRIBUTED_MASTER_KEY, METADATA_FILE, MODEL_SPACE_FORM,
    STOCK_FORM_KEY, ShardWriter, UnsafeCheckpoint, common_object_index, distributed_form, is_tensor_entry, read_chunk,
    read_common, read_metadata, unread_distributed_form,
)
from megatron_lowprec.optim.convert import (
    STOCK, STOCK_MASTER_KEY, ConversionReport, as_shaped_like, convert_entry, resolve_target, saved_strategy,
    with_saved_exponent_storage,
)
from megatron_lowprec.optim.muon import MUON_MOMENTS, muon_strategy
from megatron_lowprec.optim.master import MASTER_KEYS
from megatron_lowprec.optim.strategies import (
    STORAGE_RECORDS, PrecisionStrategy, exponent_storage_record, get_strategy,
)
from megatron_lowprec.train.checkpoint import COMPLETE_FILE, checkpoint_files, checkpoint_problem, file_entries
from megatron_lowprec.train.config import STOCK_OPTIMIZER_LABEL

STATE_PREFIX = "optimizer.state."
EXIT_USAGE = 2

DISTRIBUTED_CONTENT_METADATA = {
    "distrib_optim_sharding_type": MODEL_SPACE_FORM, "distrib_optim_fully_reshardable_mem_efficient": False,
}
"""The content metadata with which Megatron-LM (``--use-distributed-optimizer
--dist-ckpt-optim-fully-reshardable``) saves, and then resumes, megatron-core's ``DistributedOptimizer``
in :data:`~megatron_lowprec.megatron.torch_dist.MODEL_SPACE_FORM`."""


class ConvertError(ValueError):
    """A conversion that cannot be made, said in one line."""


CHAIN_PREFIX = "chained_{}."
"""How megatron-core's ``ChainedOptimizer`` keys the states of its ``i``-th optimizer in a
checkpoint; the chain's common state is ``{i: that optimizer's}`` under ``optimizer``."""


@dataclass(frozen=True)
class Part:
    """One optimizer's state in a checkpoint: the prefix of its state keys, where its common state
    is (its index in a chain; ``None``: the checkpoint's one optimizer), the strategy it was saved
    with and the target, each shaped like that optimizer (AdamW's m and v, or Muon's momentum)."""

    prefix: str
    index: int | None
    saved: PrecisionStrategy
    target: PrecisionStrategy
    label: str
    """What the report's lines name it by: ``""`` alone, else ``Muon`` or ``AdamW``."""


def chain_indices(common: dict) -> list[int]:
    """The indices of a chain's optimizers whose common states ``common`` holds, ``[]`` where the
    checkpoint holds one optimizer."""
    optimizer = common.get("optimizer")
    if not isinstance(optimizer, dict) or not optimizer or not all(isinstance(index, int) for index in optimizer):
        return []
    return sorted(optimizer)


def _chain_parts(common: dict, keys: set[str], target: PrecisionStrategy, to_stock: bool, given: str | None) -> list[Part]:
    """The parts of a chain (this package's Muon and AdamW), each converted into ``target``."""
    if to_stock:
        raise ConvertError(
            "it holds a chain of optimizers (Muon for the hidden weights, AdamW for the rest): lowprec-convert converts "
            "it into another option, not into megatron-core's own Muon (--to stock)"
        )
    if given is not None:
        raise ConvertError("it holds a chain of optimizers, which record their options: leave --from out")
    parts = []
    for index in chain_indices(common):
        sub = common["optimizer"][index]
        if not isinstance(sub, dict) or "lowprec" not in sub:
            raise ConvertError(
                f"optimizer {index} of its chain records no option: lowprec-convert converts chains of this package's "
                "Muon and AdamW"
            )
        prefix = CHAIN_PREFIX.format(index) + STATE_PREFIX
        muon = any(key.startswith(f"{prefix}{moment}.") for key in keys for moment in MUON_MOMENTS)
        like = muon_strategy(_adamw_like()) if muon else _adamw_like()
        parts.append(Part(prefix, index, saved_strategy(sub, like), as_shaped_like(target, like), "Muon" if muon else "AdamW"))
    return parts


def _adamw_like() -> PrecisionStrategy:
    """A strategy with AdamW's moments, which :func:`as_shaped_like` gives the source and target."""
    return get_strategy("D")


def source_of(common: dict, keys: set[str], given: str | None) -> tuple[PrecisionStrategy, bool]:
    """(the strategy the checkpoint's optimizer state was saved with, whether its optimizer state is
    in megatron-core's own form): the optimizer's ``lowprec`` record, else ``given`` (``--from``), else
    megatron-core's own where its FP32 masters are there."""
    optimizer = common.get("optimizer")
    form = distributed_form(common)
    if form is not None and form != MODEL_SPACE_FORM:
        raise ConvertError(unread_distributed_form(form))
    if not isinstance(optimizer, dict) or not ("lowprec" in optimizer or STOCK_FORM_KEY in optimizer):
        raise ConvertError(
            "it holds no optimizer state of an optimizer lowprec-convert reads: it converts the state of this "
            "package's AdamW and Muon and of megatron-core's own AdamW"
        )
    record = optimizer.get("lowprec")
    if given is not None:
        if record is not None:
            raise ConvertError(
                f"it records its option ({record['option']}): --from names the option of a checkpoint that records none"
            )
        try:
            strategy = resolve_target(given)
        except ValueError as error:
            raise ConvertError(f"--from: {error}") from None
        return as_shaped_like(strategy, _adamw_like()), True
    if record is not None:
        strategy = get_strategy(record["option"])
        if strategy.master_weights and record.get("master_storage") is not None:
            strategy = strategy.with_master_storage(record["master_storage"])
        return as_shaped_like(with_saved_exponent_storage(strategy, record), _adamw_like()), False
    master = DISTRIBUTED_MASTER_KEY if form == MODEL_SPACE_FORM else STOCK_MASTER_KEY
    if not any(key.startswith(f"{STATE_PREFIX}{master}.") for key in keys):
        raise ConvertError("it records no option and holds no FP32 masters of megatron-core's own optimizer: name it with --from")
    return as_shaped_like(resolve_target(STOCK), _adamw_like()), True


def _state_keys(keys: list[str], names: dict[str, str], parts: list[Part]) -> dict[str, tuple[Part, dict[str, str]]]:
    """Per parameter key, the part whose optimizer steps it and its states' keys
    (``<prefix><state>.<parameter>``) by state name, renamed by ``names`` (megatron's distributed
    optimizer's ``param``: an FP32 master)."""
    found: dict[str, tuple[Part, dict[str, str]]] = {}
    for key in keys:
        for part in parts:
            if key.startswith(part.prefix):
                state, parameter = key[len(part.prefix):].split(".", 1)
                owner, states = found.setdefault(parameter, (part, {}))
                if owner is not part:
                    raise ConvertError(f"{parameter} has states of two optimizers of its chain ({owner.label}, {part.label})")
                states[names.get(state, state)] = key
    return found


def _torch_adamw_group_defaults() -> dict[str, Any]:
    """The keys torch's AdamW (megatron-core's optimizer without Transformer Engine or apex) adds to a
    parameter group beside the learning rate, betas, epsilon and weight decay, with their defaults."""
    group = torch.optim.AdamW([torch.zeros(1)]).param_groups[0]
    return {key: value for key, value in group.items() if key not in ("params", "lr", "betas", "eps", "weight_decay")}


def converted_common(
    common: dict, target: PrecisionStrategy, to_stock: bool, from_stock: bool, to_distributed: bool = False,
) -> dict:
    """``common.pt`` with the optimizer's common part as the target's optimizer saves it and the
    app's option label (where there is one) naming the target. ``to_distributed`` (with ``to_stock``):
    megatron-core's ``DistributedOptimizer`` in :data:`MODEL_SPACE_FORM` (the step in each parameter
    group, the form named in the state and in the content metadata, which Megatron-LM's resume reads);
    a non-distributed stock target drops the content metadata's distributed-optimizer entries."""
    optimizer = common["optimizer"]
    if chain_indices(common):
        return {**common, "optimizer": {index: _option_common(sub, target) for index, sub in optimizer.items()},
                **({"option": target.name} if "option" in common else {})}
    if from_stock:
        inner = optimizer["optimizer"]
        if "state" in inner:
            step = int(inner["state"].get("common_step", 0))
        else:
            step = int(next((group["step"] for group in inner["param_groups"] if "step" in group), 0))
        dropped = {*_torch_adamw_group_defaults(), "step"}
        groups = [{key: value for key, value in group.items() if key not in dropped} for group in inner["param_groups"]]
        record = {"skipped_steps": 0, "seed": 0, "generator_state": None}
    else:
        step = int(optimizer["state"].get("common_step", 0))
        groups = optimizer["param_groups"]
        record = dict(optimizer["lowprec"])
    if to_stock and to_distributed:
        new_optimizer = {
            "optimizer": {"param_groups": [{**_torch_adamw_group_defaults(), **group, "step": float(step)} for group in groups]},
            DISTRIBUTED_FORM_KEY: MODEL_SPACE_FORM,
        }
    elif to_stock:
        new_optimizer = {"optimizer": {
            "param_groups": [{**_torch_adamw_group_defaults(), **group} for group in groups],
            "state": {"common_step": torch.tensor(float(step))},
        }}
    else:
        new_optimizer = _option_common({"param_groups": groups, "state": {"common_step": step}, "lowprec": record}, target)
    new = {**common, "optimizer": new_optimizer}
    if "option" in common:
        new["option"] = STOCK_OPTIMIZER_LABEL if to_stock else target.name
    content = dict(common.get(CONTENT_METADATA_KEY) or {})
    if to_stock and to_distributed:
        new[CONTENT_METADATA_KEY] = {**content, **DISTRIBUTED_CONTENT_METADATA}
    elif to_stock and CONTENT_METADATA_KEY in common:
        new[CONTENT_METADATA_KEY] = {key: value for key, value in content.items() if key not in DISTRIBUTED_CONTENT_METADATA}
    return new


def _option_common(optimizer: dict, target: PrecisionStrategy) -> dict:
    """One optimizer's common state (its parameter groups, step and ``lowprec`` record) with the
    record naming ``target`` and its storages."""
    record = dict(optimizer["lowprec"])
    for key in STORAGE_RECORDS:
        record.pop(key, None)
    record.update(option=target.name, master_storage=target.master_storage, **exponent_storage_record(target))
    return {**optimizer, "lowprec": record}


def _matching_chunk(metadata, key: str, chunk) -> Any:
    for candidate in metadata.state_dict_metadata[key].chunks:
        if candidate.offsets == chunk.offsets and candidate.sizes == chunk.sizes:
            return candidate
    raise ConvertError(f"{key} is not sharded like its parameter (no shard at offsets {tuple(chunk.offsets)})")


def _check_destination(destination: Path) -> None:
    if destination.exists() and (not destination.is_dir() or any(destination.iterdir())):
        raise ConvertError(f"{destination} exists and is not an empty directory: give a new path")
    if not destination.parent.is_dir():
        raise ConvertError(f"{destination.parent} (the destination's parent) is not a directory")


def _check_source(source: Path) -> None:
    if not source.is_dir():
        raise ConvertError(f"{source} is not a directory")
    if not (source / METADATA_FILE).is_file():
        raise ConvertError(f"{source} is not a torch_dist checkpoint (no {METADATA_FILE})")
    if (source / COMPLETE_FILE).is_file():
        problem = checkpoint_problem(source, share=(0, 1))
        if problem is not None:
            raise ConvertError(f"{source} is damaged: {problem}")


def convert_checkpoint(
    source: Path, destination: Path, target_name: str, source_name: str | None = None,
    progress: Callable[[str], None] | None = None, use_distributed_optimizer: bool = False,
) -> list[str]:
    """Write ``source`` (a ``torch_dist`` checkpoint) converted to ``target_name`` (an option or
    ``stock``) into ``destination`` (see the module docstring); the conversion's lines, one per
    state kind. ``use_distributed_optimizer`` (with ``stock``): in the form megatron-core's own
    ``DistributedOptimizer`` resumes (:data:`~megatron_lowprec.megatron.torch_dist.MODEL_SPACE_FORM`).
    :class:`ConvertError` (or :class:`~megatron_lowprec.megatron.torch_dist.UnsafeCheckpoint`)
    in one line where it cannot, before ``destination`` exists."""
    source, destination = Path(source).absolute(), Path(destination).absolute()
    _check_source(source)
    _check_destination(destination)
    try:
        target = resolve_target(target_name)
    except ValueError as error:
        raise ConvertError(f"--to: {error}") from None
    to_stock = target_name.lower() == STOCK
    if use_distributed_optimizer and not to_stock:
        raise ConvertError(
            f"--use-distributed-optimizer writes megatron's own DistributedOptimizer state (--to stock); option "
            f"{target.name}'s state is the same with and without the distributed optimizer: leave it out"
        )
    metadata = read_metadata(source)
    try:
        common = read_common(source, metadata)
    except (ValueError, OSError) as error:
        if isinstance(error, UnsafeCheckpoint):
            raise
        raise ConvertError(f"{source}: its common state cannot be read ({error})") from None
    keys = list(metadata.state_dict_metadata)
    if chain_indices(common):
        parts, from_stock = _chain_parts(common, set(keys), target, to_stock, source_name), False
    else:
        saved, from_stock = source_of(common, set(keys), source_name)
        parts = [Part(STATE_PREFIX, None, saved, as_shaped_like(target, _adamw_like()), "")]
    names = {DISTRIBUTED_MASTER_KEY: STOCK_MASTER_KEY} if distributed_form(common) == MODEL_SPACE_FORM else {}
    states = _state_keys(keys, names, parts)
    missing = sorted(parameter for parameter in states if parameter not in metadata.state_dict_metadata)
    if missing:
        raise ConvertError(f"optimizer states without their parameter in the checkpoint: {', '.join(missing[:3])}")
    partial = destination.with_name(f".{destination.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    try:
        new_common = converted_common(common, target, to_stock, from_stock, use_distributed_optimizer)
        master_key = DISTRIBUTED_MASTER_KEY if use_distributed_optimizer else STOCK_MASTER_KEY
        reports = _write(source, partial, metadata, states, parts, to_stock, from_stock, progress, new_common, master_key)
        if (source / COMMON_FILE).is_file():
            torch.save(new_common, partial / COMMON_FILE)
        for name in sorted(os.listdir(source)):
            copied = name not in (METADATA_FILE, COMMON_FILE, COMPLETE_FILE) and not name.endswith(".distcp")
            if copied and (source / name).is_file():
                shutil.copy2(source / name, partial / name)
        _complete(source, partial)
        if destination.exists():
            destination.rmdir()
        os.rename(partial, destination)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return [
        f"{part.label}: {line}" if part.label else line for part, report in zip(parts, reports) for line in report.lines()
    ]


def _write(source, partial, metadata, states, parts, to_stock, from_stock, progress, common, master_key) -> list[ConversionReport]:
    writer = ShardWriter(partial, metadata)
    common_index = None if (source / COMMON_FILE).is_file() else common_object_index(metadata)
    if common_index is not None:
        writer.write_object(common_index, metadata.state_dict_metadata[common_index.fqn], common)
    reports = {
        part: ConversionReport(part.saved, part.target, STOCK if from_stock else None, STOCK if to_stock else None)
        for part in parts
    }
    renamed = {MASTER_KEYS["fp32"]: master_key} if to_stock else {}
    state_keys = {key for _, keys in states.values() for key in keys.values()}
    total = len(metadata.state_dict_metadata)
    started = shown = time.monotonic()
    for done, key in enumerate(metadata.state_dict_metadata):
        if key in state_keys or (common_index is not None and key == common_index.fqn):
            continue
        entry = metadata.state_dict_metadata[key]
        if key not in states or not is_tensor_entry(entry):
            writer.copy(source, metadata, key)
            continue
        part, state_keys_of = states[key]
        for chunk in entry.chunks:
            param = read_chunk(source, metadata, key, chunk)
            saved_state = {
                name: read_chunk(source, metadata, state_key, _matching_chunk(metadata, state_key, chunk)).reshape(-1)
                for name, state_key in state_keys_of.items()
            }
            try:
                new_param, new_state, errors = convert_entry(part.saved, part.target, param.reshape(-1), saved_state)
            except (KeyError, ValueError) as error:
                raise ConvertError(
                    f"{key}: its states ({', '.join(sorted(saved_state))}) are not option {part.saved.name}'s ({error}); "
                    "name the option it was saved with by --from"
                ) from None
            del saved_state
            reports[part].add(param, errors)
            tensors = {name: value.reshape(-1) for name, value in new_state.items() if torch.is_tensor(value)}
            form = checkpoint_state(tensors, param.numel(), part.target, param=new_param)
            writer.write_chunk(key, new_param.view(param.shape), chunk.offsets, entry.size)
            for name, value in form.items():
                writer.write_chunk(f"{part.prefix}{renamed.get(name, name)}.{key}", value.view(param.shape), chunk.offsets, entry.size)
            del param, new_param, new_state, tensors, form
        if progress is not None and time.monotonic() - shown > 1.0:
            shown = time.monotonic()
            progress(f"{done + 1}/{total} keys, {shown - started:.0f} s")
    writer.close()
    if progress is not None:
        progress(f"{total}/{total} keys, {time.monotonic() - started:.0f} s")
    return [reports[part] for part in parts]


def _complete(source: Path, partial: Path) -> None:
    """``complete.json`` for ``partial`` (every file with its size and checksum; the source's
    iteration and world size), then every file verified against it."""
    marker = {}
    if (source / COMPLETE_FILE).is_file():
        marker = {key: value for key, value in json.loads((source / COMPLETE_FILE).read_text()).items() if key != "files"}
    marker["files"] = file_entries(partial, checkpoint_files(partial))
    (partial / COMPLETE_FILE).write_text(json.dumps(marker, indent=1))
    problem = checkpoint_problem(partial, share=(0, 1))
    if problem is not None:
        raise ConvertError(f"the converted checkpoint does not verify: {problem}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lowprec-convert",
        description="Convert a torch_dist checkpoint's optimizer state to another precision option, or to megatron-core's own (stock).",
    )
    parser.add_argument("source", type=Path, help="the checkpoint directory to read (never written)")
    parser.add_argument("destination", type=Path, help="a new path or an empty directory to write the converted checkpoint into")
    parser.add_argument("--to", required=True, dest="target", help="the target option's name, or 'stock'")
    parser.add_argument("--from", dest="source_option", default=None,
                        help="the source's option where the checkpoint records none ('stock' for megatron-core's own)")
    parser.add_argument("--use-distributed-optimizer", action="store_true",
                        help="with --to stock: write megatron-core's DistributedOptimizer state (form 'fully_reshardable'), "
                             "for Megatron-LM runs with --use-distributed-optimizer")
    args = parser.parse_args(argv)

    def say(line: str) -> None:
        print(f"lowprec-convert: {line}", file=sys.stderr, flush=True)

    try:
        lines = convert_checkpoint(args.source, args.destination, args.target, args.source_option, progress=say,
                                   use_distributed_optimizer=args.use_distributed_optimizer)
    except (ConvertError, UnsafeCheckpoint, OSError) as error:
        print(f"lowprec-convert: {error}", file=sys.stderr)
        return EXIT_USAGE
    for line in lines:
        print(f"lowprec-convert: {line}", flush=True)
    print(f"lowprec-convert: wrote {args.destination}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
