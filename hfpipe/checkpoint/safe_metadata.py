"""Reading a DCP checkpoint's ``.metadata`` without running code from it.

torch DCP writes ``.metadata`` with plain pickle and its ``FileSystemReader.read_metadata`` loads it
with plain ``pickle.load``: a crafted file runs any code on export or resume. Here the same bytes go
through an unpickler that builds only DCP's own metadata classes, torch dtypes/sizes/layouts, paths
and plain containers; anything else is refused in one line naming the file. :class:`SafeReader` is
a ``FileSystemReader`` that reads metadata this way, so ``dcp.load(..., storage_reader=...)`` never
reaches torch's unrestricted read. Every checkpoint hfpipe opens goes through here.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from hfpipe.errors import HfpipeError

__all__ = ["UnsafeMetadataError", "SafeReader", "read_metadata"]

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
    """A ``.metadata`` file is unreadable or asks to build something that is not DCP metadata."""


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

    Pass it as ``dcp.load(..., storage_reader=SafeReader(path))``; torch's own reader would unpickle
    ``.metadata`` with plain pickle.
    """

    def read_metadata(self, *args, **kwargs) -> Metadata:
        rank = kwargs.get("rank")
        metadata = read_metadata(Path(str(self._get_metadata_path(rank))))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
