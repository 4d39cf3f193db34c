"""What the base model was when a LoRA run trained on it, and the check that a merge meets the same one.

A LoRA checkpoint holds only adapters; the merge rewrites the base folder's shards with them. If that
folder changed after training (another revision downloaded over it, another model copied in), the
merge would write adapters trained on one model into another, and nothing would look wrong. So the
run records, in ``hfpipe.json``'s ``base``, each file it read from the base (``config.json``, the
index, the shards): its size, and a sha256 of ``config.json`` whole and of each shard's safetensors
header and first and last :data:`_SAMPLE` bytes of data.

Why a sample and not every byte: the record is written at every save, and hashing a 100 GB base
costs minutes of one rank's time for each. Sizes and headers catch another shape, dtype or key set;
the sampled bytes catch another model of the same shape whenever it differs in the first or last
tensors of a shard (a full fine-tune does). A change only in the middle of a shard (a flipped bit)
is not caught; the base's own integrity is the hub's (its files are content-addressed).
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

from hfpipe.errors import ExportError
from hfpipe.files import open_regular, read_side_file

__all__ = ["base_difference", "base_record", "check_base"]

_SAMPLE = 1 << 16
_HEADER_CAP = 100 << 20  # safetensors' own limit on a header


def _files(src: Path) -> list[Path]:
    names = ["config.json", *sorted(p.name for p in src.glob("*.safetensors")),
             *sorted(p.name for p in src.glob("*.safetensors.index.json"))]
    return [src / n for n in names if (src / n).is_file()]


def _shard_digest(path: Path, size: int) -> str:
    """sha256 of a shard's header and the first and last :data:`_SAMPLE` bytes of its data."""
    h = hashlib.sha256()
    with open_regular(path, "base shard ") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        h.update(head + f.read(min(n, _HEADER_CAP)))
        h.update(f.read(_SAMPLE))
        f.seek(max(size - _SAMPLE, f.tell()))
        h.update(f.read(_SAMPLE))
    return h.hexdigest()


def _file_digest(path: Path) -> dict:
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _DIGESTS:  # every save records the base: read each file once per run, unless it changes
        if path.suffix == ".safetensors":
            _DIGESTS[key] = {"size": st.st_size, "sample_sha256": _shard_digest(path, st.st_size)}
        else:
            _DIGESTS[key] = {"size": st.st_size, "sha256": hashlib.sha256(read_side_file(path, follow=True)).hexdigest()}
    return dict(_DIGESTS[key])


_DIGESTS: dict[tuple, dict] = {}


def base_record(src: str | Path) -> dict:
    """``{"files": {name: {"size", "sha256" | "sample_sha256"}}}`` for the base folder ``src``."""
    return {"files": {p.name: _file_digest(p) for p in _files(Path(src))}}


def base_difference(meta: dict, src: Path) -> str | None:
    """How the base folder ``src`` differs from the one ``meta`` (``hfpipe.json``) recorded, naming the
    file; None when it is the same, or when nothing was recorded (see :func:`check_base`)."""
    recorded = meta.get("base")
    files = recorded.get("files") if isinstance(recorded, dict) else None
    if not isinstance(files, dict) or not files:
        return None
    now = base_record(src)["files"]
    for name in sorted(set(files) | set(now)):
        if name not in now:
            return f"base file {src / name} is missing"
        if name not in files:
            return f"base file {src / name} was not there when the run trained"
        if files[name] != now[name]:
            return f"base file {src / name} changed since the run trained on it"
    return None


def check_base(meta: dict, src: Path, ckpt: Path) -> None:
    """Refuse a merge onto a base that is not the one the run trained on, naming the file that differs.

    A record without ``base`` is refused too: a merge is the one step that rewrites the base, and a
    record that cannot say what it was (damaged, or older than the record) cannot vouch for it.

    Raises:
        ExportError: the record lacks ``base``, or a file is missing, added or different.
    """
    recorded = meta.get("base")
    if not isinstance(recorded, dict) or not isinstance(recorded.get("files"), dict) or not recorded["files"]:
        raise ExportError(f"checkpoint {ckpt}: hfpipe.json does not record the base the run trained on "
                          "(damaged, or written by an older hfpipe), so a merge cannot be checked against it; "
                          "export the adapter without --merge and merge it with PEFT")
    problem = base_difference(meta, src)
    if problem:
        raise ExportError(f"--merge: {problem}; merge onto the base the run started from (--source), or "
                          "export the adapter without --merge")
