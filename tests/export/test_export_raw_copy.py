"""Export writes safetensors files itself and copies DCP items file to file where it can.

The shard writer's files must be plain safetensors; a checkpoint that training sharded over dp
(FSDP2 row blocks, several DCP chunks per tensor) must export bit for bit through kernel copies.
"""

from __future__ import annotations

import errno
import json
import os
import threading

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from _dist import run_ranks, tiny_checkpoint
from hfpipe.checkpoint import dcp_raw
from hfpipe.export import hf_folder as export_mod
from hfpipe.export.hf_folder import ExportError, export_checkpoint
from hfpipe.export.hf_writer import ShardWriter
from test_export_hf_folder import make_dcp_checkpoint
from hfpipe.checkpoint.dcp import record_checksums


def test_shard_writer_files_are_safetensors(tmp_path):
    tensors = {"b": torch.randn(3, 5).to(torch.bfloat16), "a": torch.randn(7), "ids": torch.arange(4),
               "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3)}
    w = ShardWriter(tmp_path / "x.safetensors", {k: (t.shape, t.dtype) for k, t in tensors.items()})
    for k in ["ids", "scalar", "b", "empty", "a"]:  # any order
        w.write(k, tensors[k])
    w.close()
    got = load_file(tmp_path / "x.safetensors")
    assert set(got) == set(tensors)
    for k, t in tensors.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t)
    with safe_open(tmp_path / "x.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}


def save_dp_sharded(src: str, ckpt: str) -> None:
    """Save the source model as FSDP2 would over dp=2: every tensor split into row blocks."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Shard, distribute_tensor
    from transformers import AutoModelForCausalLM

    from hfpipe.parallel.mesh import init_distributed

    d = init_distributed(1, 2)
    model = AutoModelForCausalLM.from_pretrained(src)
    state = {"model." + k: distribute_tensor(v.contiguous(), d.mesh["dp"], [Shard(0)])
             for k, v in model.state_dict().items()}
    dcp.save(state, checkpoint_id=ckpt)


def test_a_dp_sharded_checkpoint_exports_bit_for_bit_by_kernel_copies(tmp_path, monkeypatch):
    src = tiny_checkpoint("llama", num_hidden_layers=4)
    ckpt = tmp_path / "ckpt"
    run_ranks(save_dp_sharded, 2, str(src), str(ckpt))
    meta = {"format": 1, "step": 1, "source": str(src), "source_dtype": "float32", "tied": False, "config": {}}
    (ckpt / "hfpipe.json").write_text(json.dumps(meta))
    record_checksums(ckpt)  # as every checkpoint hfpipe saves
    reader = export_mod._DcpReader(ckpt)
    assert max(len(md.chunks) for md in reader.metadata.state_dict_metadata.values()
               if hasattr(md, "chunks")) == 2, "tensors really are split in row blocks"
    copies, converted = [], []
    copy, convert = dcp_raw.copy_span, export_mod._convert_group
    monkeypatch.setattr(dcp_raw, "copy_span", lambda *a: copies.append(a) or copy(*a))
    monkeypatch.setattr(export_mod, "_convert_group", lambda *a: converted.append(a) or convert(*a))
    out = export_checkpoint(ckpt, tmp_path / "out", max_shard_size="100KB", progress=False)
    assert copies and not converted
    want = {}
    for f in src.glob("*.safetensors"):
        want.update(load_file(f))
    got = {}
    for f in out.glob("*.safetensors"):
        got.update(load_file(f))
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_the_copy_pool_fills_two_files_at_once(tmp_path, monkeypatch):
    # The kernel serialises writers to one file, so the pool's unit is a file: two files, two threads.
    src = tmp_path / "src.bin"
    src.write_bytes(bytes(range(256)) * 64)
    both_started = threading.Barrier(2, timeout=30)
    copy = dcp_raw.copy_span

    def copy_when_both_run(*args):
        both_started.wait()  # BrokenBarrierError after 30 s if the files were copied one by one
        copy(*args)

    monkeypatch.setattr(dcp_raw, "copy_span", copy_when_both_run)
    fds = [os.open(tmp_path / f"out{i}.bin", os.O_WRONLY | os.O_CREAT) for i in range(2)]
    copied = []  # the progress callback: bytes of each span once it is in place
    try:
        with dcp_raw.CopyPool(workers=2, progress=copied.append) as pool:
            jobs = [pool.run(fd, [(dcp_raw.RawSpan(src, 1000 * i, 5000, 0), 0)]) for i, fd in enumerate(fds)]
            for job in jobs:
                job.result()
    finally:
        for fd in fds:
            os.close(fd)
    for i in range(2):
        assert (tmp_path / f"out{i}.bin").read_bytes() == src.read_bytes()[1000 * i:1000 * i + 5000]
    assert copied == [5000, 5000]


def test_a_copy_failing_in_a_pool_thread_fails_the_export_and_leaves_nothing(tmp_path, monkeypatch):
    ckpt = make_dcp_checkpoint(tiny_checkpoint("llama", num_hidden_layers=4), tmp_path / "ckpt")
    calls, copy = [], dcp_raw.copy_span

    def full_at_the_third(*args):
        calls.append(args)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        copy(*args)

    monkeypatch.setattr(dcp_raw, "copy_span", full_at_the_third)
    with pytest.raises(ExportError, match="disk full while writing .*out .*the partial folder was removed"):
        export_checkpoint(ckpt, tmp_path / "out", max_shard_size="100KB", progress=False)
    assert len(calls) >= 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
