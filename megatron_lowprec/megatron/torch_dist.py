"""Reading and writing megatron's ``torch_dist`` checkpoints one shard at a time, without running code.

A ``torch_dist`` checkpoint (``dist_checkpointing`` with its default backend) is a directory of
``torch.distributed.checkpoint`` files: ``.metadata`` (a pickled ``Metadata``: per key, its dtype,
global shape and chunks, and where each chunk's bytes lie), ``__<rank>_<n>.distcp`` (each chunk a
``torch.save`` of the shard at its offset), the common state (what is not sharded: the iteration,
the optimizer's parameter groups and step, Megatron-LM's arguments...: ``common.pt``, or from
megatron-core 0.19 an object ``common_state`` among the shards) and ``metadata.json`` (the backend's name).

``torch.distributed.checkpoint`` unpickles ``.metadata`` with ``pickle.load``, which runs whatever a
crafted file asks for. :func:`read_metadata` unpickles it allowing only the classes such a file
holds (:data:`METADATA_GLOBALS`); each shard and the common state are read with ``weights_only=True``
(the common state with megatron-core's own allowlist, :func:`common_globals`).
:class:`ShardWriter` writes a checkpoint shard by shard in the same format, so that a conversion
holds one shard in memory at a time.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch

METADATA_FILE = ".metadata"
COMMON_FILE = "common.pt"
SHARD_FILE = "__0_0.distcp"

STOCK_FORM_KEY = "optimizer"
"""Where megatron-core's own ``Float16OptimizerWithFloat16Params`` keeps the torch optimizer's state
dict (parameter groups and shared step) in its state dict, beside its FP32 masters."""

DISTRIBUTED_FORM_KEY = "param_state_sharding_type"
"""The key of megatron-core's own ``DistributedOptimizer`` state dict that names the form its states
are saved in (:data:`MODEL_SPACE_FORM` or, by bucket, ``dp_reshardable`` and older forms)."""

MODEL_SPACE_FORM = "fully_reshardable"
"""The form of megatron-core's ``DistributedOptimizer`` state that holds, per parameter, its FP32
master under :data:`DISTRIBUTED_MASTER_KEY`, ``exp_avg`` and ``exp_avg_sq``, each shaped and sharded
like the parameter (Megatron-LM's ``--dist-ckpt-optim-fully-reshardable``); its step is in its
parameter groups."""

DISTRIBUTED_MASTER_KEY = "param"
"""The state name of the FP32 master in :data:`MODEL_SPACE_FORM` (``optimizer.state.param.<parameter>``)."""

CONTENT_METADATA_KEY = "content_metadata"
"""Where ``dist_checkpointing.save(..., content_metadata=...)`` keeps its metadata in the common state:
Megatron-LM's resume reads the distributed optimizer's form from its ``distrib_optim_sharding_type``."""


def distributed_form(common: dict) -> str | None:
    """The form megatron-core's own ``DistributedOptimizer`` saved its state in, by the checkpoint's
    common state (:data:`MODEL_SPACE_FORM`, ``dp_reshardable``...); ``None`` for any other optimizer's."""
    optimizer = common.get("optimizer")
    if isinstance(optimizer, dict) and DISTRIBUTED_FORM_KEY in optimizer and "lowprec" not in optimizer:
        return str(optimizer[DISTRIBUTED_FORM_KEY])
    return None


def stock_step(stock: dict) -> int:
    """The step of a checkpoint of megatron-core's own optimizer, from the torch optimizer state it
    saved (:data:`STOCK_FORM_KEY`): its shared step, or, in :data:`MODEL_SPACE_FORM`, the step its
    ``DistributedOptimizer`` keeps in each parameter group."""
    if "state" in stock:
        return int(stock["state"]["common_step"])
    return int(next(group["step"] for group in stock["param_groups"] if "step" in group))


def unread_distributed_form(form: str) -> str:
    """Why megatron's ``DistributedOptimizer`` state in ``form`` does not convert (by gradient bucket,
    its layout is the gradient buffer's, which the checkpoint does not record), and which save does."""
    return (
        f"it holds megatron's DistributedOptimizer state in form {form!r}, which holds no per-parameter states "
        f"(Megatron-LM's default with --use-distributed-optimizer stores them by gradient bucket): it converts "
        f"once saved with Megatron-LM's --dist-ckpt-optim-fully-reshardable (form {MODEL_SPACE_FORM!r})"
    )


METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
}
"""The classes a ``.metadata`` file may build (by module), beside torch's dtypes."""


