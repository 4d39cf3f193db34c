"""Helpers for the trust tests: a checkpoint as hfpipe saves it, and ways an attacker or bit rot changes it."""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch

from hfpipe.tiny import make_tiny_checkpoint


class RunsCode:
    """Pickles to ``os.system(cmd)``: what a crafted byte item holds."""

    def __init__(self, cmd: str) -> None:
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


class Evals:
    """Pickles to ``eval(...)`` of code that runs ``cmd``."""

    def __init__(self, cmd: str) -> None:
        self.cmd = cmd

    def __reduce__(self):
        return (eval, (f"__import__('os').system({self.cmd!r})",))


class Execs:
    """Pickles to ``exec(...)``."""

    def __init__(self, cmd: str) -> None:
        self.cmd = cmd

    def __reduce__(self):
        return (exec, (f"import os; os.system({self.cmd!r})",))


class Popens:
    """Pickles to ``subprocess.Popen(cmd, shell=True)``... through ``subprocess.getoutput``."""

    def __init__(self, cmd: str) -> None:
        self.cmd = cmd

    def __reduce__(self):
        import subprocess

        return (subprocess.getoutput, (self.cmd,))


#: name -> payload(cmd): objects whose unpickling runs ``cmd``
PAYLOADS = {
    "os.system": RunsCode,
    "eval": Evals,
    "exec": Execs,
    "subprocess": Popens,
    "in-a-dict": lambda cmd: {"lr": RunsCode(cmd)},
    "in-a-tuple": lambda cmd: (0.9, RunsCode(cmd)),
}


def make_checkpoint(tiny: Path, path: Path) -> Path:
    """A checkpoint of ``tiny`` after one AdamW step, with the keys hfpipe saves and its checksums.

    Model tensors, the flattened optimizer state (tensors and byte items: lr, betas, ...) and the
    RNG state, as one rank of a pp=1 run writes them; then ``hfpipe.json`` and ``checksums.json``.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from transformers import AutoModelForCausalLM

    from hfpipe.checkpoint.dcp import record_checksums

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 100, (1, 8))
    model(ids, labels=ids).loss.backward()
    opt.step()
    optim = get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    state = {"model." + k: v for k, v in model.state_dict().items()}
    state.update({"optim." + k: v for k, v in optim.items()})
    state["rng.rank0"] = torch.get_rng_state()
    dcp.save(state, checkpoint_id=path, no_dist=True)
    meta = {"format": 1, "step": 1, "source": str(tiny), "source_dtype": "float32", "tied": False, "config": {}}
    (path / "hfpipe.json").write_text(json.dumps(meta))
    record_checksums(path)
    return path


def copy_checkpoint(ckpt: Path, dst: Path) -> Path:
    dst.parent.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copytree(ckpt, dst))


def _write_metadata(ckpt: Path, metadata) -> None:
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))  # our own Metadata object: plain DCP classes


def replace_item(ckpt: Path, fqn: str, value, *, as_bytes: bool = False, rerecord: bool = True) -> None:
    """Store ``value`` (torch.save'd) as item ``fqn``: appended to its data file, ``.metadata`` repointed.

    ``as_bytes`` also declares ``fqn`` a byte item (a tensor key turned into one). ``rerecord``:
    the attacker also rewrites the checksum record (it is not a signature); otherwise it is stale.
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    from hfpipe.checkpoint.dcp import record_checksums
    from hfpipe.checkpoint.safe_metadata import read_metadata

    metadata = read_metadata(ckpt)
    indices = [i for i in metadata.storage_data if i.fqn == fqn]
    info = metadata.storage_data[indices[0]]
    buffer = io.BytesIO()
    torch.save(value, buffer)
    data = buffer.getvalue()
    file = ckpt / info.relative_path
    offset = file.stat().st_size
    with open(file, "ab") as f:
        f.write(data)
    new = type(info)(relative_path=info.relative_path, offset=offset, length=len(data),
                     transform_descriptors=getattr(info, "transform_descriptors", None))
    for i in indices:
        del metadata.storage_data[i]
    if as_bytes:
        metadata.state_dict_metadata[fqn] = BytesStorageMetadata()
        metadata.storage_data[MetadataIndex(fqn)] = new
    else:
        metadata.storage_data[indices[0]] = new
    _write_metadata(ckpt, metadata)
    if rerecord:
        record_checksums(ckpt)


def flip(ckpt: Path, fqn: str, nbytes: int = 1, at: float = 0.5) -> None:
    """Flip ``nbytes`` bytes of item ``fqn`` in its data file, ``at`` the given fraction of its range."""
    from hfpipe.checkpoint.safe_metadata import read_metadata

    metadata = read_metadata(ckpt)
    info = next(v for k, v in metadata.storage_data.items() if k.fqn == fqn)
    start = info.offset + int(info.length * at)
    with open(ckpt / info.relative_path, "r+b") as f:
        f.seek(start)
        raw = f.read(nbytes)
        f.seek(start)
        f.write(bytes(b ^ 0xFF for b in raw))


def flip_file(path: Path) -> None:
    """Flip one bit in the middle of the whole file ``path`` (a damaged ``.metadata``)."""
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))


