"""Benchmark: the last stage's loss with and without token chunks (hfpipe.loss.chunked), on CPU.

Builds hfpipe's own last stage (``model.norm`` + ``lm_head``, no decoder layers, so the head is
all there is to measure) of a random Llama with a Llama-3 vocabulary (128256) and runs one
microbatch of 1 x 4096 tokens through it the way the pipeline does: the stage's forward, the
output kept until backward (as torch's ``PipelineStage`` keeps it), :class:`hfpipe.loss.objective.StageLoss`,
backward. Three variants: ``plain`` (the full logits, ``loss_chunk_tokens=0``), ``linear`` (the chunked
loss's fast path for a plain linear head, hfpipe.loss.linear_head: what the pipeline runs) and
``generic`` (the chunked loss through autograd over ``stage.logits``, as a LoRA or soft-capped head
runs). Two figures, each chunked variant against plain:

- peak memory of the head's loss computation: peak RSS during the step minus RSS just before it,
  in a fresh child per variant; the parameters' ``.grad`` already exist (as on every microbatch
  but the first), so every variant counts only what the loss adds. Goal: chunked <= 1/4 of plain.
- step time: forward + backward of the microbatch, all variants in one child, in turn, the
  median of the per-repeat ratios. Goal: chunked >= 0.99 of plain's speed (ratio <= 1.01). CPU
  seconds are shown too.

Run:  python bench/head.py [--hidden 2048] [--vocab 128256] [--seq 4096] [--repeats 5] [--chunk N]
Memory: the plain variant needs about 5 x seq x vocab x 4 bytes (~10 GB at the defaults).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _measure import rss

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _stage(a):
    """The last stage of a one-stage-per-rank Llama, materialised with random weights."""
    import torch
    from transformers import LlamaConfig

    from hfpipe.models.registry import adapter_for
    from hfpipe.models.spec import StageSpec
    from hfpipe.models.stage import build_stage_modules

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=4 * a.hidden,
                         num_hidden_layers=2, num_attention_heads=max(1, a.hidden // 128),
                         tie_word_embeddings=False)
    (stage,) = build_stage_modules(config, [StageSpec(1, (), embed=False, head=True)],
                                   adapter=adapter_for(config))
    stage.to_empty(device="cpu")
    with torch.no_grad():
        stage.lm_head.weight.normal_(0, 0.02)
        stage.model.norm.weight.fill_(1.0)
    for p in stage.parameters():
        p.grad = torch.zeros_like(p)  # as after the first microbatch of a step
    return stage


VARIANTS = ("plain", "linear", "generic")


def _step(stage, loss_fn, hidden, targets, chunk: int, variant: str) -> tuple[float, float]:
    """One microbatch through the last stage as the schedule runs it; wall and CPU seconds."""
    from hfpipe.loss.linear_head import LinearHead
    from hfpipe.loss.objective import Head

    chunk = 0 if variant == "plain" else chunk
    stage.head_in_loss = chunk > 0
    linear = LinearHead(*stage.head_parts()) if variant == "linear" else None
    loss_fn.head = Head(stage.logits, chunk, linear) if chunk else None
    x = hidden.detach().requires_grad_()  # as received from the previous stage
    start, cpu = time.perf_counter(), time.process_time()
    out = stage(x)  # the schedule keeps the output until the backward
    loss = loss_fn(out, targets)
    loss.backward()
    seconds = (time.perf_counter() - start, time.process_time() - cpu)
    del out, loss
    return seconds


def _child(a) -> dict:
    import torch

    from hfpipe.loss.budget import chunk_tokens
    from hfpipe.loss.objective import StageLoss, TokenMean
    from hfpipe.loss.tokens import shift_labels

    torch.set_num_threads(a.threads)
    stage = _stage(a)
    hidden = torch.randn(1, a.seq, a.hidden)
    targets = shift_labels(torch.randint(0, a.vocab, (1, a.seq)))
    loss_fn = StageLoss(TokenMean())
    loss_fn.denominator = float(a.seq)
    chunk = chunk_tokens(a.vocab, a.chunk)
    if a.mode in VARIANTS:
        before = rss()
        _step(stage, loss_fn, hidden, targets, chunk, a.mode)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
        return {"peak": peak, "chunk": chunk}
    times = {name: [] for name in VARIANTS}
    for r in range(a.warmup + a.repeats):
        for name in VARIANTS[r % 3:] + VARIANTS[:r % 3]:  # each variant first in turn
            t = _step(stage, loss_fn, hidden, targets, chunk, name)
            if r >= a.warmup:
                times[name].append(t)
    return times


def _run_child(a, mode: str) -> dict:
    args = [sys.executable, __file__, "--child", mode] + [f"--{k}={v}" for k, v in
                                                           vars(a).items() if k not in ("child", "mode") and v is not None]
    out = subprocess.run(args, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=None, help="tokens per chunk (default: hfpipe's budget)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--child", dest="mode", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.mode:
        print(json.dumps(_child(a)))
        return
    gb = 1e9
    print(f"last stage: norm + lm_head, hidden {a.hidden}, vocab {a.vocab}, microbatch 1 x {a.seq}, "
          f"fp32, {a.threads} threads")
    peaks = {name: _run_child(a, name) for name in VARIANTS}
    times = _run_child(a, "time")
    print(f"chunk: {peaks['linear']['chunk']} tokens")
    print(f"{'':18}{'peak memory':>12}{'ratio':>7}{'step (median)':>15}{'ratio':>7}{'CPU ratio':>11}"
          "   goal: memory <= 0.25, step ratio <= 1.01")
    for name in VARIANTS:
        mem = peaks[name]["peak"] / peaks["plain"]["peak"]
        wall = sorted(c[0] / p[0] for c, p in zip(times[name], times["plain"]))
        cpu = sorted(c[1] / p[1] for c, p in zip(times[name], times["plain"]))
        seconds = statistics.median(t[0] for t in times[name])
        print(f"{name:18}{peaks[name]['peak'] / gb:11.2f}G{mem:7.3f}{seconds:14.3f}s{statistics.median(wall):7.3f}"
              f"{statistics.median(cpu):11.3f}   (per-repeat {min(wall):.3f}..{max(wall):.3f})")
    print("CPU ratio: CPU seconds, less disturbed by other jobs than wall time")

if __name__ == "__main__":
    main()
