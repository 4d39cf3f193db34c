"""Benchmark: tensor parallelism (pp 1 x tp 2) against one rank (pp 1 x tp 1), same tokens; and FSDP2
resharded every microbatch on top of it (pp 1 x dp 2 x tp 2, ``--reshard-per-microbatch``).

Builds a random model (default a Llama of hidden 512, 4 layers, fp32; ``--family qwen3_moe`` or
``deepseek_v3`` for the MoE and MLA layers) and trains it for a few steps in each mode.
Per mode, side by side in one run:

- bytes a rank holds: its parameters' local bytes after loading (goal at tp 2: ratio <= 0.55; norms
  stay whole on every rank, so it is a little above 0.50), and against ``hfpipe plan``'s weight bytes
  (with ``--lora-rank`` the pipeline's parameters are its adapters: against the plan's adapter bytes);
- bytes a rank read from the checkpoint, against its share (the tp 1 read divided by tp): rows of a
  row-split matrix are read alone, a column split is read whole and sliced, so the ratio says what
  column splits cost;
- bytes a rank moved per step in the tp collectives, counted at torch's dispatcher
  (``bench/_comm_bytes.py``: DTensor's redistributions, the vocab-parallel loss's all-reduces, forward
  and backward), against ``hfpipe plan``'s ``tp_bytes`` (:func:`hfpipe.plan.tensor.tp_traffic`); and
  FSDP2's all-gathers and reduce-scatters over dp against its ``fsdp_bytes``
  (:func:`hfpipe.plan.tensor.fsdp_traffic`). Goal 1.00; the small all-reduces of losses, token counts and
  gradient norms are printed apart;
- bytes one decoder layer moves per step over tp, measured: the tp2 run again on the same model with one
  layer more, the difference of the two steps' tp bytes; against Megatron's analytic count for a layer
  (:func:`hfpipe.plan.tensor_comm.megatron_layer_bytes`): per token, forward 2 all-reduces of the hidden
  states (after attention and after the MLP, Megatron's ``g``), backward 2 (one sum of each block's input
  gradient, its ``f``); under sequence parallelism each all-reduce is an all-gather + a reduce-scatter, the
  same bytes. Per rank a ring moves ``2 (tp - 1) / tp`` of each: ``4 * 2 (tp - 1) / tp * h * bytes * tokens``
  per layer per step, with or without SP. Goal <= 1.05 on Llama (the norms' gradients under SP add
  2 h once a step); the added layer is a MoE layer for the MoE families, whose blocks keep their own sums;
- step time: median wall time of the timed steps (the first, which builds the schedule, excluded) and the
  ratio tp2/tp1. On 2 shared CPU cores the tp collectives are local copies through gloo: printed, not judged;
- the losses of every mode, which must agree (the same model and tokens).

Run:  python bench/tp.py [--family llama|qwen3_moe|deepseek_v3] [--hidden 512] [--layers 4] [--seq 64]
        [--batch 4] [--steps 3] [--microbatches 2] [--no-sp]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from _comm_bytes import CommBytes


def _worker(path: str, dp: int, tp: int, a: argparse.Namespace) -> dict:
    import torch.distributed as dist

    from hfpipe.api import load_pipeline
    from hfpipe.parallel.dims import ParallelDims
    from hfpipe.parallel.mesh import init_distributed
    from hfpipe.train.optim import build_optimizer

    from hfpipe.lora.adapters import lora_config

    info = init_distributed(ParallelDims(pp=1, dp=dp, tp=tp))
    lora = lora_config(a.lora_rank, targets=a.lora_targets) if a.lora_rank else None
    pm = load_pipeline(path, pp=1, dp=dp, tp=tp, schedule="gpipe", microbatches=a.microbatches, dist=info,
                       sequence_parallel=a.sp, reshard_per_microbatch=dp > 1, lora=lora)
    held = sum((p.to_local() if hasattr(p, "to_local") else p).nbytes for _, p in pm.named_parameters())
    trainer = pm.trainer(build_optimizer(pm.modules, lr=1e-4), max_grad_norm=1.0)
    ids = torch.randint(3, pm.source.config.vocab_size, (a.batch, a.seq), generator=torch.Generator().manual_seed(0))
    rows = slice(info.dp_rank * a.batch // dp, (info.dp_rank + 1) * a.batch // dp)
    data = {"input_ids": ids[rows], "attention_mask": torch.ones_like(ids[rows]), "labels": ids[rows]}
    counter = CommBytes(_labels(info, dp, tp))
    walls, losses = [], []
    for i in range(a.steps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        if i:  # the first step builds the schedule (and its shape probes): timed and counted apart
            with counter:
                losses.append(trainer.step(data).loss)
            walls.append(time.perf_counter() - t0)
        else:
            losses.append(trainer.step(data).loss)
    moved = {f"{lab} {kind}": b / a.steps for (lab, kind), b in sorted(counter.bytes.items())}
    return {"held": held, "read": pm.load_stats.bytes_read, "wall": statistics.median(walls), "loss": losses,
            "moved": moved, "unpriced": sorted(counter.unpriced)}


def _labels(info, dp: int, tp: int) -> dict[str, str]:
    """Group name -> what it carries: the tp collectives, FSDP2's over dp (the loss sums share its group)."""
    labels = {}
    if tp > 1:
        labels[info.mesh["tp"].get_group().group_name] = "tp"
    if dp > 1:
        labels[info.fsdp_mesh.get_group().group_name] = "dp"
    return labels


