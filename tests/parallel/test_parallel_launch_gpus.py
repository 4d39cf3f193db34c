"""One rank per GPU: NCCL refuses two ranks on one device ("invalid usage" on an H200, NCCL 2.28), so
hfpipe names the problem before a process group starts, and the quickstart runs on CPU processes.

The GPUs are faked (``torch.cuda.is_available`` / ``device_count``): this machine has none."""

from __future__ import annotations

import os

import pytest
import torch

from hfpipe.parallel.launch import check_launch
from hfpipe.parallel.mesh import LaunchError, check_gpus, pick_device


@pytest.fixture
def one_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_more_ranks_on_a_node_than_gpus_is_one_line_before_any_process(one_gpu):
    with pytest.raises(LaunchError, match=r"2 ranks on this node .* but 1 GPU\(s\) visible: NCCL runs one rank "
                                          r"per GPU.*CUDA_VISIBLE_DEVICES=''"):
        check_launch(2, 1, 0, None, None)


def test_a_torchrun_worker_on_a_shared_gpu_names_it_instead_of_an_nccl_error(one_gpu, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(LaunchError, match="2 ranks on this node"):
        pick_device(1)


def test_as_many_ranks_as_gpus_and_hidden_gpus_pass(one_gpu, monkeypatch):
    check_gpus(1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # ranks then start on CPU: nothing to share
    check_gpus(4)


def test_the_quickstart_runs_on_cpu_processes_when_gpus_are_fewer_than_its_ranks(one_gpu, monkeypatch):
    from hfpipe.quickstart import _cpu_if_too_few_gpus

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # restored after the test
    said = []
    _cpu_if_too_few_gpus(2, said.append)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    assert said == ["    1 GPU(s) here for 2 ranks (one rank per GPU): the quickstart runs on CPU processes"]
    check_gpus(2)  # the launch that follows passes
