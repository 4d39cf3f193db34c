"""Reading a DCP checkpoint without running code from it, and only the bytes that were saved.

torch DCP writes ``.metadata`` with plain pickle and its ``FileSystemReader.read_metadata`` loads it
with plain ``pickle.load``: a crafted file runs any code on export or resume. Here the same bytes go
through an unpickler that builds only DCP's own metadata classes, torch dtypes/sizes/layouts, paths
and plain containers; anything else is refused in one line naming the file. :class:`SafeReader` is
a ``FileSystemReader`` that reads metadata this way, so ``dcp.load(..., storage_reader=...)`` never
reaches torch's unrestricted read.

Non-tensor items (optimizer param groups: lr, betas, ...) are pickled into the ``.distcp`` files,
and DCP's ``DefaultLoadPlanner.load_bytes`` reads them with ``torch.load``, ``weights_only`` off: a
crafted item runs code on resume. :class:`SafeLoadPlanner` reads them with ``weights_only=True``
(plain data and tensors only) and :class:`SafeReader` refuses to serve any other planner. It also
checks every item it reads against the checksums recorded at save (:mod:`.checksums`).
Every checkpoint hfpipe opens goes through here: :func:`safe_load` is the one ``dcp.load`` call.
"""

from __future__ import annotations

import io
import pickle
import re
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, Metadata, MetadataIndex, StorageMeta,
                                                    TensorStorageMetadata)

from hfpipe.checkpoint.checksums import Checksums
from hfpipe.errors import HfpipeError

__all__ = ["UnsafeMetadataError", "SafeLoadPlanner", "SafeReader", "check_byte_items", "load_item", "read_metadata",
           "safe_load"]

_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
        "BytesStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "builtins": {"set", "frozenset", "tuple", "list", "dict"},
    "collections": {"OrderedDict"},
    "torch.serialization": {"_get_layout"},  # name -> torch.layout, as torch's weights_only load
}
_MAX_BYTES = 1 << 30  # a metadata file for 1e7 tensors is ~2 GB only in theory; refuse absurd ones


class UnsafeMetadataError(HfpipeError):
    """A ``.metadata`` file (or a stored item) is unreadable or asks to build something that is not data."""


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing {module}.{name}")


def read_metadata(path: str | Path) -> Metadata:
    """DCP's ``Metadata`` of the checkpoint folder (or ``.metadata`` file) ``path``, read safely.

    Raises:
        UnsafeMetadataError: missing, unreadable, not DCP metadata, or a forbidden class inside.
    """
    path = Path(path)
    file = path / ".metadata" if path.is_dir() else path
    try:
        if file.stat().st_size > _MAX_BYTES:
            raise UnsafeMetadataError(f"{file}: {file.stat().st_size} bytes is too large for DCP metadata; "
                                      "pick an earlier checkpoint")
        data = file.read_bytes()
    except OSError as e:
        raise UnsafeMetadataError(f"{file}: cannot read ({e.strerror}); pick an earlier checkpoint") from None
    try:
        metadata = _Unpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as e:
        if str(e).startswith("refusing "):
            raise UnsafeMetadataError(
                f"{file}: not a DCP checkpoint's metadata ({e}); hfpipe never runs code from a checkpoint: "
                "delete it or pick another checkpoint") from None
        raise UnsafeMetadataError(f"{file}: corrupt DCP metadata ({e}); pick an earlier checkpoint") from None
    except Exception as e:  # truncated or garbage bytes raise many types
        raise UnsafeMetadataError(f"{file}: corrupt DCP metadata ({type(e).__name__}); "
                                  "pick an earlier checkpoint") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise UnsafeMetadataError(f"{file}: holds a {type(metadata).__name__}, not DCP metadata; "
                                  "pick an earlier checkpoint")
    _check_data_files(file, metadata)
    return metadata


def _check_data_files(file: Path, metadata: Metadata) -> None:
    """Data files must be plain names inside the checkpoint folder (no ``../`` or absolute paths)."""
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", ".."):
            raise UnsafeMetadataError(f"{file}: names data file {name!r} outside the checkpoint folder; "
                                      "not an hfpipe checkpoint: pick another checkpoint")


