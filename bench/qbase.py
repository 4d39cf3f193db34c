"""Benchmark: LoRA on a quantized frozen base (``--quantize-base nf4|fp8``) against LoRA on a bf16 base.

Builds a random Llama (default 8 layers, hidden 1024, ~95M parameters; a small vocabulary so that
embedding and head weigh in a stage what they weigh in Llama-3.1-70B's at pp 2, ~3%) and trains LoRA rank 8 on every
linear for a few steps at pp=2 with 1F1B in bf16, three times in fresh processes: bf16 base, NF4
base, FP8 base (quantized at load). Per mode and stage rank it reports:

- stage weight bytes: every parameter and buffer the rank's stage modules hold (NF4: codes,
  int8 scales and their factors; FP8: codes and fp32 tile scales), frozen base alone and with the
  fp32 adapters; the ratio to the bf16 run is the issue's goal (<= 0.30 NF4, <= 0.52 FP8, base);
- memory above the rank's start-up baseline: held after load, peak during load (quantizing holds
  one weight's transients), peak during the steps; ``torch.cuda``'s allocations on a GPU, the
  resident set on CPU (peak: ``VmHWM``, reset between the phases; it also counts what the C
  allocator keeps cached after a free, so CPU peaks overstate the quantized runs' needs);
- step time: median of the timed steps (first, warm-up step excluded), wall and CPU time.

``--moe`` benchmarks a Qwen3-MoE model instead (16 routed experts per layer, every layer MoE) at
pp 2 x dp 2 x ep 2 (4 ranks), LoRA on attention: it adds the routed experts' bytes per rank, which
stay quantized on their ranks (FP8 codes and tile scales; one NF4 tensor per expert matrix).

Run:  python bench/qbase.py [--hidden 1024] [--layers 8] [--vocab 2048] [--steps 3] [--moe]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path

import torch

from _measure import rss, timed_steps

MODES = ("bf16", "nf4", "fp8")


def _hwm() -> int:
    """Peak resident bytes since the last :func:`_reset_hwm` (Linux ``VmHWM``)."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset the peak RSS to the current RSS
        f.write("5")


def _tensor_bytes(t: torch.Tensor) -> int:
    t = getattr(t, "_local_tensor", t)
    if hasattr(t, "quantized_data"):  # torchao NF4Tensor: codes, int8 scales, their factors and mean
        return sum(getattr(t, a).nbytes for a in ("quantized_data", "quantized_scalers", "quantization_factor",
                                                   "scaler_mean"))
    if 0 in t.stride():  # a zero broadcast standing for NF4 expert stacks: no memory of its own
        return t.untyped_storage().nbytes()
    return t.nbytes


def _stage_bytes(modules) -> tuple[int, int, int, int]:
    """(frozen base bytes, of which in decoder-layer linears, of which routed experts, adapter bytes)."""
    seen, base, linear, experts, adapters = set(), 0, 0, 0, 0
    for m in modules:
        for name, t in list(m.named_parameters()) + list(m.named_buffers()):
            if id(t) in seen:
                continue
            seen.add(id(t))
            if getattr(t, "requires_grad", False):
                adapters += _tensor_bytes(t)
                continue
            base += _tensor_bytes(t)
            if ".experts." in f"{name}" and "shared" not in name:
                experts += _tensor_bytes(t)
            elif ".layers." in f".{name}" and name.endswith(("proj.weight", "proj.base_layer.weight",
                                                               "weight_scale_inv")):
                linear += _tensor_bytes(t)
        for sub in m.modules():  # NF4 routed experts: one NF4Tensor per expert matrix, beside the buffers
            nf4 = sum(_tensor_bytes(q) for stack in getattr(sub, "_hfpipe_nf4", {}).values()
                      for parts in stack for q in parts)
            base, experts = base + nf4, experts + nf4
    return base, linear, experts, adapters


