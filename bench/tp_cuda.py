"""Benchmark: tensor parallelism on CUDA when the machine has only one GPU: pp 1 x tp 2 against tp 1.

NCCL refuses two ranks on one device ("invalid usage", measured on an H200), and hfpipe refuses to start
them (:func:`hfpipe.parallel.mesh.check_gpus`). This bench puts both tp ranks on ``cuda:0`` anyway, on a
gloo process group it opens itself (gloo carries CUDA tensors through host memory), so that hfpipe's
tp code path runs on the device's kernels: DTensor's redistributions, the vocab-parallel embedding and
loss, sequence parallelism. Side by side in one run, same model and tokens:

- **tp1**: ``load_pipeline(pp=1)`` in one rank on NCCL, as hfpipe picks it;
- **tp2**: ``load_pipeline(pp=1, tp=2)`` in two ranks sharing the GPU, over gloo.

Printed: the losses of both (fp32: they must agree to the tp tolerance), tokens/s of each and their
ratio, and the peak device memory a rank holds. The tokens/s of tp2 is not tp's speed on two GPUs:
both ranks share one device and every collective goes through host memory. It says what the one GPU
can tell: that the path runs on CUDA, exactly, and what it costs there.

Measured on an H200 (torch 2.11+cu130): with sequence parallelism on, gloo's all-gather of the
sequence shards on CUDA tensors crashes the process (SIGSEGV in ``wait_tensor`` of a functional
all-gather; the same collective called synchronously works), so run it with ``--no-sp`` there.

Run:  python bench/tp_cuda.py [--hidden 1024] [--layers 4] [--seq 512] [--batch 4] [--steps 4] [--dtype fp32]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from cuda import _build


def _worker(path: str, tp: int, a: argparse.Namespace) -> dict:
    import torch.distributed as dist

    from hfpipe.api import load_pipeline
    from hfpipe.parallel.dims import ParallelDims
    from hfpipe.parallel.mesh import init_distributed
    from hfpipe.train.optim import build_optimizer

    if tp > 1:  # both ranks on cuda:0, on a gloo group opened here (see the module's docstring)
        os.environ["LOCAL_WORLD_SIZE"] = "1"
        dist.init_process_group("gloo")
    info = init_distributed(ParallelDims(pp=1, tp=tp))
    pm = load_pipeline(path, pp=1, tp=tp, schedule="gpipe", microbatches=1, dist=info, dtype=a.dtype,
                       sequence_parallel=tp > 1 and a.sp)
    trainer = pm.trainer(build_optimizer(pm.modules, lr=1e-4, weight_decay=0.0), max_grad_norm=1.0)
    g = torch.Generator().manual_seed(0)
    vocab = pm.source.config.vocab_size
    batches = [torch.randint(3, vocab, (a.batch, a.seq), generator=g) for _ in range(a.steps + 1)]
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    walls, losses = [], []
    for i, ids in enumerate(batches):
        dist.barrier()
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        t0 = time.perf_counter()
        losses.append(trainer.step({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}).loss)
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        if i:  # the first step builds the schedule
            walls.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    device = str(next(iter(pm.named_parameters()))[1].device)
    return {"wall": statistics.median(walls), "loss": losses, "peak": peak, "device": device,
            "backend": dist.get_backend()}


def _shared_rank(rank: int, path: str, a: argparse.Namespace, port: int, out: str) -> None:
    """One of two tp ranks started by :func:`_on_one_device` (hfpipe's launcher refuses two ranks a GPU)."""
    import json

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    Path(out, f"{rank}.json").write_text(json.dumps(_worker(path, 2, a)))


def _on_one_device(path: str, a: argparse.Namespace) -> dict[int, dict]:
    import json

    import torch.multiprocessing as mp

    from hfpipe.parallel.mesh import _free_port

    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_shared_rank, args=(path, a, _free_port(), out), nprocs=2)
        return {r: json.loads(Path(out, f"{r}.json").read_text()) for r in range(2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("hidden", 1024), ("layers", 4), ("seq", 512), ("batch", 4), ("steps", 4)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16-mixed"))
    p.add_argument("--no-sp", dest="sp", action="store_false", help="tp without sequence parallelism")
    a = p.parse_args()
    from hfpipe.parallel.launch import launch

    work = Path(tempfile.mkdtemp(prefix="hfpipe-bench-tpcuda-"))
    try:
        _build(work / "model", a, min_kv_heads=2)  # bench/cuda.py's model; tp 2 splits its kv heads
        one = launch(_worker, 1, str(work / "model"), 1, a)[0]
        two = _on_one_device(str(work / "model"), a)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    tokens = a.batch * a.seq
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    print(f"{name}, {a.dtype}, Llama hidden {a.hidden} x {a.layers} layers, {tokens} tokens a step, "
          f"sequence parallel {'on' if a.sp else 'off'}")
    print(f"tp1: {one['device']} over {one['backend']}; tp2: {two[0]['device']} and {two[1]['device']} "
          f"over {two[0]['backend']}")
    slow = max(r["wall"] for r in two.values())
    print(f"tokens/s  tp1 {tokens / one['wall']:.0f}  tp2 {tokens / slow:.0f}  ratio tp2/tp1 {one['wall'] / slow:.3f}")
    print(f"peak device memory a rank: tp1 {one['peak'] / 2**30:.3f} GiB, tp2 "
          f"{max(r['peak'] for r in two.values()) / 2**30:.3f} GiB (both tp2 ranks share the device)")
    diff = max(abs(x - y) for x, y in zip(one["loss"], two[0]["loss"]))
    print(f"losses tp1 {[round(x, 6) for x in one['loss']]}; largest difference tp2 {diff:.2e}")


if __name__ == "__main__":
    main()
