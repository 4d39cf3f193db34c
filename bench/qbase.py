"""Benchmark: LoRA on a quantized frozen base (``--quantize-base nf4|fp8``) against LoRA on a bf16 base.

Builds a random Llama (default 8 layers, hidden 1024, ~100M parameters; a small vocabulary so that
embedding and head weigh what they weigh in a 70B model, ~3%) and trains LoRA rank 8 on every
linear for a few steps at pp=2 with 1F1B in bf16, three times in fresh processes: bf16 base, NF4
base, FP8 base (quantized at load). Per mode and stage rank it reports:

- stage weight bytes: every parameter and buffer the rank's stage modules hold (NF4: codes,
  int8 scales and their factors; FP8: codes and fp32 tile scales), frozen base alone and with the
  fp32 adapters; the ratio to the bf16 run is the issue's goal (<= 0.30 NF4, <= 0.52 FP8, base);
- peak memory above the rank's start-up baseline over load and steps: ``torch.cuda``'s peak
  allocation on a GPU, peak RSS (``ru_maxrss``) on CPU (which also counts the allocator's cache);
- step time: median of the timed steps (first, warm-up step excluded), wall and CPU time.

Run:  python bench/qbase.py [--hidden 1024] [--layers 8] [--vocab 2048] [--steps 3]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

MODES = ("bf16", "nf4", "fp8")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _tensor_bytes(t: torch.Tensor) -> int:
    t = getattr(t, "_local_tensor", t)
    if hasattr(t, "quantized_data"):  # torchao NF4Tensor: codes, int8 scales, their factors and mean
        return sum(getattr(t, a).nbytes for a in ("quantized_data", "quantized_scalers", "quantization_factor",
                                                   "scaler_mean"))
    return t.nbytes


def _stage_bytes(modules) -> tuple[int, int]:
    """(frozen base bytes, adapter bytes) held by this rank's stage modules."""
    seen, base, adapters = set(), 0, 0
    for m in modules:
        for t in list(m.parameters()) + list(m.buffers()):
            if id(t) in seen:
                continue
            seen.add(id(t))
            if getattr(t, "requires_grad", False):
                adapters += _tensor_bytes(t)
            else:
                base += _tensor_bytes(t)
    return base, adapters


def _worker(path: str, mode: str, steps: int, batch: int, seq: int) -> dict:
    import torch.distributed as dist

    from hfpipe.api import load_pipeline
    from hfpipe.lora import lora_config
    from hfpipe.parallel.mesh import init_distributed
    from hfpipe.train.optim import build_optimizer

    info = init_distributed(2)
    cuda = info.device.type == "cuda"
    baseline = torch.cuda.memory_allocated() if cuda else _rss()
    quant = None if mode == "bf16" else mode
    pm = load_pipeline(path, pp=2, schedule="1f1b", microbatches=4, dist=info, dtype="bf16",
                       lora=lora_config(8, targets="all-linear"), quantize_base=quant)
    base, adapters = _stage_bytes(pm.modules)
    trainer = pm.trainer(build_optimizer(pm.modules, lr=1e-4), max_grad_norm=1.0)
    ids = torch.randint(3, pm.source.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    data = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    times, cpu = [], []
    for _ in range(steps + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        trainer.step(data)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    if cuda:
        peak = torch.cuda.max_memory_allocated() - baseline
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline
    dist.barrier()
    dist.destroy_process_group()
    return {"rank": info.rank, "base": base, "adapters": adapters, "peak": peak,
            "step_s": statistics.median(times[1:]), "cpu_s": statistics.median(cpu[1:]),
            "device": info.device.type}


def _model(work: Path, hidden: int, layers: int, vocab: int) -> Path:
    from hfpipe.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(work / "model", "llama", hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                                num_hidden_layers=layers, num_attention_heads=hidden // 64,
                                num_key_value_heads=max(1, hidden // 256), vocab_size=vocab,
                                max_position_embeddings=1024, max_shard_size="500MB", tokenizer=False)


def _run(path: Path, mode: str, args) -> list[dict]:
    from hfpipe.parallel.launch import launch

    results = launch(_worker, 2, str(path), mode, args.steps, args.batch, args.seq, threads_per_rank=args.threads)
    return sorted(results.values(), key=lambda r: r["rank"])


def _mb(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def _report(runs: dict[str, list[dict]]) -> None:
    ref = runs["bf16"]
    rows = []
    for r in range(2):
        for what, get in (("base weight bytes", lambda x: x["base"]),
                          ("stage weight bytes (base + adapters)", lambda x: x["base"] + x["adapters"]),
                          ("peak memory above baseline", lambda x: x["peak"])):
            rows.append((f"{what}, rank {r}", [_mb(get(runs[m][r])) for m in MODES],
                         [get(runs[m][r]) / get(ref[r]) for m in MODES[1:]]))
    for r in range(2):
        rows.append((f"step CPU time (median), rank {r}", [f"{runs[m][r]['cpu_s']:.3f} s" for m in MODES],
                     [runs[m][r]["cpu_s"] / ref[r]["cpu_s"] for m in MODES[1:]]))
    wall = {m: max(x["step_s"] for x in runs[m]) for m in MODES}
    rows.append(("step time (median, slower rank)", [f"{wall[m]:.3f} s" for m in MODES],
                 [wall[m] / wall["bf16"] for m in MODES[1:]]))
    width = max(len(r[0]) for r in rows)
    print(f"{'':{width}}  {'bf16 base':>12}  {'NF4 base':>12}  {'FP8 base':>12}  {'NF4/bf16':>8}  {'FP8/bf16':>8}")
    for name, values, ratios in rows:
        print(f"{name:{width}}  " + "  ".join(f"{v:>12}" for v in values) + "  "
              + "  ".join(f"{x:8.3f}" for x in ratios))
    nf4 = max(runs["nf4"][r]["base"] / ref[r]["base"] for r in range(2))
    fp8 = max(runs["fp8"][r]["base"] / ref[r]["base"] for r in range(2))
    print(f"goal base weight bytes <= 0.30 of bf16 (NF4): {'met' if nf4 <= 0.30 else 'NOT met'} ({nf4:.3f}); "
          f"<= 0.52 (FP8): {'met' if fp8 <= 0.52 else 'NOT met'} ({fp8:.3f}); device {ref[0]['device']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4, help="sequences per step (4 microbatches)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up step)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    if args.layers < 8:
        parser.error("--layers must be >= 8 (the issue's bar)")
    work = Path(tempfile.mkdtemp(prefix="hfpipe-bench-qbase-", dir=args.workdir))
    try:
        path = _model(work, args.hidden, args.layers, args.vocab)
        print(f"model: Llama, hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; LoRA r=8 all-linear, "
              f"bf16, pp=2 1f1b, batch {args.batch} x {args.seq} tokens, 4 microbatches")
        _report({mode: _run(path, mode, args) for mode in MODES})
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