class UnsafeCheckpoint(ValueError):
    """A checkpoint file that asks to build an object outside its allowlist."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in METADATA_GLOBALS.get(module, ()) or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise UnsafeCheckpoint(f"{module}.{name}")


def read_metadata(directory: Path):
    """The ``torch.distributed.checkpoint`` ``Metadata`` of ``directory``, unpickled with
    :data:`METADATA_GLOBALS` only; :class:`UnsafeCheckpoint` naming the file and the object otherwise."""
    path = Path(directory) / METADATA_FILE
    with path.open("rb") as file:
        try:
            return _MetadataUnpickler(file).load()
        except UnsafeCheckpoint as error:
            raise UnsafeCheckpoint(
                f"{path}: refused to unpickle it, a checkpoint's metadata holds only torch.distributed.checkpoint's "
                f"records ({error} is not one)"
            ) from None


COMMON_OBJECT = "common_state"
"""The key under which megatron-core from 0.19 keeps ``common.pt``'s content inside the checkpoint."""


def common_globals() -> list:
    """What a checkpoint's common state may hold beside tensors and plain containers: megatron-core's
    own allowlist (``megatron.core.safe_globals``: Megatron-LM's ``args`` as an ``argparse.Namespace``,
    paths, numpy arrays...) and the enums of megatron-core's configuration, which ``args`` holds."""
    import enum
    import importlib

    allowed = []
    try:
        allowed += importlib.import_module("megatron.core.safe_globals").SAFE_GLOBALS
    except ImportError:
        pass
    for name in ("megatron.core.transformer.enums", "megatron.core.enums", "megatron.core.rerun_state_machine"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        allowed += [value for value in vars(module).values()
                    if isinstance(value, type) and issubclass(value, enum.Enum) and value.__module__ == name]
    return allowed


def _load_common_bytes(source, name: str) -> Any:
    try:
        with torch.serialization.safe_globals(common_globals()):
            return torch.load(source, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as error:
        refused = next((line.strip() for line in str(error).splitlines() if "GLOBAL" in line or "Unsupported" in line), "")
        raise UnsafeCheckpoint(
            f"{name}: refused to unpickle it, it holds objects other than tensors, plain containers and "
            f"megatron-core's allowlisted types ({refused})"
        ) from None


def common_object_index(metadata) -> Any:
    """The storage index of the common state kept inside the checkpoint, or ``None`` (``common.pt``)."""
    return next((index for index in metadata.storage_data if index.fqn.split("/")[0] == COMMON_OBJECT), None)


def read_common(directory: Path, metadata) -> dict:
    """The checkpoint's common state: ``common.pt``, or the object megatron-core 0.19 keeps it in;
    unpickled with ``weights_only=True`` and :func:`common_globals`."""
    path = Path(directory) / COMMON_FILE
    if path.is_file():
        return _load_common_bytes(path, str(path))
    index = common_object_index(metadata)
    if index is None:
        raise ValueError(f"{directory} holds neither {COMMON_FILE} nor a {COMMON_OBJECT} object")
    loaded = _load_common_bytes(io.BytesIO(read_bytes(directory, metadata.storage_data[index])), f"{directory}: {index.fqn}")
    return loaded[0] if isinstance(loaded, list) else loaded


def is_tensor_entry(entry: Any) -> bool:
    return hasattr(entry, "chunks") and hasattr(entry, "properties")


def _storage(metadata, key: str, chunk) -> Any:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    return metadata.storage_data[MetadataIndex(key, chunk.offsets)]


def read_bytes(directory: Path, info) -> bytes:
    """The stored bytes that ``info`` (a ``_StorageInfo``) points at."""
    with (Path(directory) / info.relative_path).open("rb") as file:
        file.seek(info.offset)
        data = file.read(info.length)
    if len(data) != info.length:
        raise ValueError(f"{info.relative_path} ends before its {info.length} bytes at offset {info.offset}")
    return data


def read_chunk(directory: Path, metadata, key: str, chunk) -> torch.Tensor:
    """One stored shard of ``key`` (a chunk of its ``TensorStorageMetadata``), ``weights_only=True``."""
    info = _storage(metadata, key, chunk)
    if getattr(info, "transform_descriptors", None):
        raise ValueError(f"{key}: stored with transforms {info.transform_descriptors}, which this reader does not undo")
    return torch.load(io.BytesIO(read_bytes(directory, info)), weights_only=True, map_location="cpu")


class ShardWriter:
    """A ``torch_dist`` checkpoint written shard by shard into ``directory`` (one data file): shards
    given as tensors or copied as their stored bytes, then :meth:`close` writes ``.metadata``."""

    def __init__(self, directory: Path, like) -> None:
        self.directory = Path(directory)
        self.like = like
        self.file = (self.directory / SHARD_FILE).open("wb")
        self.entries: dict[str, Any] = {}
        self.storage: dict[Any, Any] = {}

    def _record(self, key: str, entry, index, data: bytes, transform_descriptors=None) -> None:
        from torch.distributed.checkpoint.filesystem import _StorageInfo

        offset = self.file.tell()
        self.file.write(data)
        self.storage[index] = _StorageInfo(SHARD_FILE, offset, len(data), transform_descriptors=transform_descriptors)
        self.entries.setdefault(key, entry)

    def copy(self, source: Path, metadata, key: str) -> None:
        """Every stored piece of ``key`` as it is in the checkpoint ``source`` (bytes, not values)."""
        for index, info in metadata.storage_data.items():
            if index.fqn == key:
                self._record(key, metadata.state_dict_metadata[key], index, read_bytes(source, info),
                             getattr(info, "transform_descriptors", None))

    def write_object(self, index, entry, value: Any) -> None:
        """``value`` stored as a ``torch.save`` of ``[value]`` at ``index``, as megatron-core stores an object."""
        buffer = io.BytesIO()
        torch.save([value], buffer)
        self._record(index.fqn, entry, index, buffer.getvalue())

    def write_chunk(self, key: str, tensor: torch.Tensor, offsets: torch.Size, global_size: torch.Size) -> None:
        """``tensor``, the shard of ``key`` (global shape ``global_size``) at ``offsets``."""
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata, MetadataIndex, TensorProperties, TensorStorageMetadata,
        )

        tensor = tensor.detach().cpu().contiguous()
        entry = self.entries.get(key)
        if entry is None:
            entry = TensorStorageMetadata(TensorProperties(dtype=tensor.dtype), torch.Size(global_size), [])
        elif entry.properties.dtype != tensor.dtype or entry.size != torch.Size(global_size):
            raise ValueError(f"{key}: a shard of {tensor.dtype} {tuple(global_size)} beside {entry.properties.dtype} {tuple(entry.size)}")
        entry.chunks.append(ChunkStorageMetadata(torch.Size(offsets), tensor.shape))
        buffer = io.BytesIO()
        torch.save(tensor, buffer)
        self._record(key, entry, MetadataIndex(key, torch.Size(offsets), len(entry.chunks) - 1), buffer.getvalue())

    def close(self) -> None:
        """Flush the data file to disk and write ``.metadata`` (the source's, with these keys)."""
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        changes = {"state_dict_metadata": self.entries, "storage_data": self.storage}
        fields = {field.name for field in dataclasses.fields(self.like)}
        changes.update({name: None for name in ("planner_data", "all_local_plans") if name in fields})
        with (self.directory / METADATA_FILE).open("wb") as file:
            pickle.dump(dataclasses.replace(self.like, **changes), file)
            file.flush()
            os.fsync(file.fileno())