def _worker(path: str, mode: str, steps: int, batch: int, seq: int, moe: bool) -> dict:
    import torch.distributed as dist

    from hfpipe.api import load_pipeline
    from hfpipe.lora.adapters import lora_config
    from hfpipe.parallel.mesh import init_distributed
    from hfpipe.train.optim import build_optimizer

    dp = 2 if moe else 1
    info = init_distributed(2, dp)
    cuda = info.device.type == "cuda"
    baseline = torch.cuda.memory_allocated() if cuda else rss()
    if not cuda:
        _reset_hwm()
    quant = None if mode == "bf16" else mode
    targets = "q_proj,k_proj,v_proj,o_proj" if moe else "all-linear"
    pm = load_pipeline(path, pp=2, dp=dp, ep=dp, schedule="1f1b", microbatches=4 // dp, dist=info, dtype="bf16",
                       lora=lora_config(8, targets=targets), quantize_base=quant)
    base, linear, experts, adapters = _stage_bytes(pm.modules)
    if cuda:
        load_peak, resident = torch.cuda.max_memory_allocated() - baseline, torch.cuda.memory_allocated() - baseline
        torch.cuda.reset_peak_memory_stats()
    else:
        load_peak, resident = _hwm() - baseline, rss() - baseline
        _reset_hwm()
    trainer = pm.trainer(build_optimizer(pm.modules, lr=1e-4), max_grad_norm=1.0)
    ids = torch.randint(3, pm.source.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    ids = ids.chunk(dp)[info.dp_rank]  # this dp rank's rows
    data = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    times, cpu = timed_steps(trainer, data, steps)
    peak = (torch.cuda.max_memory_allocated() if cuda else _hwm()) - baseline
    dist.barrier()
    dist.destroy_process_group()
    return {"rank": info.rank, "base": base, "linear": linear, "experts": experts, "adapters": adapters, "peak": peak,
            "load_peak": load_peak, "resident": resident,
            "step_s": statistics.median(times[1:]), "cpu_s": statistics.median(cpu[1:]),
            "device": info.device.type}


def _model(work: Path, hidden: int, layers: int, vocab: int, moe: bool) -> Path:
    from hfpipe.tiny import make_tiny_checkpoint

    shape = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 64,
                 num_key_value_heads=max(1, hidden // 256), vocab_size=vocab, max_position_embeddings=1024,
                 max_shard_size="500MB", tokenizer=False)
    if moe:  # 16 experts of 3/4 of the hidden width (NF4's 64 and FP8's 128 divide it), top 2: routed
        # experts hold most weights
        return make_tiny_checkpoint(work / "model", "qwen3_moe", num_experts=16, num_experts_per_tok=2,
                                    moe_intermediate_size=hidden * 3 // 4, decoder_sparse_step=1,
                                    mlp_only_layers=[], head_dim=64, **shape)
    return make_tiny_checkpoint(work / "model", "llama", intermediate_size=hidden * 11 // 4, **shape)


def _run(path: Path, mode: str, args) -> list[dict]:
    from hfpipe.parallel.launch import launch

    world = 4 if args.moe else 2
    results = launch(_worker, world, str(path), mode, args.steps, args.batch, args.seq, args.moe,
                     threads_per_rank=args.threads)
    return sorted(results.values(), key=lambda r: r["rank"])


def _mb(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def _report(runs: dict[str, list[dict]]) -> None:
    ref = runs["bf16"]
    ranks = range(len(ref))
    moe = any(x["experts"] for x in ref)
    rows = []
    for r in ranks:
        for what, get in (("base weight bytes", lambda x: x["base"]),
                          ("  of which decoder-layer linears", lambda x: x["linear"]),
                          *((("  of which routed experts", lambda x: x["experts"]),) if moe else ()),
                          ("stage weight bytes (base + adapters)", lambda x: x["base"] + x["adapters"]),
                          ("memory held after load", lambda x: x["resident"]),
                          ("peak memory during load", lambda x: x["load_peak"]),
                          ("peak memory during the steps", lambda x: x["peak"])):
            rows.append((f"{what}, rank {r}", [_mb(get(runs[m][r])) for m in MODES],
                         [get(runs[m][r]) / get(ref[r]) for m in MODES[1:]]))
    for r in ranks:
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
    if moe:
        e = {k: max(runs[k][r]["experts"] / ref[r]["experts"] for r in ranks) for k in ("nf4", "fp8")}
        print(f"routed experts on their ranks vs bf16: NF4 {e['nf4']:.3f}, FP8 {e['fp8']:.3f} (goals as the "
              f"base's: <= 0.30, <= 0.52); device {ref[0]['device']}")
        return
    nf4 = max(runs["nf4"][r]["base"] / ref[r]["base"] for r in ranks)
    fp8 = max(runs["fp8"][r]["base"] / ref[r]["base"] for r in ranks)
    print(f"goal base weight bytes <= 0.30 of bf16 (NF4): {'met' if nf4 <= 0.30 else 'NOT met'} ({nf4:.3f}); "
          f"<= 0.52 (FP8): {'met' if fp8 <= 0.52 else 'NOT met'} ({fp8:.3f}); device {ref[0]['device']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=1536,
                        help="vocabulary: 1536 makes embedding/head ~3%% of a stage, as in Llama-3.1-70B at pp 2")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step (4 microbatches)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up step)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--moe", action="store_true", help="Qwen3-MoE at pp 2 x dp 2 x ep 2, LoRA on attention")
    args = parser.parse_args()
    if args.layers < 8:
        parser.error("--layers must be >= 8 (the issue's bar)")
    work = Path(tempfile.mkdtemp(prefix="hfpipe-bench-qbase-", dir=args.workdir))
    try:
        path = _model(work, args.hidden, args.layers, args.vocab, args.moe)
        what = ("Qwen3-MoE (16 experts, top 2), LoRA r=8 on attention, pp=2 x dp=2 x ep=2" if args.moe
                else "Llama, LoRA r=8 all-linear, pp=2")
        print(f"model: {what}, hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; "
              f"bf16, 1f1b, batch {args.batch} x {args.seq} tokens, 4 microbatches in all")
        _report({mode: _run(path, mode, args) for mode in MODES})
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
