"""Benchmark: LoRA (rank 16, every linear layer) against full fine-tuning, same model and batch, pp=2.

Builds a random Llama (default ~80M parameters, fp32) and trains it for a few steps at pp=2 with
1F1B, once with every weight trainable and once with PEFT LoRA adapters on a frozen base, each in
fresh processes. Per mode it reports:

- peak RSS above baseline of each stage rank: ``ru_maxrss`` after the timed steps minus the rank's
  resident size right after start-up (torch/transformers/peft imported, process group up), so it
  counts the weights, gradients, optimizer state and activations of training;
- step time: the median of the timed steps (the first, warm-up step excluded), as wall time and
  as the rank's CPU time (``time.process_time``): on a shared machine the wall time swings with
  other jobs' load (measured here: the same full-fine-tuning step took 13 to 24 s), the CPU time
  far less, so the goal is judged on both;
- checkpoint bytes: the files of one ``save_checkpoint`` (model/adapters, AdamW state, RNG).

Goals: LoRA checkpoint <= 2% of full fine-tuning's; LoRA step time <= full's.

Run:  python bench/lora.py [--hidden 1024] [--layers 4] [--vocab 16384] [--steps 4] [--keep]
"""

from __future__ import annotations

import argparse
import resource
import shutil
import statistics
import tempfile
from pathlib import Path

import torch

from _measure import rss, timed_steps

REPO = Path(__file__).resolve().parents[1]


def _worker(path: str, mode: str, out: str, steps: int, batch: int, seq: int) -> dict:
    """One stage rank: train ``steps`` + 1 steps, then save a checkpoint; return the measurements."""
    import torch.distributed as dist

    from hfpipe.api import load_pipeline
    from hfpipe.parallel.mesh import init_distributed
    from hfpipe.lora.adapters import lora_config
    from hfpipe.train.optim import build_optimizer

    dist_info = init_distributed(2)
    baseline = rss()
    lora = lora_config(16, alpha=32, targets="all-linear") if mode == "lora" else None
    pm = load_pipeline(path, pp=2, schedule="1f1b", microbatches=4, dist=dist_info, lora=lora)
    optimizer = build_optimizer(pm.modules, lr=1e-4)
    trainer = pm.trainer(optimizer, max_grad_norm=1.0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, pm.source.config.vocab_size, (batch, seq), generator=g)
    data = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    times, cpu = timed_steps(trainer, data, steps)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline  # before the save's copies
    ckpt = pm.save_checkpoint(out, steps, optimizer)
    size = sum(p.stat().st_size for p in Path(ckpt).iterdir()) if dist_info.rank == 0 else None
    trainable = sum(p.numel() for p in pm.parameters())
    dist.barrier()
    dist.destroy_process_group()
    return {"rank": dist_info.rank, "peak": peak, "step_s": statistics.median(times[1:]),
            "cpu_s": statistics.median(cpu[1:]), "ckpt": size, "trainable": trainable}


def _model(work: Path, hidden: int, layers: int, vocab: int) -> Path:
    from hfpipe.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(work / "model", "llama", hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                                num_hidden_layers=layers, num_attention_heads=hidden // 64,
                                num_key_value_heads=hidden // 256, vocab_size=vocab, max_position_embeddings=1024,
                                max_shard_size="500MB", tokenizer=False)


def _run(path: Path, mode: str, work: Path, args) -> dict:
    from hfpipe.parallel.launch import launch

    results = launch(_worker, 2, str(path), mode, str(work / f"ckpt-{mode}"), args.steps, args.batch, args.seq,
                     threads_per_rank=args.threads)
    ranks = sorted(results.values(), key=lambda r: r["rank"])
    return {"peak": [r["peak"] for r in ranks], "step_s": max(r["step_s"] for r in ranks),
            "cpu_s": [r["cpu_s"] for r in ranks],
            "ckpt": next(r["ckpt"] for r in ranks if r["ckpt"] is not None),
            "trainable": sum(r["trainable"] for r in ranks)}


def _mb(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--batch", type=int, default=4, help="sequences per step (4 microbatches)")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4, help="timed steps (after one warm-up step)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hfpipe-bench-lora-", dir=args.workdir))
    try:
        path = _model(work, args.hidden, args.layers, args.vocab)
        params = sum(_numel(shape) for shape in _shapes(path))
        print(f"model: Llama, {params / 1e6:.1f}M parameters (hidden {args.hidden}, {args.layers} layers, "
              f"vocab {args.vocab}), fp32; pp=2 1f1b, batch {args.batch} x {args.seq} tokens, 4 microbatches")
        full, lora = _run(path, "full", work, args), _run(path, "lora", work, args)
        _report(full, lora)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def _shapes(path: Path):
    from safetensors import safe_open

    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            for k in st.keys():
                yield st.get_slice(k).get_shape()


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _report(full: dict, lora: dict) -> None:
    rows = [("trainable parameters", f"{full['trainable']:,}", f"{lora['trainable']:,}",
             lora["trainable"] / full["trainable"])]
    for r in range(2):
        rows.append((f"peak RSS above baseline, rank {r}", _mb(full["peak"][r]), _mb(lora["peak"][r]),
                     lora["peak"][r] / full["peak"][r]))
    rows.append(("step time (median, slower rank)", f"{full['step_s']:.3f} s", f"{lora['step_s']:.3f} s",
                 lora["step_s"] / full["step_s"]))
    for r in range(2):
        rows.append((f"step CPU time (median), rank {r}", f"{full['cpu_s'][r]:.3f} s", f"{lora['cpu_s'][r]:.3f} s",
                     lora["cpu_s"][r] / full["cpu_s"][r]))
    rows.append(("checkpoint bytes", _mb(full["ckpt"]), _mb(lora["ckpt"]), lora["ckpt"] / full["ckpt"]))
    width = max(len(r[0]) for r in rows)
    print(f"{'':{width}}  {'full':>14}  {'LoRA r=16':>14}  {'LoRA/full':>9}")
    for name, a, b, ratio in rows:
        print(f"{name:{width}}  {a:>14}  {b:>14}  {ratio:9.4f}")
    ckpt_ok = lora["ckpt"] <= 0.02 * full["ckpt"]
    wall_ok = lora["step_s"] <= full["step_s"]
    cpu_ok = all(a <= b for a, b in zip(lora["cpu_s"], full["cpu_s"]))
    print(f"goal checkpoint <= 2% of full: {'met' if ckpt_ok else 'NOT met'} "
          f"({100 * lora['ckpt'] / full['ckpt']:.2f}%); goal step time <= full's: wall "
          f"{'met' if wall_ok else 'NOT met'}, CPU {'met' if cpu_ok else 'NOT met'}")


if __name__ == "__main__":
    main()
