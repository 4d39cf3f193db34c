"""Whole model tensors out of a torch DCP checkpoint folder, one at a time, without a process group."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from hfpipe.checkpoint.checksums import Checksums
from hfpipe.checkpoint.safe_metadata import check_byte_items, read_metadata, safe_load

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
