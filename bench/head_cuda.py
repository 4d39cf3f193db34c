"""Benchmark on one CUDA GPU: the last stage's head loss, full logits against the chunked paths.

The head as FSDP2's bf16-mixed runs it (bf16 norm, head weight and hidden states; fp32 loss), at
Llama-3-8B's shape by default (hidden 4096, vocab 128256), one microbatch of 4 x 2048 tokens:

- ``plain``: the full logits (``loss_chunk_tokens=0``): ``cross_entropy(lm_head(norm(h)).float())``;
- ``generic@N``: the chunked loss through autograd over the head (hfpipe.loss.chunked; a LoRA head's path);
- ``fused@N``: the chunked loss's fast path (hfpipe.loss.linear_head), N tokens per chunk, as it runs on a GPU:
  each chunk's softmax gradient fused by torch.compile;
- ``eager@N``: the same path with ``HFPIPE_HEAD_COMPILE=0`` (its in-place eager form).

Each variant: forward + backward of the microbatch with the head's ``.grad`` already there (as on every
microbatch but the first), CUDA-event time (median of the repeats, variants in turn), and the peak memory
the loss adds (``max_memory_allocated`` over what was allocated before). Ratios are against ``plain``.

Run:  python bench/head_cuda.py [--hidden 4096] [--vocab 128256] [--rows 4] [--seq 2048] [--repeats 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hfpipe.loss.chunked import chunked_loss_sum  # noqa: E402
from hfpipe.loss.linear_head import LinearHead  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--chunks", default="523,1046,2093")
    p.add_argument("--smoke", action="store_true", help="run the script's steps on the CPU (no timing)")
    a = p.parse_args()
    if a.smoke:
        return _smoke(a)
    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    norm = torch.nn.RMSNorm(a.hidden, eps=1e-5, device=dev, dtype=dt)
    head = torch.nn.Linear(a.hidden, a.vocab, bias=False, device=dev, dtype=dt)
    torch.nn.init.normal_(head.weight, std=0.02)
    for q in (*norm.parameters(), head.weight):
        q.grad = torch.zeros_like(q)
    hidden = torch.randn(a.rows, a.seq, a.hidden, device=dev, dtype=dt)
    targets = torch.randint(0, a.vocab, (a.rows, a.seq), device=dev)
    targets[:, -1] = -100
    n = float((targets != -100).sum())
    logits_fn = lambda h: head(norm(h))  # noqa: E731
    linear = LinearHead(norm, head, None)

    def run(name: str) -> None:
        kind, _, chunk = name.partition("@")
        os.environ["HFPIPE_HEAD_COMPILE"] = "0" if kind == "eager" else "1"
        h = hidden.detach().requires_grad_()
        if kind == "plain":
            loss = F.cross_entropy(logits_fn(h).float().flatten(0, 1), targets.flatten(), reduction="sum") / n
        else:
            loss = chunked_loss_sum(logits_fn, h, targets, int(chunk), n, linear=None if kind == "generic" else linear)
        loss.backward()

    chunks = [int(c) for c in a.chunks.split(",")]
    names = ["plain", "generic@523"] + [f"{kind}@{c}" for kind in ("eager", "fused") for c in chunks]
    peaks, times = {}, {name: [] for name in names}
    for name in names:  # warm-up (and compile), then the peak of one run
        run(name)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run(name)
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - base
    for r in range(a.repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run(name)
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; head: hidden {a.hidden}, vocab {a.vocab}, "
          f"microbatch {a.rows} x {a.seq}, bf16 (fp32 loss)")
    base_ms, base_mem = statistics.median(times["plain"]), peaks["plain"]
    print(f"{'':16}{'ms (median)':>12}{'time ratio':>11}{'peak GB':>9}{'mem ratio':>10}")
    for name in names:
        ms = statistics.median(times[name])
        print(f"{name:16}{ms:12.2f}{ms / base_ms:11.3f}{peaks[name] / 1e9:9.2f}{peaks[name] / base_mem:10.3f}")


def _smoke(a) -> None:
    """Each variant once on the CPU in bf16, its loss against plain's (checks the script, times nothing)."""
    torch.manual_seed(0)
    norm, head = torch.nn.RMSNorm(a.hidden, dtype=torch.bfloat16), torch.nn.Linear(a.hidden, a.vocab, bias=False,
                                                                                 dtype=torch.bfloat16)
    hidden = torch.randn(a.rows, a.seq, a.hidden, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, a.vocab, (a.rows, a.seq))
    logits_fn = lambda h: head(norm(h))  # noqa: E731
    plain = F.cross_entropy(logits_fn(hidden).float().flatten(0, 1), targets.flatten(), reduction="sum")
    for c in [int(c) for c in a.chunks.split(",")]:
        got = chunked_loss_sum(logits_fn, hidden, targets, c, 1.0, linear=LinearHead(norm, head, None))
        got.backward()
        print(c, float(plain), float(got), float(hidden.grad.float().abs().sum()))


if __name__ == "__main__":
    main()