def _planned(path: str, dp: int, tp: int, a: argparse.Namespace) -> tuple[int, int, int]:
    """``hfpipe plan``'s (tp_bytes, fsdp_bytes, weight bytes) of the busiest rank for the same run."""
    from hfpipe.plan.report import plan_report
    from hfpipe.source.config import load_config

    config = load_config(Path(path))
    r = plan_report(config, 1, schedule="gpipe", microbatches=a.microbatches, seq_len=a.seq, batch_size=a.batch // dp,
                    dtype="fp32", dp=dp, tp=tp, sequence_parallel=a.sp, reshard_per_microbatch=dp > 1,
                    lora_rank=a.lora_rank, lora_targets=a.lora_targets)
    # a LoRA pipeline's parameters are its adapters (fp32): their bytes are their fp32 gradients' bytes
    held = max((x.grad_bytes if a.lora_rank else x.weight_bytes) for x in r.ranks)
    return max(x.tp_bytes for x in r.ranks), max(x.fsdp_bytes for x in r.ranks), held


def _build(folder: Path, a: argparse.Namespace, layers: int | None = None) -> None:
    from transformers import AutoModelForCausalLM

    from hfpipe.tiny import tiny_config

    sizes = dict(vocab_size=8192, hidden_size=a.hidden, intermediate_size=3 * a.hidden,
                 num_hidden_layers=layers or a.layers,
                 num_attention_heads=8, tie_word_embeddings=False)
    if a.family != "deepseek_v3":  # MLA has one latent key/value, no kv heads
        sizes["num_key_value_heads"] = 4
    if a.family != "llama":  # routed experts a quarter of the hidden size wide (DeepSeek-V3: 2 dense layers first)
        sizes["moe_intermediate_size"] = a.hidden // 4
    cfg = tiny_config(a.family, **sizes)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder, max_shard_size="50MB")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("hidden", 512), ("layers", 4), ("seq", 64), ("batch", 4), ("steps", 3), ("microbatches", 2)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--no-sp", dest="sp", action="store_false", help="tp without sequence parallelism")
    p.add_argument("--family", default="llama", choices=("llama", "qwen3_moe", "deepseek_v3"),
                   help="dense Llama, Qwen3-MoE (routed experts, head norms) or DeepSeek-V3 (MLA, shared experts)")
    p.add_argument("--lora-rank", type=int, default=None, help="train LoRA adapters (tp1 and tp2 only)")
    p.add_argument("--lora-targets", default="all-linear")
    p.add_argument("--only-fsdp", action="store_true", help=argparse.SUPPRESS)  # debugging one mode
    a = p.parse_args()
    from hfpipe.parallel.launch import launch

    work = Path(tempfile.mkdtemp(prefix="hfpipe-bench-tp-"))
    modes = ((1, 1), (1, 2), (2, 2)) if not a.only_fsdp else ((2, 2),)  # (dp, tp)
    if a.lora_rank:  # plan prices --reshard-per-microbatch for full fine-tuning only
        modes = ((1, 1), (1, 2))
    try:
        _build(work / "model", a)
        runs = {m: launch(_worker, m[0] * m[1], str(work / "model"), *m, a, threads_per_rank=1) for m in modes}
        planned = {m: _planned(str(work / "model"), *m, a) for m in modes}
        _build(work / "plus", a, layers=a.layers + 1)  # one layer more: the difference is one layer's bytes
        plus = launch(_worker, 2, str(work / "plus"), 1, 2, a, threads_per_rank=1)[0]
        megatron = _megatron(work / "model", a)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _report(a, {m: max(r.values(), key=lambda x: x["held"]) for m, r in runs.items()}, planned)
    _report_layer(a, runs[1, 2][0], plus, megatron)