class SafeReader(FileSystemReader):
    """torch's ``FileSystemReader`` whose metadata read is :func:`read_metadata`.

    It serves only a :class:`SafeLoadPlanner` (torch's planners unpickle byte items freely), and
    checks every item against the checkpoint's checksums before DCP reads it.
    """

    def __init__(self, path, *args, checksums: Checksums | None | bool = False, **kwargs) -> None:
        super().__init__(path, *args, **kwargs)
        self._checksums = checksums  # False: load the folder's record when first needed

    def read_metadata(self, *args, **kwargs) -> Metadata:
        rank = kwargs.get("rank")
        metadata = read_metadata(Path(str(self._get_metadata_path(rank))))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        if not isinstance(planner, SafeLoadPlanner):
            raise TypeError("SafeReader serves only a SafeLoadPlanner: other planners unpickle byte items "
                            "freely; call hfpipe.checkpoint.safe_metadata.safe_load")
        if self._checksums is False:
            self._checksums = Checksums.load(self.path)
        if self._checksums is not None:
            seen = set()
            for item in plan.items:
                info = self.storage_data[item.storage_index]
                if (info.relative_path, info.offset) not in seen:
                    seen.add((info.relative_path, info.offset))
                    self._checksums.check(item.storage_index.fqn, info)
        return super().read_data(plan, planner)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that byte items are read as data, never run as code.

    A byte item is loaded with ``torch.load(weights_only=True)``: plain values, containers and
    tensors, nothing else. An item stored as bytes where this process holds a tensor is refused
    too (a crafted ``.metadata`` can declare any key as bytes).
    """

    def __init__(self, where: str | Path = "", **kwargs) -> None:
        super().__init__(**kwargs)
        self.where = where

    def load_bytes(self, read_item, value) -> None:
        fqn = read_item.dest_index.fqn
        if isinstance(self.state_dict.get(fqn), torch.Tensor):
            raise UnsafeMetadataError(f"checkpoint {self.where}: {fqn} is stored as bytes where a tensor "
                                      "belongs; not an hfpipe checkpoint: pick another checkpoint")
        obj = load_item(fqn, value, self.where)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner uses

            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def load_item(fqn: str, value: io.BytesIO, where: str | Path = ""):
    """A byte item's value, unpickled with torch's ``weights_only`` rules.

    Raises:
        UnsafeMetadataError: the item names a class or function outside those rules, or is corrupt.
    """
    try:
        return torch.load(value, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # weights_only refused a global or an opcode
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = f"refusing {found.group(1)}" if found else "a pickle of more than plain data"
        raise UnsafeMetadataError(f"checkpoint {where}: stored item {fqn} is not plain data ({what}); hfpipe never runs code "
                                  "from a checkpoint: pick another checkpoint") from None
    except Exception as e:  # noqa: BLE001 - a bad zip (RuntimeError), truncated bytes (EOFError), ...
        what = str(e).split(". ")[0][:100] or type(e).__name__
        raise UnsafeMetadataError(f"checkpoint {where}: stored item {fqn} is corrupt ({what}); pick an earlier checkpoint") from None


def check_byte_items(path: Path, checksums: Checksums | None) -> None:
    """Read every byte item of checkpoint ``path`` as :func:`load_item` does, checked against ``checksums``.

    They are small (optimizer param groups), so a reader checks them all when it opens a
    checkpoint: a tampered or damaged one is named before anything else is read.

    Raises:
        UnsafeMetadataError: an item that is not plain data, or a data file that cannot be read.
        DamagedCheckpointError: an item that fails its checksum.
    """
    metadata = read_metadata(path)
    by_file: dict[str, list] = {}
    for index, info in metadata.storage_data.items():
        if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            by_file.setdefault(info.relative_path, []).append((index.fqn, info))
    for name, items in sorted(by_file.items()):
        try:
            f = open(Path(path) / name, "rb")  # noqa: SIM115 - closed below
        except OSError as e:
            raise UnsafeMetadataError(f"checkpoint {path}: data file {name} is missing or unreadable "
                                      f"({e.strerror}); pick an earlier checkpoint") from None
        with f:
            for fqn, info in items:
                if checksums is not None:
                    checksums.check(fqn, info)
                f.seek(info.offset)
                load_item(fqn, io.BytesIO(f.read(info.length)), path)


def safe_load(state: dict, path: str | Path, checksums: Checksums | None | bool = False, **kwargs) -> None:
    """``dcp.load(state)`` from ``path`` through :class:`SafeReader` and :class:`SafeLoadPlanner`.

    ``checksums``: the folder's record if already loaded (or None: none), else it is read from ``path``.

    Raises:
        ValueError: hfpipe's own one-line error from a rank (unsafe item, damaged bytes), unwrapped
            from DCP's ``CheckpointException``.
    """
    try:
        dcp.load(state, storage_reader=SafeReader(path, checksums=checksums), planner=SafeLoadPlanner(path),
                 **kwargs)
    except CheckpointException as e:
        ours = [exc for exc, _ in e.failures.values() if isinstance(exc, ValueError)
                and type(exc).__module__.startswith("hfpipe.")]
        if ours:
            raise ours[0] from None
        raise


# --- whole tensors out of a DCP folder (once hfpipe/checkpoint/dcp_reader.py; here, with the safe reads
# it stands on, so that the checkpoint package stays few floors deep) ---

try:  # DCP's bounded view of one item inside a .distcp file; private, so fall back to dcp.load
    from torch.distributed.checkpoint.filesystem import _create_file_view
except ImportError:  # pragma: no cover
    _create_file_view = None


class _DcpReader:
    """Whole model tensors out of a DCP folder, one at a time, without a process group.

    ``dcp.load`` into a pre-allocated tensor holds two copies at once (DCP's ``torch.load`` of the
    item, then ``copy_`` into the target): measured 2.0x the tensor's size in peak RSS. An item that
    is a whole, untransformed tensor (any single-process or pp-only save) is read here with one
    ``torch.load`` of its byte range (1.0x); sharded (FSDP) or transformed items go through
    ``dcp.load``, which reassembles them by FQN. ``file_view`` is DCP's ``_create_file_view``, or
    None to always use ``dcp.load``. Every item is checked against the checkpoint's checksums
    (``checksums``; a checkpoint without them is refused as damaged) before it is used,
    and every byte item (optimizer param groups, never read here) once on opening: a checkpoint
    with a crafted or damaged one is refused as a whole.
    """

    def __init__(self, ckpt: Path, file_view=_create_file_view):
        self.path = ckpt
        self.file_view = file_view
        self.checksums = Checksums.load(ckpt)  # first: a damaged .metadata is named as such
        self.metadata = read_metadata(ckpt)  # never torch's plain-pickle read
        check_byte_items(ckpt, self.checksums)  # a tampered checkpoint is refused as a whole

    def tensors(self, prefix: str) -> dict[str, TensorStorageMetadata]:
        """Metadata of the tensors whose key starts with ``prefix``, keyed without it."""
        return {
            k[len(prefix) :]: md
            for k, md in self.metadata.state_dict_metadata.items()
            if k.startswith(prefix) and isinstance(md, TensorStorageMetadata)
        }

    def read(self, key: str) -> torch.Tensor:
        md = self.metadata.state_dict_metadata[key]
        info = self.metadata.storage_data[MetadataIndex(key, md.chunks[0].offsets)]
        if len(md.chunks) == 1 and not info.transform_descriptors and self.file_view is not None:
            if self.checksums is not None:
                self.checksums.check(key, info)
            with open(self.path / info.relative_path, "rb") as f:
                view = self.file_view(f, info.offset, info.length)
                tensor = torch.load(view, map_location="cpu", weights_only=True)
            if tensor.shape == md.size and tensor.dtype == md.properties.dtype:
                return tensor if tensor.untyped_storage().nbytes() == tensor.nbytes else tensor.clone()
        target = {key: torch.empty(md.size, dtype=md.properties.dtype)}
        with warnings.catch_warnings():  # "...assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            safe_load(target, self.path, self.checksums, no_dist=True)  # checks each item's checksum
        return target[key]
