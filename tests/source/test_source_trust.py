"""Spec of what hfpipe refuses to trust: nothing in a checkpoint or model folder runs code, reads
outside its folder, or is believed before it is checked.

Each test is an attack that once worked, now refused in one line naming the file.
All in-process and fast; one test runs the console entry point with "y" waiting on stdin.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _trust import rerecord_metadata
from hfpipe.checkpoint.dcp import CheckpointError, check_complete, record_checksums
from hfpipe.export.hf_folder import export_checkpoint
from hfpipe.checkpoint.safe_metadata import SafeReader, UnsafeMetadataError, read_metadata
from hfpipe.source.safetensors_io import SafetensorsError, read_header
from hfpipe.source.folder import ModelSource, SourceError
from hfpipe.tiny import make_tiny_checkpoint

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama")


@pytest.fixture(scope="module")
def ckpt(tiny, tmp_path_factory) -> Path:
    """A DCP checkpoint of ``tiny`` as training writes it (model keys + hfpipe.json)."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny)
    path = tmp_path_factory.mktemp("ckpt") / "step-00000003"
    dcp.save({"model." + k: v for k, v in model.state_dict().items()}, checkpoint_id=path, no_dist=True)
    meta = {"format": 1, "step": 3, "source": str(tiny), "source_dtype": "float32", "tied": False, "config": {}}
    (path / "hfpipe.json").write_text(json.dumps(meta))
    record_checksums(path)  # as every checkpoint hfpipe saves
    return path


class _RunsCode:
    """Pickles to ``os.system(cmd)``: what a crafted ``.metadata`` holds."""

    def __init__(self, cmd: str) -> None:
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


def crafted_copy(ckpt: Path, root: Path, payload) -> tuple[Path, Path]:
    """A copy of ``ckpt`` whose ``.metadata`` unpickles ``payload``; and the marker it would create."""
    import shutil

    copy = root / "crafted" / ckpt.name
    shutil.copytree(ckpt, copy)
    marker = root / "pwned"
    (copy / ".metadata").write_bytes(pickle.dumps(payload(f"touch {marker}")))
    rerecord_metadata(copy)
    return copy, marker


PAYLOADS = {
    "object": lambda cmd: _RunsCode(cmd),
    "inside a dict": lambda cmd: {"state_dict_metadata": _RunsCode(cmd)},
    "eval": lambda cmd: type("E", (), {"__reduce__": lambda self: (eval, (f"__import__('os').system({cmd!r})",))})(),
}


# --- 1. DCP .metadata is never plain-unpickled ----------------------------------------------------


def test_a_real_checkpoints_metadata_reads_the_same_as_torch_reads_it(ckpt):
    from torch.distributed.checkpoint import FileSystemReader

    assert read_metadata(ckpt).state_dict_metadata == FileSystemReader(ckpt).read_metadata().state_dict_metadata
    assert SafeReader(ckpt).read_metadata().storage_data == read_metadata(ckpt).storage_data


@pytest.mark.parametrize("payload", PAYLOADS, ids=list(PAYLOADS))
def test_a_crafted_metadata_runs_nothing_on_export_resume_or_load(ckpt, tmp_path, payload):
    import torch.distributed.checkpoint as dcp

    from hfpipe.checkpoint.safe_metadata import _DcpReader

    crafted, marker = crafted_copy(ckpt, tmp_path, PAYLOADS[payload])
    with pytest.raises(ValueError, match=r"\.metadata: not a DCP checkpoint's metadata"):
        export_checkpoint(crafted, tmp_path / "out", progress=False)
    with pytest.raises(CheckpointError, match=r"\.metadata cannot be read"):
        check_complete(crafted)  # what --resume runs before any process starts
    with pytest.raises(UnsafeMetadataError, match="never runs code"):
        _DcpReader(crafted)
    with pytest.raises(BaseException, match="never runs code"):  # DCP wraps it: CheckpointException
        dcp.load({"model.lm_head.weight": torch.empty(0)}, storage_reader=SafeReader(crafted), no_dist=True)
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_torchs_plain_pickle_read_is_never_used(ckpt, tmp_path, monkeypatch):
    from torch.distributed.checkpoint import FileSystemReader

    from hfpipe.checkpoint.safe_metadata import _DcpReader

    def refuse(self, *args, **kwargs):
        raise AssertionError("torch's FileSystemReader.read_metadata was called")

    monkeypatch.setattr(FileSystemReader, "read_metadata", refuse)
    check_complete(ckpt)
    reader = _DcpReader(ckpt, file_view=None)  # None: every read goes through dcp.load
    assert reader.read("model.lm_head.weight").shape[0] > 0
    assert export_checkpoint(ckpt, tmp_path / "out", progress=False).is_dir()


