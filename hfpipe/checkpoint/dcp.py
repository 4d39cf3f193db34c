"""Training checkpoints with torch DCP: saved by every rank, resumable at any pipeline size.

A checkpoint folder ``OUT/checkpoints/step-00000010/`` holds DCP files whose keys are
``model.<full-model name>``, ``optim.<flattened optimizer state>`` and ``rng.rank<r>``, plus
``hfpipe.json`` (step, data position, LR-scheduler state, run config, source). Because names are
the full model's, DCP reshards on load: a checkpoint written at pp=4 loads at pp=2, with another
schedule or another dp. The optimizer state is *flattened* (one entry per parameter): with the
nested form, ranks owning different parameters overwrite each other's param groups and lose
lr/betas on load.

Saves are atomic: every rank writes into ``.tmp-step-...``; after a barrier rank 0 adds
``hfpipe.json`` and renames the folder. A crash mid-save leaves the previous checkpoint the latest.
With ``async_save`` the state is copied at once and written by a background thread on a group of
its own; the same finalisation runs when the returned :class:`PendingSave` is waited on.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException as DcpCheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from hfpipe.errors import CheckpointError  # noqa: F401 - raised here, and imported from here by callers
from hfpipe.checkpoint import checksums
from hfpipe.checkpoint.meta import check_record_objects, read_record
from hfpipe.parallel.agree import agree
from hfpipe.parallel.lock import write_new
from hfpipe.checkpoint.safe_metadata import UnsafeMetadataError, check_byte_items, read_metadata, safe_load
from hfpipe.checkpoint.strided import plain_split, restore

__all__ = ["CheckpointError", "PendingSave", "rank_view", "save_checkpoint", "load_checkpoint",
           "latest_checkpoint", "check_stored_data", "record_checksums", "resolve_resume"]

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d{8})$")
_OPTS = StateDictOptions(flatten_optimizer_state_dict=True)


def rank_view(modules, tied: bool) -> nn.Module:
    """One module whose parameter names are this rank's full-model names.

    DCP's state-dict helpers take a single module. A tied head kept apart from the embedding is
    registered *as* ``model.embed_tokens``: on disk the tied weight has one name, whichever
    rank holds it, so a checkpoint reshards between layouts that share or split it.
    """
    view = nn.Module()
    view.model = nn.Module()
    view.model.layers = nn.ModuleDict()
    for m in modules:
        if m.model.embed_tokens is not None:
            view.model.embed_tokens = m.model.embed_tokens
        view.model.layers.update(m.model.layers)
        if m.model.norm is not None:
            view.model.norm = m.model.norm
        for name in getattr(getattr(m, "adapter", None), "head_modules", ()):  # head-side modules (DeepSeek-V4's hc_head)
            if getattr(m.model, name) is not None:
                setattr(view.model, name, getattr(m.model, name))
    for m in modules:
        if m.lm_head is not None:
            if not tied:
                view.lm_head = m.lm_head
            elif getattr(view.model, "embed_tokens", None) is None:
                view.model.embed_tokens = m.lm_head
    return view


def _states(view: nn.Module, optimizer) -> tuple[dict, list]:
    """The model (and optimizer) state DCP reads or writes, and the strided tensors handed to it plain-split
    (:mod:`hfpipe.checkpoint.strided`: :func:`~hfpipe.checkpoint.strided.restore` puts them back after a load)."""
    if _is_empty(view):
        return ({"model": {}, "optim": {}} if optimizer is not None else {"model": {}}), []
    state = {"model": get_model_state_dict(view)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(view, optimizer, options=_OPTS)
    return state, plain_split(state)


def _is_empty(view: nn.Module) -> bool:
    """A rank whose stages are all empty has no state; torch's state-dict helpers refuse it."""
    return not any(True for _ in view.state_dict())


