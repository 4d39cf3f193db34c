"""Spec of what a checkpoint can and cannot make hfpipe do.

1. A crafted byte item inside a ``.distcp`` file runs nothing: DCP's own planner unpickles byte
   items freely; hfpipe reads them as data only, on every path (resume, export, generate).
2. A planted link at a lock path clobbers nothing, and files hfpipe creates are never opened
   through one.
4. A flipped byte in any stored item is found before the item is used, and named in one line.

Each attack leaves a marker file that must stay absent. In-process and fast, bar one test that
resumes in a real (single) worker process.
"""

from __future__ import annotations

import io
import json
import os
import re
from pathlib import Path

import pytest
import torch

from _dist import run_ranks
from _trust import (  # noqa: F401 - ckpt and tiny are fixtures
    PAYLOADS, ckpt, copy_checkpoint, flip, flip_file, plant, replace_item, RunsCode, tiny, tree,
)
from hfpipe.checkpoint.checksums import DamagedCheckpointError
from hfpipe.checkpoint.dcp import CheckpointError, check_stored_data, resolve_resume
from hfpipe.export.hf_folder import ExportError, export_checkpoint
from hfpipe.checkpoint.safe_metadata import (SafeReader, UnsafeMetadataError, _DcpReader, read_metadata,
                                             safe_load)

LR = "optim.param_groups.model.layers.0.mlp.up_proj.weight.lr"
BETAS = "optim.param_groups.lm_head.weight.betas"
WEIGHT = "model.model.layers.1.self_attn.q_proj.weight"  # DCP key: "model." + the full model's name



@pytest.fixture
def copy(ckpt, tmp_path) -> Path:
    return copy_checkpoint(ckpt, tmp_path / "run" / "checkpoints" / "step-00000001")


# --- 1. byte items are data, never code ---------------------------------------------------------


def test_every_byte_item_of_a_real_save_reads_as_the_value_saved(ckpt):
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from hfpipe.checkpoint.safe_metadata import load_item

    metadata = read_metadata(ckpt)
    byte_items = [k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)]
    assert LR in byte_items and BETAS in byte_items and len(byte_items) > 100
    check_stored_data(ckpt)  # every one checked and read as data
    info = next(v for k, v in metadata.storage_data.items() if k.fqn == BETAS)
    with open(ckpt / info.relative_path, "rb") as f:
        f.seek(info.offset)
        assert load_item(BETAS, io.BytesIO(f.read(info.length))) == (0.9, 0.999)


def _cases(names, default, ids=None):
    """Parameters for ``names``; those not in ``default`` run only in the full matrix (-m slow)."""
    return [pytest.param(*(n if isinstance(n, tuple) else (n,)), id=i,
                         marks=() if n in default else pytest.mark.slow)
            for n, i in zip(names, ids or [str(n) for n in names])]


@pytest.mark.parametrize("payload, rerecord", _cases(
    [(p, r) for p in PAYLOADS for r in (True, False)], [("os.system", True), ("eval", True), ("os.system", False)],
    [f"{p}-{'record-rewritten' if r else 'record-stale'}" for p in PAYLOADS for r in (True, False)]))
def test_a_crafted_byte_item_runs_nothing_on_resume(copy, tmp_path, payload, rerecord):
    marker = tmp_path / "pwned"
    replace_item(copy, LR, PAYLOADS[payload](f"touch {marker}"), rerecord=rerecord)
    message = (r"stored item .*\.lr is not plain data \(refusing [\w.]*(system|eval|exec|getoutput)\); "
               "hfpipe never runs code" if rerecord else r"\.metadata is damaged \(fails its xxh3_64 checksum\)")
    for resume in (str(copy), "auto"):  # what finetune --resume checks before any process starts
        with pytest.raises(CheckpointError, match=message):
            resolve_resume(resume, copy.parents[1])
    with pytest.raises(UnsafeMetadataError if rerecord else DamagedCheckpointError, match=message):
        safe_load({LR: 0.0}, copy, no_dist=True)  # what each rank's load_checkpoint runs
    assert not marker.exists()