#: What :func:`plant` can put where hfpipe would create a file.
PLANTS = ("symlink", "dangling-symlink", "hard-link", "fifo", "folder")


def plant(kind: str, at: Path, victim: Path) -> None:
    """Put a ``kind`` of :data:`PLANTS` at ``at``: a link to ``victim`` (or to a file beside it), a FIFO
    or a folder."""
    if kind == "symlink":
        at.symlink_to(victim)
    elif kind == "dangling-symlink":
        at.symlink_to(victim.parent / "made-through-the-link")
    elif kind == "hard-link":
        os.link(victim, at)
    elif kind == "fifo":
        os.mkfifo(at)
    elif kind == "folder":
        at.mkdir()
    else:
        raise ValueError(f"no plant {kind!r}; one of {PLANTS}")


def tree(root: Path, giant: int | None = None) -> dict[str, object]:
    """Every path under ``root`` (links not followed) with its size and content, or link target.

    With ``giant``, a file larger than that many bytes is ``(size, its first 64 bytes)``: a sparse
    multi-GB file planted to be refused unread is compared without reading it either.
    """
    out = {}
    for folder, dirs, files in os.walk(root, followlinks=False):
        for name in dirs + files:
            p = Path(folder) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = "-> " + os.readlink(p)
            elif p.is_dir():
                out[rel] = "dir"
            elif p.is_file() and giant is not None and p.stat().st_size > giant:
                with open(p, "rb") as f:
                    out[rel] = (p.stat().st_size, f.read(64))
            elif p.is_file():
                out[rel] = p.read_bytes()
            else:
                out[rel] = "special"
    return out


def rerecord_metadata(ckpt: Path) -> None:
    """Make the checksum record vouch for the current ``.metadata`` (an attacker rewrites the record too:
    it is not a signature), so that what reads ``.metadata`` itself is what must refuse it."""
    from hfpipe.checkpoint.checksums import _digest

    record = json.loads((ckpt / "checksums.json").read_text())
    record["metadata"] = _digest((ckpt / ".metadata").read_bytes())
    text = json.dumps(record, sort_keys=True)
    (ckpt / "checksums.json").write_text(text)
    meta = json.loads((ckpt / "hfpipe.json").read_text())
    meta["checksums"]["digest"] = _digest(text.encode())
    (ckpt / "hfpipe.json").write_text(json.dumps(meta))


#: Lines a one-line refusal may come with on stderr: hfpipe's own log lines and transformers' load bar.
PROGRESS = re.compile(r"^((\d{4}-\d\d-\d\d )?\d\d:\d\d:\d\d (INFO|WARNING) (\[rank\d+\] )?hfpipe\.|Loading weights: )")


def error_lines(stderr: str) -> list[str]:
    """What a command said on stderr besides its progress lines (one ``error: ...`` for a refusal)."""
    return [ln for ln in stderr.splitlines() if ln.strip() and not PROGRESS.match(ln)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A tiny Llama folder the trust suites attack (import it: ``from _trust import tiny``)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama")


@pytest.fixture(scope="module")
def ckpt(tiny, tmp_path_factory) -> Path:
    """A good training checkpoint of ``tiny``, with its record and checksums."""
    return make_checkpoint(tiny, tmp_path_factory.mktemp("good") / "step-00000001")
