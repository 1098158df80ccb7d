"""Reading a checkpoint without running anything stored in it.

torch.distributed.checkpoint keeps a checkpoint's index in ``.metadata``, a pickle, and its
reader loads it with the full unpickler; its default load planner also unpickles the
non-tensor items (the optimizer's learning rate, betas, ...) with
``torch.load`` with ``weights_only=False``. A run dir is what people copy between machines, so a
planted ``.metadata`` would run code on ``--resume``. Here:

- :func:`read_metadata` unpickles ``.metadata`` with an allow-list of exactly the classes DCP
  writes there (its metadata dataclasses, ``torch.Size``, dtypes, layouts, memory formats,
  paths); any other global, and any persistent id, is refused before it is looked up. The
  file's size is bounded before it is read, and the result is checked: every storage file it
  names is a plain name inside the checkpoint dir, a regular file, and long enough for the
  byte ranges read from it.
- :class:`SafeReader` is a ``FileSystemReader`` that reads its metadata that way;
  :class:`SafePlanner` loads non-tensor items with the weights-only unpickler, and refuses
  a checkpoint whose items are of another kind (bytes vs tensor) than the state they fill.
"""

from __future__ import annotations

import io
import pathlib
import pickle
import stat
from pathlib import Path

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint import metadata as md
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.filesystem import _StorageInfo

MAX_METADATA_BYTES = 256 * 2**20
_CLASSES = {(c.__module__, c.__qualname__): c for c in (
    md.Metadata, md.TensorStorageMetadata, md.BytesStorageMetadata, md.ChunkStorageMetadata, md.TensorProperties,
    md._MEM_FORMAT_ENCODING, md.StorageMeta, md.MetadataIndex, _StorageInfo, torch.Size, pathlib.PosixPath,
    pathlib.PurePosixPath)}
_CLASSES[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
# dtypes and memory formats by name, from torch's own namespace dict (a getattr could import a submodule)
_TORCH_VALUES = {k: v for k, v in vars(torch).items() if isinstance(v, (torch.dtype, torch.memory_format))}


class CheckpointUnreadable(ValueError):
    """A checkpoint's ``.metadata`` is not what DCP writes (damaged, or crafted): the reason, one line."""


class _RestrictedUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only the allow-listed globals and torch's dtypes / memory formats."""

    def find_class(self, module: str, name: str):
        if (module, name) in _CLASSES:
            return _CLASSES[(module, name)]
        if module == "torch" and name in _TORCH_VALUES:
            return _TORCH_VALUES[name]
        raise CheckpointUnreadable(f".metadata names {module[:60]}.{name[:60]}, which a checkpoint never holds")

    def persistent_load(self, pid):
        raise CheckpointUnreadable(".metadata holds a persistent id, which a checkpoint never holds")


def _regular_size(path: Path) -> int | None:
    try:
        st = path.lstat()
    except OSError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def _unpickle(path: Path):
    size = _regular_size(path)
    if size is None:
        raise CheckpointUnreadable(f"{path.name} is missing or not a regular file")
    if size > MAX_METADATA_BYTES:
        raise CheckpointUnreadable(f"{path.name} is {size} bytes, over the {MAX_METADATA_BYTES} a checkpoint index needs")
    with open(path, "rb") as f:
        data = f.read(MAX_METADATA_BYTES + 1)
    try:
        return _RestrictedUnpickler(io.BytesIO(data)).load()
    except CheckpointUnreadable:
        raise
    except (Exception, RecursionError) as e:  # a damaged pickle: every kind of unpickling error
        raise CheckpointUnreadable(f"{path.name} cannot be read ({type(e).__name__})") from None


def _plain_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _check_storage(root: Path, storage: dict) -> None:
    """Every byte range names a plain file of the checkpoint dir that holds it."""
    sizes: dict[str, int | None] = {}
    for index, info in storage.items():
        if not isinstance(index, md.MetadataIndex) or not isinstance(info, _StorageInfo):
            raise CheckpointUnreadable(".metadata's storage entries are not DCP's")
        name = info.relative_path
        if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", "..") or "\0" in name:
            raise CheckpointUnreadable(f".metadata names the storage file {name!r:.80}, not a file of the checkpoint dir")
        if not (_plain_int(info.offset) and _plain_int(info.length)):
            raise CheckpointUnreadable(f".metadata gives {name} a byte range that is not two non-negative integers")
        if info.transform_descriptors:
            raise CheckpointUnreadable(f".metadata asks for stream transforms on {name}, which prunus never writes")
        if name not in sizes:
            sizes[name] = _regular_size(root / name)
        if sizes[name] is None or sizes[name] < info.offset + info.length:
            raise CheckpointUnreadable(f"{name} is missing or shorter than .metadata says")


def _check_items(meta) -> None:
    items = meta.state_dict_metadata
    if not isinstance(items, dict) or not all(isinstance(k, str) for k in items):
        raise CheckpointUnreadable(".metadata's item index is not a mapping of names")
    for name, item in items.items():
        if isinstance(item, md.TensorStorageMetadata):
            if not isinstance(item.size, torch.Size) or not all(isinstance(c, md.ChunkStorageMetadata) for c in item.chunks):
                raise CheckpointUnreadable(f".metadata's entry for {name[:80]} is not a tensor's")
        elif not isinstance(item, md.BytesStorageMetadata):
            raise CheckpointUnreadable(f".metadata's entry for {name[:80]} is neither a tensor nor a value")
    planner = meta.planner_data
    if planner is not None and not (isinstance(planner, dict) and all(
            isinstance(v, (tuple, list)) and all(isinstance(p, (str, int)) for p in v) for v in planner.values())):
        raise CheckpointUnreadable(".metadata's planner data is not a mapping of name paths")


def read_metadata(checkpoint: str | Path, rank: int | None = None):
    """The checkpoint's DCP ``Metadata``, unpickled with the allow-list and checked against the dir's files."""
    root = Path(checkpoint)
    meta = _unpickle(root / (".metadata" if rank is None else f"__{rank}.metadata"))
    if not isinstance(meta, md.Metadata):
        raise CheckpointUnreadable(".metadata does not hold a checkpoint index")
    if not isinstance(meta.storage_data, dict):
        raise CheckpointUnreadable(".metadata has no storage index")
    _check_items(meta)
    _check_storage(root, meta.storage_data)
    if getattr(meta, "storage_meta", None) is None:
        meta.storage_meta = md.StorageMeta()
    return meta


class SafeReader(FileSystemReader):
    """DCP's file reader, its metadata read by :func:`read_metadata` (no full unpickler)."""

    def __init__(self, path: str | Path):
        super().__init__(str(path))
        self._root = Path(path)

    def read_metadata(self, *args, **kwargs):
        meta = read_metadata(self._root, kwargs.get("rank"))
        meta.storage_meta.load_id = self.load_id
        return meta


class SafePlanner(DefaultLoadPlanner):
    """DCP's default load planner, with values (non-tensor items) read by the weights-only unpickler."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        for name, value in self.state_dict.items():
            item = (metadata.state_dict_metadata if metadata is not None else {}).get(name)
            if item is not None and isinstance(item, md.BytesStorageMetadata) == isinstance(value, torch.Tensor):
                kind = "a tensor" if isinstance(value, torch.Tensor) else "a value"
                raise CheckpointUnreadable(f".metadata stores {name[:80]} as another kind than {kind}")

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except Exception as e:  # weights-only refusals and damaged bytes alike
            raise CheckpointUnreadable(f"the value of {read_item.dest_index.fqn[:80]} cannot be read "
                                       f"({type(e).__name__})") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