def test_torchs_own_planner_is_never_served(copy, tmp_path):
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "pwned"
    replace_item(copy, LR, RunsCode(f"touch {marker}"))
    with pytest.raises(BaseException, match="SafeReader serves only a SafeLoadPlanner"):
        dcp.load({LR: 0.0}, storage_reader=SafeReader(copy), no_dist=True)  # DefaultLoadPlanner
    assert not marker.exists()


def test_a_tensor_key_stored_as_a_byte_item_is_refused_on_every_path(tiny, copy, tmp_path):
    from hfpipe.generate import load_generator

    marker = tmp_path / "pwned"
    replace_item(copy, WEIGHT, RunsCode(f"touch {marker}"), as_bytes=True)
    with pytest.raises(UnsafeMetadataError, match=rf"{WEIGHT} is stored as bytes where a tensor belongs"):
        safe_load({WEIGHT: torch.empty(64, 64)}, copy, no_dist=True)
    refused = rf"stored item {re.escape(WEIGHT)} is not plain data \(refusing posix.system\)"
    with pytest.raises(UnsafeMetadataError, match=refused):  # opening the checkpoint reads every byte item
        export_checkpoint(copy, tmp_path / "out", progress=False)
    with pytest.raises(UnsafeMetadataError, match=refused):
        load_generator(copy)
    replace_item(copy, WEIGHT, 0.5, as_bytes=True)  # plain data where a weight belongs
    with pytest.raises(ExportError, match=f"does not match the source model: missing {WEIGHT.removeprefix('model.')}"):
        export_checkpoint(copy, tmp_path / "out", progress=False)
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_a_plain_value_stored_as_a_byte_item_still_loads(copy):
    replace_item(copy, LR, 0.25)  # data, not code: what a checkpoint may legitimately hold
    check_stored_data(copy)
    state = {LR: 0.0}
    safe_load(state, copy, no_dist=True)
    assert state[LR] == 0.25