def save_checkpoint(root: str | Path, step: int, view: nn.Module, optimizer, meta: dict, *,
                    keep: int | None = None, process_group=None,
                    async_save: bool = False) -> Path | PendingSave:
    """Write ``root/step-<step>`` atomically from every rank; return its path.

    Args:
        root: The checkpoints folder (shared by all ranks).
        step: Optimizer steps done.
        view: :func:`rank_view` of this rank's stages.
        optimizer: The optimizer (its state is saved flattened), or ``None``.
        meta: JSON-able run state written as ``hfpipe.json`` (step is added).
        keep: Keep only the newest ``keep`` checkpoints (``None``: all).
        process_group: Group of the DCP write (default: the default group; with ``async_save``
            a new gloo group, destroyed once the save is final).
        async_save: Copy the state now, write it in a background thread and return a
            :class:`PendingSave`; every rank must call its ``wait()`` at the same point before the
            next save (the checkpoint only becomes ``step-<step>`` then).
    """
    root = Path(root)
    tmp = root / f".tmp-step-{step:08d}"
    rank = dist.get_rank()
    if rank == 0:
        _remove(tmp)
        tmp.mkdir(parents=True)
    dist.barrier()
    state, _ = _states(view, optimizer)
    state["rng"] = {f"rank{rank}": torch.get_rng_state()}
    text = json.dumps({**meta, "step": step}, indent=2)  # now: meta may change while the save runs
    if not async_save:
        try:
            dcp.save(state, checkpoint_id=tmp, process_group=process_group)
        except (Exception, DcpCheckpointException) as e:
            _raise_if_disk_full(e, tmp, root / f"step-{step:08d}", state)
            raise
        return _finalise(root, step, text, keep)
    # The writer thread runs collectives while training runs its own: they must not share a group.
    own = process_group is None
    group = dist.new_group(backend="gloo") if own else process_group
    future = dcp.async_save(state, checkpoint_id=tmp, process_group=group)  # copies the tensors first
    return PendingSave(future, lambda: _finalise(root, step, text, keep), group if own else None,
                       lambda e: _raise_if_disk_full(e, tmp, root / f"step-{step:08d}", state))


class PendingSave:
    """A checkpoint being written in the background (from ``save_checkpoint(async_save=True)``)."""

    def __init__(self, future, finalise, group=None, on_error=None) -> None:
        self._future, self._finalise, self._group = future, finalise, group
        self._on_error = on_error  # says a full disk in one line, as a synchronous save does
        self._path: Path | None = None

    def done(self) -> bool:
        """Whether this rank's files are written (``wait()`` still has to make it final)."""
        return self._future.done()

    def wait(self) -> Path:
        """Wait for the files, then finalise (barrier, ``hfpipe.json``, rename, prune) on every rank.

        Collective: all ranks call it at the same point. Re-raises the writer's error, leaving the
        ``.tmp-step-...`` folder behind (never picked up by :func:`latest_checkpoint`).
        """
        if self._path is None:
            try:
                self._future.result()
            except (Exception, DcpCheckpointException) as e:
                if self._on_error is not None:
                    self._on_error(e)
                raise
            self._path = self._finalise()
            if self._group is not None:
                dist.destroy_process_group(self._group)
                self._group = None
        return self._path


def _raise_if_disk_full(e: BaseException, tmp: Path, final: Path, state: dict) -> None:
    """ENOSPC while writing: remove the partial folder and say so in one line (every rank gets it)."""
    from hfpipe.checkpoint.disk import disk_full_message, is_disk_full, out_of_space, state_bytes

    if is_disk_full(e) or out_of_space(tmp, state_bytes(state)):
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(disk_full_message(final, state_bytes(state))) from None


