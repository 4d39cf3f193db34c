"""Benchmark: tensor parallelism (pp 1 x tp 2) against one rank (pp 1 x tp 1), same tokens.

Builds a random Llama (default hidden 512, 4 layers, fp32) and trains it for a few steps, once on one
process and once on two tp ranks (sequence parallel). Per mode, side by side in one run:

- bytes a rank holds: its parameters' local bytes after loading (goal at tp 2: ratio <= 0.55; norms
  stay whole on every rank, so it is a little above 0.50);
- bytes a rank read from the checkpoint, against its share (the tp 1 read divided by tp): rows of a
  row-split matrix are read alone, a column split is read whole and sliced, so the ratio says what
  column splits cost;
- step time: median wall time of the timed steps (the first, which builds the schedule, excluded) and the
  ratio tp2/tp1. On 2 shared CPU cores the tp collectives are local copies through gloo: printed, not judged;
- the losses of both modes, which must agree (the same model and tokens).

The bytes the tp collectives move are not counted here yet (DTensor's redistributions run through
torch's functional collectives, which this benchmark does not wrap).

Run:  python bench/tp.py [--hidden 512] [--layers 4] [--seq 64] [--batch 4] [--steps 3]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch


def _worker(path: str, tp: int, steps: int, batch: int, seq: int) -> dict:
    import torch.distributed as dist

    from hfpipe.api import load_pipeline
    from hfpipe.parallel.dims import ParallelDims
    from hfpipe.parallel.mesh import init_distributed
    from hfpipe.train.optim import build_optimizer

    info = init_distributed(ParallelDims(pp=1, tp=tp))
    pm = load_pipeline(path, pp=1, tp=tp, schedule="1f1b", microbatches=1, dist=info)
    held = sum((p.to_local() if hasattr(p, "to_local") else p).nbytes for _, p in pm.named_parameters())
    trainer = pm.trainer(build_optimizer(pm.modules, lr=1e-4), max_grad_norm=1.0)
    ids = torch.randint(3, pm.source.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    data = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    walls, losses = [], []
    for i in range(steps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        losses.append(trainer.step(data).loss)
        if i:  # the first step builds the schedule
            walls.append(time.perf_counter() - t0)
    return {"held": held, "read": pm.load_stats.bytes_read, "wall": statistics.median(walls), "loss": losses}


def _build(folder: Path, a: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=8192, hidden_size=a.hidden, intermediate_size=3 * a.hidden, num_hidden_layers=a.layers,
                      num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder, max_shard_size="50MB")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("hidden", 512), ("layers", 4), ("seq", 64), ("batch", 4), ("steps", 3)):
        p.add_argument(f"--{name}", type=int, default=default)
    a = p.parse_args()
    from hfpipe.parallel.launch import launch

    work = Path(tempfile.mkdtemp(prefix="hfpipe-bench-tp-"))
    try:
        _build(work / "model", a)
        runs = {tp: launch(_worker, tp, str(work / "model"), tp, a.steps, a.batch, a.seq, threads_per_rank=1)
                for tp in (1, 2)}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    one, two = runs[1][0], max(runs[2].values(), key=lambda r: r["held"])
    print(f"bytes a rank holds, tp2 / tp1:        {two['held'] / one['held']:.3f}  (goal <= 0.55)")
    print(f"bytes a rank read / its share (tp2):  {two['read'] / (one['read'] / 2):.3f}  (1.00: rows only)")
    print(f"step time, tp2 / tp1:                 {two['wall'] / one['wall']:.2f}  (gloo on shared CPU cores)")
    diff = max(abs(x - y) for x, y in zip(one["loss"], two["loss"]))
    print(f"losses tp1 {[round(x, 6) for x in one['loss']]}, largest difference at tp2 {diff:.2e}")


if __name__ == "__main__":
    main()