def _resume_one_rank(ckpt: str, marker: str) -> str:
    """In a real worker: load_checkpoint of ``ckpt`` into a model and AdamW (preflight bypassed)."""
    from transformers import AutoModelForCausalLM

    from hfpipe.checkpoint.dcp import load_checkpoint, read_meta
    from hfpipe.parallel.mesh import init_distributed

    init_distributed(1)
    model = AutoModelForCausalLM.from_pretrained(read_meta(ckpt)["source"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 100, (1, 8))
    model(ids, labels=ids).loss.backward()
    opt.step()
    try:
        load_checkpoint(ckpt, model, opt)
    except CheckpointError as e:
        return str(e)
    return f"loaded; marker exists: {Path(marker).exists()}"


@pytest.mark.slow  # a real worker process (~30 s here); the same load runs in-process above
def test_a_worker_loading_a_crafted_checkpoint_runs_nothing(copy, tmp_path):
    marker = tmp_path / "pwned"
    replace_item(copy, LR, RunsCode(f"touch {marker}"))
    message = run_ranks(_resume_one_rank, 1, str(copy), str(marker))[0]
    assert re.search(rf"stored item {re.escape(LR)} is not plain data \(refusing posix\.system\)", message), message
    assert not marker.exists()


def test_every_dcp_read_in_hfpipe_goes_through_the_safe_loader():
    root = Path(__file__).resolve().parents[2] / "hfpipe"
    for path in root.rglob("*.py"):
        text = path.read_text()
        assert "dcp.load(" not in text or path.name == "safe_metadata.py", path
        for call in re.findall(r"torch\.load\([^)]*\)", text):
            assert "weights_only=True" in call, f"{path.name}: {call}"


# --- 2. locks and created files never follow a link --------------------------------------------


LOCK_PLANTS = {"symlink": "is a symbolic link", "dangling-symlink": "is a symbolic link",
               "hard-link": r"has \d+ hard links", "fifo": "is not a regular file", "folder": "is not a regular file"}


@pytest.mark.parametrize("kind", _cases(list(LOCK_PLANTS), ["symlink", "hard-link"]))
def test_a_planted_lock_file_is_refused_and_clobbers_nothing(tmp_path, kind):
    from hfpipe.parallel.lock import FolderLock, LockFileError, run_lock

    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "out"
    out.mkdir()
    for lock in (run_lock(out), FolderLock(tmp_path / ".hf.lock", tmp_path / "hf", "OUT")):
        plant(kind, lock.file, victim)
        before = tree(tmp_path)
        for call in (lock.check, lock.acquire):
            with pytest.raises(LockFileError, match=f"its lock file {re.escape(str(lock.file))} {LOCK_PLANTS[kind]}; "
                                                    "hfpipe never writes through one"):
                call()
        assert tree(tmp_path) == before and victim.read_text() == "precious"


def test_a_released_lock_file_is_never_held_twice(tmp_path):
    """The holder unlinks the file on release; one who opened it before must not lock the orphan."""
    from hfpipe.parallel.lock import FolderBusyError, FolderLock, _same_file

    first = FolderLock(tmp_path / ".x.lock", tmp_path, "OUT").acquire()
    stale = os.open(first.file, os.O_RDONLY)  # opened while held, as a racing process would
    dir_fd = os.open(tmp_path, os.O_RDONLY)
    try:
        first.release()
        assert not _same_file(stale, dir_fd, first.file.name)
        second = FolderLock(tmp_path / ".x.lock", tmp_path, "OUT").acquire()
        assert _same_file(second._fd, dir_fd, second.file.name)
        with pytest.raises(FolderBusyError, match="is in use by process"):
            FolderLock(tmp_path / ".x.lock", tmp_path, "OUT").acquire()
        second.release()
        assert not (tmp_path / ".x.lock").exists()
    finally:
        os.close(stale)
        os.close(dir_fd)


def test_files_hfpipe_creates_are_never_opened_through_a_link(tmp_path):
    from hfpipe.export.hf_writer import ShardWriter
    from hfpipe.parallel.lock import write_new

    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    for name in ("record.json", "model.safetensors"):
        (tmp_path / name).symlink_to(victim)
    with pytest.raises(FileExistsError):
        write_new(tmp_path / "record.json", "{}")
    with pytest.raises(FileExistsError):
        ShardWriter(tmp_path / "model.safetensors", {"w": (torch.Size([2]), torch.float32)})
    assert victim.read_text() == "precious"


def test_a_planted_link_at_a_checkpoint_folder_is_removed_not_followed(tmp_path):
    from hfpipe.checkpoint.dcp import _remove

    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "data.txt").write_text("precious")
    link = tmp_path / ".tmp-step-00000002"
    link.symlink_to(victim)
    _remove(link)
    assert not link.exists() and not link.is_symlink() and (victim / "data.txt").read_text() == "precious"


# --- 4. bit rot is found before a damaged item is used ---------------------------------------------


@pytest.mark.parametrize("key, nbytes", _cases(
    [(k, n) for k in ("model.model.embed_tokens.weight", WEIGHT, "model.model.norm.weight", "model.lm_head.weight")
     for n in (1, 64)], [(WEIGHT, 1), ("model.model.embed_tokens.weight", 64)]))
def test_flipped_bytes_in_a_weight_are_found_by_export_on_every_read_path(copy, tmp_path, key, nbytes):
    flip(copy, key, nbytes)
    message = rf"checkpoint {re.escape(str(copy))}: {re.escape(key)} is damaged \(__0_0.distcp bytes \d+-\d+ fail their xxh3_64 checksum\)"
    with pytest.raises(DamagedCheckpointError, match=message):  # kernel copies, checked in the copy threads
        export_checkpoint(copy, tmp_path / "out", progress=False)
    with pytest.raises(DamagedCheckpointError, match=message):  # converted in memory
        export_checkpoint(copy, tmp_path / "out", dtype="bf16", progress=False)
    with pytest.raises(DamagedCheckpointError, match=message):  # dcp.load's reader
        _DcpReader(copy, file_view=None).read(key)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no output, no temporary folder