def test_metadata_naming_data_files_outside_the_checkpoint_is_refused(ckpt, tmp_path):
    import shutil

    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)
    metadata = read_metadata(copy)
    for info in metadata.storage_data.values():
        info.relative_path = "../../etc/passwd"
    (copy / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UnsafeMetadataError, match="names data file '../../etc/passwd' outside"):
        read_metadata(copy)


# --- 2. no remote code without --trust-remote-code, no prompt ------------------------------------


def remote_code_source(tiny: Path, root: Path) -> tuple[Path, Path]:
    """A copy of ``tiny`` whose config.json asks for code in the folder (auto_map); the marker it makes."""
    import shutil

    src = root / "remote"
    shutil.copytree(tiny, src)
    marker = root / "ran-remote-code"
    (src / "my_config.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "from transformers import LlamaConfig\nclass MyConfig(LlamaConfig):\n    model_type = 'my_llama'\n")
    config = json.loads((src / "config.json").read_text())
    config.update(model_type="my_llama", auto_map={"AutoConfig": "my_config.MyConfig"})
    (src / "config.json").write_text(json.dumps(config))
    return src, marker


def test_export_from_an_auto_map_source_refuses_without_asking(tiny, ckpt, tmp_path, monkeypatch):
    src, marker = remote_code_source(tiny, tmp_path)
    monkeypatch.setattr("builtins.input", lambda *a: pytest.fail("hfpipe asked on stdin"))
    with pytest.raises(ValueError, match="needs remote code; pass --trust-remote-code"):
        export_checkpoint(ckpt, tmp_path / "out", source=src, progress=False)
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_the_console_never_reads_stdin_even_when_y_waits_there(tiny, ckpt, tmp_path):
    src, marker = remote_code_source(tiny, tmp_path)
    proc = subprocess.run([sys.executable, "-m", "hfpipe.cli.main", "export", str(ckpt), str(tmp_path / "out"),
                           "--source", str(src)], input="y\ny\n", capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[-1].startswith("error: ") and "--trust-remote-code" in proc.stderr
    assert "[y/N]" not in proc.stdout + proc.stderr and not marker.exists()


def test_every_transformers_loader_call_passes_trust_remote_code_explicitly():
    import re

    root = Path(__file__).resolve().parents[2]
    calls = re.compile(r"(AutoConfig|AutoTokenizer|AutoModelForCausalLM|AutoModel)\.from_(pretrained|config)\(")
    for path in [*root.joinpath("hfpipe").rglob("*.py"), *root.joinpath("cli").rglob("*.py")]:
        text = path.read_text()
        for m in calls.finditer(text):
            depth, end = 0, m.end() - 1
            for end in range(m.end() - 1, len(text)):
                depth += {"(": 1, ")": -1}.get(text[end], 0)
                if depth == 0:
                    break
            assert "trust_remote_code" in text[m.start():end], f"{path.name}: {text[m.start():end + 1]}"


# --- 3. shard names stay inside the model folder ----------------------------------------------------


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd", "sub/../../x.safetensors",
                                  "sub/model.safetensors", "..", "config.json", ""])
def test_an_index_naming_a_shard_outside_the_folder_is_refused(tiny, tmp_path, name):
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(tiny, folder)
    index = json.loads((folder / INDEX).read_text())
    key = sorted(index["weight_map"])[0]
    index["weight_map"][key] = name
    (folder / INDEX).write_text(json.dumps(index))
    with pytest.raises(SourceError, match=rf"{INDEX}: tensor '{key}' names shard .* not a plain file name"):
        ModelSource.open(folder)


