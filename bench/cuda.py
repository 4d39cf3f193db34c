"""Benchmark: hfpipe on one CUDA device against a plain transformers loop, same model and tokens.

For a GPU machine (it runs on CPU too, slowly). Builds a random Llama and trains it for a few steps
twice, side by side in one run:

- **plain**: ``AutoModelForCausalLM`` in one process, AdamW, the loss transformers computes;
- **hfpipe**: ``load_pipeline(pp=1)`` in a launched rank (NCCL on CUDA, chosen by hfpipe), the same
  optimizer settings, ``trainer.step``.

Printed: tokens/s of each and their ratio, peak device memory of each, and the losses of both, which
must agree. ``--dtype fp32`` checks exactness on the device's kernels; ``bf16-mixed`` (fp32 master
weights, bf16 autocast in the plain loop) measures speed.

Run:  python bench/cuda.py [--hidden 2048] [--layers 8] [--seq 2048] [--batch 4] [--steps 5] [--dtype bf16-mixed]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch


def _batches(vocab: int, batch: int, seq: int, steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (batch, seq), generator=g) for _ in range(steps + 1)]


def _device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _plain(path: str, a: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM

    dev = _device()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    walls, losses = [], []
    for i, ids in enumerate(_batches(model.config.vocab_size, a.batch, a.seq, a.steps)):
        ids = ids.to(dev)
        _sync()
        t0 = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=a.dtype == "bf16-mixed"):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        _sync()
        if i:  # the first step warms the kernels
            walls.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    return {"wall": statistics.median(walls), "loss": losses, "peak": peak}


def _hfpipe(path: str, batch: int, seq: int, steps: int, dtype: str) -> dict:
    from hfpipe.api import load_pipeline
    from hfpipe.train.optim import build_optimizer

    pm = load_pipeline(path, pp=1, schedule="1f1b", microbatches=1, dtype=dtype)
    trainer = pm.trainer(build_optimizer(pm.modules, lr=1e-4, weight_decay=0.0), max_grad_norm=1.0)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    walls, losses = [], []
    for i, ids in enumerate(_batches(pm.source.config.vocab_size, batch, seq, steps)):
        _sync()
        t0 = time.perf_counter()
        losses.append(trainer.step({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}).loss)
        _sync()
        if i:
            walls.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    return {"wall": statistics.median(walls), "loss": losses, "peak": peak, "device": str(pm.named_parameters()[0][1].device)}


def _build(folder: Path, a: argparse.Namespace, min_kv_heads: int = 1) -> None:
    """A random Llama of ``a.hidden`` x ``a.layers`` (``min_kv_heads``: at least as many kv heads, for tp)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=32000, hidden_size=a.hidden, intermediate_size=int(2.75 * a.hidden),
                      num_hidden_layers=a.layers, num_attention_heads=a.hidden // 128,
                      num_key_value_heads=max(min_kv_heads, a.hidden // 512), tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder, max_shard_size="1GB")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("hidden", 2048), ("layers", 8), ("seq", 2048), ("batch", 4), ("steps", 5)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--dtype", default="bf16-mixed", choices=("fp32", "bf16-mixed"))
    a = p.parse_args()
    from hfpipe.parallel.launch import launch

    work = Path(tempfile.mkdtemp(prefix="hfpipe-bench-cuda-"))
    try:
        _build(work / "model", a)
        plain = _plain(str(work / "model"), a)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        ours = launch(_hfpipe, 1, str(work / "model"), a.batch, a.seq, a.steps, a.dtype)[0]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    tokens = a.batch * a.seq
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    print(f"{name}, {a.dtype}, hidden {a.hidden} x {a.layers} layers, {tokens} tokens a step; hfpipe ran on "
          f"{ours['device']}")
    print(f"tokens/s  plain {tokens / plain['wall']:.0f}  hfpipe {tokens / ours['wall']:.0f}  "
          f"ratio hfpipe/plain {plain['wall'] / ours['wall']:.3f}")
    print(f"peak device memory  plain {plain['peak'] / 2**30:.2f} GiB  hfpipe {ours['peak'] / 2**30:.2f} GiB")
    diff = max(abs(x - y) for x, y in zip(plain["loss"], ours["loss"]))
    print(f"losses plain {[round(x, 5) for x in plain['loss']]}, largest difference hfpipe {diff:.2e}")


if __name__ == "__main__":
    main()