def test_a_flipped_byte_is_found_by_generate_and_resume(copy, tmp_path):
    from hfpipe.generate import load_generator

    flip(copy, WEIGHT)
    with pytest.raises(DamagedCheckpointError, match=f"{WEIGHT} is damaged"):
        load_generator(copy)
    with pytest.raises(DamagedCheckpointError, match=f"{WEIGHT} is damaged"):
        safe_load({WEIGHT: torch.empty(64, 64)}, copy, no_dist=True)  # each resuming rank's read
    flip(copy, BETAS, at=0.9)
    with pytest.raises(CheckpointError, match=f"{re.escape(BETAS)} is damaged"):
        resolve_resume(str(copy), tmp_path)


RECORD_DAMAGE = {
    "record deleted": (lambda c: (c / "checksums.json").unlink(), "checksums.json named by hfpipe.json cannot be read"),
    "record edited": (lambda c: (c / "checksums.json").write_text((c / "checksums.json").read_text().replace("0", "1", 1)),
                      "checksums.json is damaged or was replaced"),
    "record replaced by a link": (lambda c: ((c / "checksums.json").unlink(), (c / "checksums.json").symlink_to("/dev/zero")),
                                  r"checksums.json named by hfpipe.json cannot be read \(Too many levels of symbolic links\)"),
    "unknown algorithm": (lambda c: _edit_meta(c, lambda m: {**m, "checksums": {**m["checksums"], "algorithm": "md5"}}),
                          "not one this hfpipe reads"),
    "metadata flipped": (lambda c: flip_file(c / ".metadata"), r"\.metadata is damaged"),
}


def _edit_meta(c: Path, fn) -> None:
    (c / "hfpipe.json").write_text(json.dumps(fn(json.loads((c / "hfpipe.json").read_text()))))


@pytest.mark.parametrize("damage", _cases(list(RECORD_DAMAGE), ["record edited", "metadata flipped"]))
def test_a_damaged_checksum_record_is_refused(copy, tmp_path, damage):
    fn, message = RECORD_DAMAGE[damage]
    fn(copy)
    with pytest.raises(DamagedCheckpointError, match=message):
        export_checkpoint(copy, tmp_path / "out", progress=False)
    with pytest.raises(CheckpointError, match=message):
        resolve_resume(str(copy), tmp_path)
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_whose_record_lost_its_checksums_entry_is_refused_not_trusted(copy, tmp_path):
    # every checkpoint hfpipe saves has checksums: losing the entry must not switch the check off
    (copy / "checksums.json").unlink()
    _edit_meta(copy, lambda m: {k: v for k, v in m.items() if k != "checksums"})
    with pytest.raises(DamagedCheckpointError, match="hfpipe.json records no checksums"):
        _DcpReader(copy)
    with pytest.raises(DamagedCheckpointError, match="hfpipe.json records no checksums"):
        export_checkpoint(copy, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_the_record_covers_every_stored_item_once(ckpt):
    record = json.loads((ckpt / "checksums.json").read_text())
    items = {(i.relative_path, str(i.offset)): i.length for i in read_metadata(ckpt).storage_data.values()}
    recorded = {(f, o): length for f, by in record["items"].items() for o, (length, _) in by.items()}
    assert recorded == items and record["algorithm"] == "xxh3_64"
    assert json.loads((ckpt / "hfpipe.json").read_text())["checksums"]["file"] == "checksums.json"


def test_every_data_file_is_hashed_by_exactly_one_rank(ckpt):
    from hfpipe.checkpoint.checksums import mine

    metadata = read_metadata(ckpt)
    metadata.storage_data = {**metadata.storage_data}
    names = ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_1.distcp", "odd.distcp"]
    for k, name in zip(list(metadata.storage_data), names * len(metadata.storage_data)):
        info = metadata.storage_data[k]
        metadata.storage_data[k] = type(info)(name, info.offset, info.length)
    parts = [mine(metadata, r, 2) for r in range(2)]
    assert parts == [{"__0_0.distcp", "__2_0.distcp", "odd.distcp"}, {"__1_0.distcp", "__3_1.distcp"}]