def test_a_shard_that_is_a_symlink_as_in_the_hub_cache_is_fine(tiny, tmp_path):
    import shutil

    folder, blobs = tmp_path / "snapshots" / "abc", tmp_path / "blobs"
    shutil.copytree(tiny, folder)
    blobs.mkdir()
    for shard in folder.glob("*.safetensors"):
        shard.rename(blobs / shard.name)
        shard.symlink_to(Path("../..") / "blobs" / shard.name)
    src = ModelSource.open(folder)
    assert all(src.header(name) for name in set(src.weight_map.values()))


# --- 4. safetensors headers are checked totally before a byte is read ----------------------------


def shard(path: Path, header, data: bytes = b"", length: int | None = None) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


F32_2x2 = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
HEADERS = {
    "a list header": ([F32_2x2], 16, "header is a JSON list, not an object"),
    "no data_offsets": ({"w": {"dtype": "F32", "shape": [2, 2]}}, 16, "tensor 'w': data_offsets None"),
    "reversed offsets": ({"w": {**F32_2x2, "data_offsets": [16, 0]}}, 16, "tensor 'w': data_offsets [16, 0] are reversed"),
    "overlapping tensors": ({"a": F32_2x2, "b": {**F32_2x2, "data_offsets": [8, 24]}}, 24, "tensor 'b' data_offsets [8, 24] overlaps"),
    "a gap": ({"a": {**F32_2x2, "data_offsets": [4, 20]}}, 20, "leaves a gap at byte 0"),
    "offsets past the end": ({"w": F32_2x2}, 8, "truncated shard: its tensors need 16 data bytes but the file holds 8"),
    "trailing bytes": ({"w": F32_2x2}, 24, "8 bytes follow the last tensor"),
    "shape disagrees with bytes": ({"w": {**F32_2x2, "shape": [2, 3]}}, 16, "shape [2, 3] of F32 needs 24 bytes but data_offsets span 16"),
    "10 TB shape": ({"w": {**F32_2x2, "shape": [10**12, 10]}}, 16, "needs 40000000000000 bytes"),
    "unknown dtype": ({"w": {**F32_2x2, "dtype": "Q4"}}, 16, "tensor 'w': unknown dtype 'Q4'"),
    "negative shape": ({"w": {**F32_2x2, "shape": [-2, -2]}}, 16, "shape [-2, -2] is not a list of non-negative"),
    "entry not an object": ({"w": [1, 2]}, 16, "tensor 'w': entry is not an object"),
    "bad __metadata__": ({"__metadata__": {"a": 1}, "w": F32_2x2}, 16, "__metadata__ must map strings to strings"),
}


@pytest.mark.parametrize("case", HEADERS, ids=list(HEADERS))
def test_every_header_defect_is_refused_naming_file_and_tensor(tmp_path, case):
    header, nbytes, message = HEADERS[case]
    path = shard(tmp_path / "model.safetensors", header, bytes(nbytes))
    with pytest.raises(SafetensorsError, match=rf"^{path}: .*{__import__('re').escape(message)}"):
        read_header(path)


def test_a_huge_header_length_is_refused_before_allocating(tmp_path):
    path = shard(tmp_path / "model.safetensors", {"w": F32_2x2}, bytes(16), length=10**13)
    with pytest.raises(SafetensorsError, match="corrupt safetensors header length 10000000000000"):
        read_header(path)


def test_duplicate_tensor_names_are_refused(tmp_path):
    path = tmp_path / "model.safetensors"
    raw = b'{"w": %s, "w": %s}' % (json.dumps(F32_2x2).encode(), json.dumps(F32_2x2).encode())
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(16))
    with pytest.raises(SafetensorsError, match="duplicate key 'w'"):
        read_header(path)


def test_a_real_shard_passes(tiny):
    for path in tiny.glob("*.safetensors"):
        assert read_header(path)


# --- 5. export copies only regular files inside the source ----------------------------------------


def test_export_does_not_follow_a_symlinked_side_file_out_of_the_source(tiny, ckpt, tmp_path):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(tiny, src)
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2")
    (src / "secrets.txt").symlink_to(secret)
    (src / "README.md").write_text("kept")
    (src / "LICENSE").symlink_to(src / "README.md")  # a link inside the source is fine
    out = export_checkpoint(ckpt, tmp_path / "out", source=src, progress=False)
    assert not (out / "secrets.txt").exists()
    assert (out / "README.md").read_text() == "kept" and (out / "LICENSE").read_text() == "kept"
