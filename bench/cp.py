"""Benchmark: context parallelism (pp 1 x cp 2) against one rank (pp 1 x cp 1), same tokens.

Builds a random Llama (default hidden 256, 4 layers, GQA 8 heads / 4 kv heads, fp32) and trains it for a
few steps on packed rows (documents of a quarter row each, positions restarting), once on one process and
once on two cp ranks. Side by side in one run:

- activation bytes a rank holds: what one step's forward saves for backward (autograd's saved tensors,
  each storage once, parameters left out), one microbatch, full logits in the forward (no chunked loss).
  Goal at cp 2: <= 0.55 at a sequence where activations dominate; above 0.50 by the K and V each rank
  gathers whole, and the mask of its queries over the whole sequence;
- collective bytes: the K/V bytes the gathers received (counted from the tensors they moved, forward and
  backward, :class:`hfpipe.parallel.context.ContextParallel`) over the analytic
  :func:`hfpipe.plan.context.kv_gather_bytes` for the same steps (1.00: the planner prices what runs),
  the steps after the first; the first step moves 1.5x a step: torch's ``PipelineStage`` infers its
  output shapes with one more forward on real tensors (ones) when a schedule is built, gathers included;
- step time: median wall time of the timed steps (the first, which builds the schedule, excluded) and the
  ratio cp2/cp1. On 2 shared CPU cores the gathers are local copies through gloo: printed, not judged;
- the losses of both modes, which must agree (the same model and tokens).

Measured here (2 shared CPU cores, 2026-11-26): at seq 2048 a cp rank holds 0.525x the cp 1 activation
bytes (0.554x at seq 1024, where the gathered K/V and the mask weigh more), K/V bytes 1.00x the analytic.

Run:  python bench/cp.py [--hidden 256] [--layers 4] [--seq 2048] [--batch 1] [--steps 2]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch


def _saved_bytes(step) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``step()`` runs, parameters excluded."""
    seen: dict[int, int] = {}

    def pack(t):
        if not (t.is_leaf and t.requires_grad) and t.device.type != "meta":
            s = t.untyped_storage()
            seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(seen.values())


def _batch(vocab: int, batch: int, seq: int) -> dict:
    ids = torch.randint(3, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(seq).remainder(seq // 4).expand(batch, seq)  # four packed documents a row
    return {"input_ids": ids, "position_ids": pos, "labels": ids}


def _worker(path: str, cp: int, steps: int, batch: int, seq: int) -> dict:
    import torch.distributed as dist

    from hfpipe.api import load_pipeline
    from hfpipe.parallel.dims import ParallelDims
    from hfpipe.parallel.mesh import init_distributed
    from hfpipe.train.optim import build_optimizer

    info = init_distributed(ParallelDims(pp=1, cp=cp))
    pm = load_pipeline(path, pp=1, cp=cp, schedule="1f1b", microbatches=1, dist=info, loss_chunk_tokens=0)
    trainer = pm.trainer(build_optimizer(pm.modules, lr=1e-4), max_grad_norm=1.0)
    data = _batch(pm.source.config.vocab_size, batch, seq)
    walls, losses, received = [], [], []
    for i in range(steps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        losses.append(trainer.step(data).loss)
        if i:  # the first step builds the schedule
            walls.append(time.perf_counter() - t0)
        received.append(pm.pipe.context.received_bytes if pm.pipe.context else 0)
    held = _saved_bytes(lambda: trainer.step(data))
    return {"held": held, "first": received[0], "received": received[-1] - received[0],
            "wall": statistics.median(walls), "loss": losses}


def _build(folder: Path, a: argparse.Namespace):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=2048, hidden_size=a.hidden, intermediate_size=3 * a.hidden, num_hidden_layers=a.layers,
                      num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False,
                      max_position_embeddings=max(2048, a.seq))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder, max_shard_size="50MB")
    return cfg


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("hidden", 256), ("layers", 4), ("seq", 2048), ("batch", 1), ("steps", 2)):
        p.add_argument(f"--{name}", type=int, default=default)
    a = p.parse_args()
    from hfpipe.parallel.launch import launch
    from hfpipe.plan.context import kv_gather_bytes

    work = Path(tempfile.mkdtemp(prefix="hfpipe-bench-cp-"))
    try:
        cfg = _build(work / "model", a)
        runs = {cp: launch(_worker, cp, str(work / "model"), cp, a.steps, a.batch, a.seq, threads_per_rank=1)
                for cp in (1, 2)}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    one, two = runs[1][0], max(runs[2].values(), key=lambda r: r["held"])
    head = cfg.hidden_size // cfg.num_attention_heads
    per_step = kv_gather_bytes(batch=a.batch, seq_len=a.seq, cp=2, kv_heads=cfg.num_key_value_heads, k_dim=head,
                               v_dim=head, dtype_bytes=4, layers=a.layers)
    analytic = per_step * a.steps  # the timed steps, one microbatch each
    print(f"activation bytes a rank holds, cp2 / cp1: {two['held'] / one['held']:.3f}  "
          f"({two['held'] / 2**20:.1f} / {one['held'] / 2**20:.1f} MiB; goal <= 0.55)")
    print(f"K/V bytes received, measured / analytic:  {two['received'] / analytic:.2f}  "
          f"({two['received']} / {analytic}; plan.context.kv_gather_bytes, steps after the first)")
    print(f"K/V bytes of the first step / a step:     {two['first'] / per_step:.2f}  "
          "(torch's stage infers shapes with one more forward when it builds a schedule)")
    print(f"step time, cp2 / cp1:                     {two['wall'] / one['wall']:.2f}  "
          f"({two['wall']:.3f} s / {one['wall']:.3f} s; gloo on shared CPU cores)")
    diff = max(abs(x - y) for x, y in zip(one["loss"], two["loss"]))
    print(f"losses cp1 {[round(x, 6) for x in one['loss']]}, largest difference at cp2 {diff:.2e}")


if __name__ == "__main__":
    main()