def _megatron(folder: Path, a: argparse.Namespace) -> float:
    """Megatron's bytes for one decoder layer of one step at tp 2, per rank (module docstring)."""
    from hfpipe.plan.tensor_comm import megatron_layer_bytes
    from hfpipe.source.config import load_config

    f, b = megatron_layer_bytes(load_config(folder), 4)  # fp32
    return 2 * (2 - 1) / 2 * (f + b) * a.batch * a.seq


def _tp_total(run: dict) -> float:
    return sum(b for k, b in run["moved"].items() if k.startswith("tp "))


def _report_layer(a, run: dict, plus: dict, megatron: float) -> None:
    layer = _tp_total(plus) - _tp_total(run)
    print(f"one decoder layer's tp bytes per step (tp2, {'with' if a.sp else 'without'} SP), measured / Megatron's "
          f"count: {layer / 2**20:.4f} MiB / {megatron / 2**20:.4f} MiB = {layer / megatron:.4f}  (goal <= 1.05 on "
          f"Llama; Megatron: 4 x 2(tp-1)/tp x h x bytes x tokens)")


def _report(a, runs: dict, planned: dict) -> None:
    one, two, fsdp = runs[1, 1], runs[1, 2], runs.get((2, 2))
    lora = f", LoRA rank {a.lora_rank} on {a.lora_targets}" if a.lora_rank else ""
    print(f"{a.family}{lora} hidden {a.hidden}, {a.layers} layers, batch {a.batch} x seq {a.seq} in {a.microbatches} "
          f"microbatches, fp32, sequence parallel {'on' if a.sp else 'off'}")
    print(f"bytes a rank holds, tp2 / tp1:        {two['held'] / one['held']:.3f}  (goal <= 0.55 on Llama; "
          f"norms, routers and MLA's down-projections stay whole)")
    print(f"bytes a rank holds at tp2, measured / planned: {two['held'] / planned[1, 2][2]:.3f}  (goal 1.00)")
    print(f"bytes a rank read / its share (tp2):  {two['read'] / (one['read'] / 2):.3f}  (1.00: rows only)")
    for mode, run in (("pp1 x tp2", two), ("pp1 x dp2 x tp2, resharded per microbatch", fsdp)):
        if run is None:
            continue
        print(f"{mode}: bytes a rank moved per step, measured / planned")
        for label, kind, want in (("tp", "tp", planned[(1, 2) if run is two else (2, 2)][0]),
                                  ("dp", "FSDP2", planned[2, 2][1] if run is fsdp else 0)):
            got = sum(b for k, b in run["moved"].items() if k.startswith(label + " ") and
                      (label == "tp" or "all_reduce" not in k))
            if want or got:
                print(f"  {kind:6s} {got / 2**20:9.3f} MiB / {want / 2**20:9.3f} MiB = "
                      f"{got / max(want, 1):.4f}  (goal 1.00)")
        parts = ", ".join(f"{k} {v / 2**10:.1f} KiB" for k, v in run["moved"].items())
        print(f"  by collective: {parts}")
        if run["unpriced"]:
            print(f"  collectives not priced: {', '.join(run['unpriced'])}")
    print(f"step time, tp2 / tp1:                 {two['wall'] / one['wall']:.2f}  (gloo on shared CPU cores; "
          f"tp1 {one['wall'] * 1e3:.0f} ms, tp2 {two['wall'] * 1e3:.0f} ms"
          + (f", dp2 x tp2 {fsdp['wall'] * 1e3:.0f} ms)" if fsdp else ")"))
    diff = max(abs(x - y) for r in (two, fsdp) if r for x, y in zip(one["loss"], r["loss"]))
    print(f"losses tp1 {[round(x, 6) for x in one['loss']]}, largest difference at tp2 and dp2 x tp2 {diff:.2e}")


if __name__ == "__main__":
    main()
