"""Benchmark (CPU proxy, no timing): bytes written by copy and cast kernels per bf16-mixed training step.

bf16-mixed at one replica needs one cast of each fp32 master to bf16 a step and one upcast of each
microbatch's bf16 gradient to fp32; FSDP2's one-rank path adds copies beside them (the cast into an
all-gather input copied again into the unsharded parameter; the gradients concatenated into one fp32 buffer
copied again into the sharded gradient). Counted here by a dispatch mode, per optimizer step after the first,
over the bytes written by ``aten::copy_``, ``_to_copy``, ``(_)chunk_cat``, ``split_with_sizes_copy`` and
``_foreach_copy_``, side by side in one run, on the same model and tokens:

================  ======================================================================================
 case              what runs
================  ======================================================================================
 ``fsdp2``          ``load_pipeline(pp=1, dtype="bf16-mixed")`` through FSDP2's one-rank path (before)
 ``hfpipe``         the same through :mod:`hfpipe.parallel.one_replica` (now)
 ``plain``          ``AutoModelForCausalLM`` in fp32 under ``torch.autocast(bf16)``, the same microbatches
                    accumulated, AdamW (autocast casts each weight at each use, in forward and in the recompute)
================  ======================================================================================

Run:  python bench/mixed_copies.py [--layers 4] [--seq 256] [--batch 8] [--microbatches 4] [--steps 2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_memory import make_model  # noqa: E402

COPIES = ("copy_", "_to_copy", "chunk_cat", "_chunk_cat", "split_with_sizes_copy", "_foreach_copy_")


class CopyBytes(TorchDispatchMode):
    """Output bytes of the copy and cast kernels dispatched while active, by op (a DTensor's local part)."""

    def __init__(self):
        super().__init__()
        self.bytes = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in COPIES:  # what the op wrote: its ``out=`` tensors (FSDP2's ``chunk_cat`` returns nothing), or its result
            for t in tree_flatten(kwargs.get("out", out))[0]:
                if isinstance(t, torch.Tensor):
                    t = getattr(t, "_local_tensor", t)
                    self.bytes[name] += t.numel() * t.element_size()
        return out


def _batches(vocab: int, args) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(args.steps + 1):
        ids = torch.randint(3, vocab, (args.batch, args.seq), generator=g)
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    return out


def _counted(step, batches) -> Counter:
    """Per step, the copy bytes of every step after the first (which builds schedules and optimizer state)."""
    step(batches[0])
    mode = CopyBytes()
    with mode:
        for b in batches[1:]:
            step(b)
    return Counter({k: v // (len(batches) - 1) for k, v in mode.bytes.items()})


def hfpipe_case(path: str, fsdp2: bool, args) -> Counter:
    import hfpipe.parallel.fsdp as fsdp
    from hfpipe.api import load_pipeline

    fsdp._FSDP2_AT_ONE_REPLICA = fsdp2
    pm = load_pipeline(path, pp=1, microbatches=args.microbatches, dtype="bf16-mixed",
                       activation_checkpointing=args.ac)
    fsdp._FSDP2_AT_ONE_REPLICA = False
    trainer = pm.trainer(torch.optim.AdamW(pm.parameters(), lr=1e-4, foreach=True))
    return _counted(trainer.step, _batches(pm.source.config.vocab_size, args))


def plain_case(path: str, args) -> tuple[Counter, int]:
    """The copy bytes of transformers under autocast, and the model's parameter count."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if args.ac == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

    def step(batch):
        for part in zip(*(batch[k].chunk(args.microbatches) for k in ("input_ids", "labels"))):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=part[0], labels=part[1]).loss
            (loss / args.microbatches).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _counted(step, _batches(model.config.vocab_size, args)), sum(p.numel() for p in model.parameters())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--ac", default="none", choices=("none", "full"))
    args = p.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(make_model(Path(tmp) / "llama", "llama3-small", args.layers))
        cases = {"fsdp2": hfpipe_case(path, True, args), "hfpipe": hfpipe_case(path, False, args)}
        cases["plain"], n = plain_case(path, args)
    print(f"copy/cast bytes written per optimizer step (llama3-small x {args.layers} layers, {args.batch} x "
          f"{args.seq} tokens, {args.microbatches} microbatches, ac {args.ac}):")
    print(f"{'op':<24}" + "".join(f"{name:>14}" for name in cases))
    for op in COPIES:
        print(f"{op:<24}" + "".join(f"{c[op] / 1e6:>12.2f}MB" for c in cases.values()))
    totals = {name: sum(c.values()) for name, c in cases.items()}
    print(f"{'total':<24}" + "".join(f"{t / 1e6:>12.2f}MB" for t in totals.values()))
    print(f"(the weights: {n / 1e6:.2f}M parameters; one bf16 cast of them writes {2 * n / 1e6:.2f}MB, one fp32 "
          f"upcast of their gradients {4 * n / 1e6:.2f}MB)")
    print(f"{'ratio to hfpipe':<24}" + "".join(f"{t / totals['hfpipe']:>13.2f}x" for t in totals.values()))


if __name__ == "__main__":
    main()