def _finalise(root: Path, step: int, meta_text: str, keep: int | None) -> Path:
    """After every rank wrote its files: each hashes its own (:mod:`.checksums`), rank 0 writes
    ``checksums.json`` and ``hfpipe.json`` and renames into place."""
    final, tmp = root / f"step-{step:08d}", root / f".tmp-step-{step:08d}"
    dist.barrier()  # every rank's files (and rank 0's .metadata) are written
    rows = _hash_own_files(tmp)
    if dist.get_rank() == 0:
        try:
            entry = checksums.write_record(tmp, rows)
            write_new(tmp / "hfpipe.json", json.dumps({**json.loads(meta_text), "checksums": entry}, indent=2))
        except OSError as e:
            _raise_if_disk_full(e, tmp, final, {})
            raise
        _remove(final)
        os.replace(tmp, final)
        _prune(root, keep)
    dist.barrier()
    return final


def _hash_own_files(tmp: Path) -> list[list]:
    """Checksums of the items in the files this rank wrote; on rank 0, every rank's (a gather)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    metadata = read_metadata(tmp)
    rows = checksums.hash_items(tmp, metadata, checksums.mine(metadata, rank, world))
    parts = [None] * world if rank == 0 else None
    dist.gather_object(rows, parts, dst=0)  # plain lists between this run's own processes
    return [row for part in parts for row in part] if rank == 0 else []


def record_checksums(ckpt: str | Path) -> None:
    """Record checksums for a checkpoint written without them (by ``dcp.save`` alone), in this process.

    For tools and benchmarks, on a checkpoint known to be good: its bytes now become the reference.
    """
    ckpt = Path(ckpt)
    metadata = read_metadata(ckpt)
    (ckpt / checksums.RECORD).unlink(missing_ok=True)
    files = {info.relative_path for info in metadata.storage_data.values()}
    entry = checksums.write_record(ckpt, checksums.hash_items(ckpt, metadata, files))
    meta = json.loads((ckpt / "hfpipe.json").read_text())
    (ckpt / "hfpipe.json").write_text(json.dumps({**meta, "checksums": entry}, indent=2))


def _remove(path: Path) -> None:
    """Remove a folder, or only the link if ``path`` is one (never what a planted link points to)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def _prune(root: Path, keep: int | None) -> None:
    if not keep:
        return
    for old in sorted(_complete(root))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _complete(root: Path) -> list[Path]:
    """Finished checkpoints under ``root`` (temporary and half-written ones excluded)."""
    if not root.is_dir():
        return []
    return [p for p in root.iterdir()
            if _STEP_DIR.match(p.name) and (p / ".metadata").is_file() and (p / "hfpipe.json").is_file()]


def latest_checkpoint(root: str | Path) -> Path | None:
    """The complete checkpoint with the highest step under ``root``, or ``None``."""
    done = sorted(_complete(Path(root)))
    return done[-1] if done else None


def resolve_resume(resume: str | None, output_dir: str | Path) -> Path | None:
    """``--resume``: ``auto``/``latest`` (newest in the output folder, if any) or a path.

    Raises:
        CheckpointError: an explicit path that is not a complete checkpoint.
    """
    if not resume:
        return None
    if resume in ("auto", "latest"):
        latest = latest_checkpoint(Path(output_dir) / "checkpoints")
        if latest is not None:
            check_complete(latest)  # a damaged newest checkpoint: say so before any process starts
            check_stored_data(latest)
        return latest
    path = Path(resume)
    if path.is_dir() and not _STEP_DIR.match(path.name):
        latest = latest_checkpoint(path / "checkpoints") or latest_checkpoint(path)
        if latest is not None:
            check_complete(latest)
            check_stored_data(latest)
            return latest
    check_complete(path)
    check_stored_data(path)
    return path


def check_stored_data(path: Path) -> None:
    """Before any process starts: the checksum record is intact and every byte item is plain data.

    Byte items (optimizer param groups: lr, betas, ...) are small, so all are read here, each
    checked against its checksum and unpickled as data only; tensors are checked by each rank as
    it reads them (:class:`~hfpipe.checkpoint.safe_metadata.SafeReader`).

    Raises:
        CheckpointError: naming the damaged or unsafe item.
    """
    try:
        check_byte_items(path, checksums.Checksums.load(path))
    except (checksums.DamagedCheckpointError, UnsafeMetadataError) as e:
        raise CheckpointError(str(e)) from None
    except OSError as e:
        raise CheckpointError(f"checkpoint {path}: {e.filename or 'a data file'} cannot be read "
                              f"({e.strerror}); resume from an earlier checkpoint") from None


def check_complete(path: Path) -> None:
    """Raise :class:`CheckpointError` naming what a checkpoint folder lacks."""
    if not path.is_dir():
        raise CheckpointError(f"--resume {path}: no such checkpoint folder")
    for name in (".metadata", "hfpipe.json"):
        if not (path / name).is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} missing; "
                                  "resume from an earlier checkpoint")
    try:
        storage = read_metadata(path).storage_data
    except UnsafeMetadataError as e:  # truncated, not DCP's, or crafted to run code
        raise CheckpointError(f"checkpoint {path}: .metadata cannot be read ({e}); "
                              "resume from an earlier checkpoint") from None
    files = sorted({info.relative_path for info in storage.values()})
    missing = [name for name in files if not (path / name).is_file()]
    if missing:
        raise CheckpointError(f"checkpoint {path} is incomplete: {', '.join(missing)} missing "
                              f"({len(missing)} of {len(files)} data files); resume from an earlier checkpoint")


def read_meta(path: str | Path) -> dict:
    """The ``hfpipe.json`` of a complete checkpoint."""
    path = Path(path)
    check_complete(path)
    meta = read_record(path / "hfpipe.json", CheckpointError, "resume from an earlier checkpoint")
    check_record_objects(meta, path / "hfpipe.json", CheckpointError, "resume from an earlier checkpoint")
    return meta


def _load_plan(path: Path, view: nn.Module, optimizer) -> tuple[dict, dict, list, str]:
    """The record, the state to load into (and its plain-split strided tensors) and this rank's RNG key, once
    the checkpoint fits the view."""
    meta = read_meta(path)
    state, strided = _states(view, optimizer)
    rank_key = f"rank{dist.get_rank()}"
    saved = read_metadata(path).state_dict_metadata
    if f"rng.{rank_key}" in saved:  # same world size: restore this rank's RNG exactly
        state["rng"] = {rank_key: torch.get_rng_state()}
    missing = [f"model.{k}" for k in state["model"] if f"model.{k}" not in saved]
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks {missing[0]} ({len(missing)} tensors missing); "
                              "it was written for another model")
    return meta, state, strided, rank_key


def load_checkpoint(path: str | Path, view: nn.Module, optimizer) -> dict:
    """Load model, optimizer and RNG state into this rank's ``view``; return ``hfpipe.json``.

    Raises:
        CheckpointError: incomplete folder, or tensors missing for some rank's parameters (on every
            rank alike: none is left waiting in DCP's load).
    """
    path = Path(path)
    meta, state, strided, rank_key = agree(lambda: _load_plan(path, view, optimizer))  # DCP's load is collective
    try:
        safe_load(state, path)  # byte items as data only, every item checked against its checksum
    except ValueError as e:
        if type(e).__module__.startswith("hfpipe."):  # already one line naming the item
            raise CheckpointError(str(e)) from None
        raise CheckpointError(f"checkpoint {path} cannot be read ({str(e).splitlines()[0][:200]}); "
                              "it may be incomplete: resume from an earlier checkpoint") from None
    except (Exception, DcpCheckpointException) as e:  # DCP's wrapper is a BaseException naming the rank
        raise CheckpointError(f"checkpoint {path} cannot be read ({str(e).splitlines()[0][:200]}); "
                              "it may be incomplete: resume from an earlier checkpoint") from None
    restore(strided)
    if not _is_empty(view):  # torch's setters refuse a rank without state
        set_model_state_dict(view, state["model"])
    if optimizer is not None and not _is_empty(view):
        set_optimizer_state_dict(view, optimizer, state["optim"], options=_OPTS)
    if "rng" in state:
        torch.set_rng_state(state["rng"][rank_key])
    return meta
