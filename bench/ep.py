"""Benchmark: expert parallelism (pp 2 x dp 2 x ep 2) against replicated experts (pp 2 x dp 2), same tokens.

Builds a random Mixtral-shaped MoE (default 8 experts, top-2, fp32) and trains it for a few steps in
4 fresh processes per mode, each dp rank on its own rows of the same global batches. Per mode:

- expert bytes per rank: the bytes of the experts' parameters a rank holds *while they compute*
  (read from the tensors inside each experts module's forward: FSDP has gathered them by then). With
  replicated experts FSDP gathers every expert; with ep a rank holds its E/ep experts. Goal at ep 2:
  ratio <= 0.55.
- all-to-all bytes: every byte transformers' expert dispatch and combine hand to ``all_to_all_single``,
  forward and backward, counted by a wrapper around the exchange, against the analytic count
  ``4 x moe layers x tokens x top_k x hidden x 4 bytes`` (dispatch and combine, each forward and
  backward; every (token, expert) row is sent once per exchange, its own rank's rows included). Goal:
  within 5%.
- step time: median wall and CPU time of the timed steps (warm-up excluded), and the ratio ep/replicated.
  On 2 shared CPU cores the all-to-all is a local copy through gloo, so the ratio says little about a
  GPU cluster: it is printed, not judged.
- the losses of both modes, which must agree (the same model and tokens).

Run:  python bench/ep.py [--hidden 256] [--experts 8] [--layers 4] [--seq 64] [--batch 8] [--steps 3]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SENT = {"bytes": 0}


class _CountedAllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits, counting the bytes handed to it in both directions."""

    @staticmethod
    def forward(ctx, x, out_sizes, in_sizes, group):
        import torch.distributed as dist

        ctx.sizes, ctx.group = (out_sizes, in_sizes), group
        SENT["bytes"] += x.numel() * x.element_size()
        out = x.new_empty((sum(out_sizes), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_sizes, in_sizes, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        out_sizes, in_sizes = ctx.sizes
        SENT["bytes"] += grad.numel() * grad.element_size()
        back = grad.new_empty((sum(in_sizes), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_sizes, out_sizes, group=ctx.group)
        return back, None, None, None


def _count_exchanges() -> None:
    """Route transformers' EP exchanges through the counting all-to-all (same data, same collectives)."""
    from transformers.distributed import expert_parallel

    expert_parallel.all_to_all_single_autograd = lambda x, out, inp, group: _CountedAllToAll.apply(x, out, inp, group)
    expert_parallel._WaitTensor.apply = staticmethod(lambda t: t)  # nothing pending: the exchange is synchronous


def _expert_bytes(pm) -> dict:
    """Forward hooks recording the bytes of each experts module's parameters while it runs."""
    seen: dict[str, int] = {}

    def hook(name):
        def record(module, args, output):
            local = [p.to_local() if hasattr(p, "to_local") else p for p in module.parameters(recurse=False)]
            seen[name] = max(seen.get(name, 0), sum(t.numel() * t.element_size() for t in local))
        return record

    for m in pm.modules:
        for name, module in m.named_modules():
            if name.endswith("mlp.experts"):
                module.register_forward_hook(hook(name))
    return seen


def _worker(path: str, ep: int, steps: int, batch: int, seq: int) -> dict:
    import torch.distributed as dist

    from hfpipe.api import load_pipeline
    from hfpipe.parallel.mesh import init_distributed
    from hfpipe.train.optim import build_optimizer

    _count_exchanges()
    info = init_distributed(2, 2)
    pm = load_pipeline(path, pp=2, dp=2, ep=ep, schedule="1f1b", microbatches=2, dist=info)
    held = _expert_bytes(pm)
    trainer = pm.trainer(build_optimizer(pm.modules, lr=1e-4), max_grad_norm=1.0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, pm.source.config.vocab_size, (2 * batch, seq), generator=g)
    mine = ids[info.dp_rank * batch:(info.dp_rank + 1) * batch]
    data = {"input_ids": mine, "attention_mask": torch.ones_like(mine), "labels": mine}
    walls, cpus, losses = [], [], []
    for i in range(steps + 1):
        SENT["bytes"] = 0
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        losses.append(trainer.step(data).loss)
        if i:  # the first step builds the schedule
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
    return {"sent": SENT["bytes"], "held": sum(held.values()), "moe_layers": len(held), "wall": statistics.median(walls),
            "cpu": statistics.median(cpus), "loss": losses}


def _build(folder: Path, a: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM, MixtralConfig

    cfg = MixtralConfig(vocab_size=4096, hidden_size=a.hidden, intermediate_size=2 * a.hidden, num_hidden_layers=a.layers,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=a.experts,
                        num_experts_per_tok=2, sliding_window=None, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder, max_shard_size="50MB")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("hidden", 256), ("experts", 8), ("layers", 4), ("seq", 64), ("batch", 8), ("steps", 3)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--keep", action="store_true", help="keep the work folder")
    a = p.parse_args()
    from hfpipe.parallel.launch import launch

    work = Path(tempfile.mkdtemp(prefix="hfpipe-bench-ep-"))
    try:
        _build(work / "model", a)
        runs = {ep: launch(_worker, 4, str(work / "model"), ep, a.steps, a.batch, a.seq, threads_per_rank=1)
                for ep in (1, 2)}
        _report(runs, a)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)


def _report(runs: dict, a: argparse.Namespace) -> None:
    rep, ep = runs[1], runs[2]
    held = [max(r["held"] for r in run.values()) for run in (rep, ep)]
    sent = sum(r["sent"] for r in ep.values())
    moe_layers = sum(r["moe_layers"] for r in ep.values()) // 2  # each layer is on 2 ranks (dp 2)
    analytic = 4 * moe_layers * (2 * a.batch * a.seq) * 2 * a.hidden * 4
    wall = [statistics.median(r["wall"] for r in run.values()) for run in (rep, ep)]
    cpu = [statistics.median(r["cpu"] for r in run.values()) for run in (rep, ep)]
    loss = [run[0]["loss"] for run in (rep, ep)]
    print(f"Mixtral-shaped MoE: hidden {a.hidden}, {a.experts} experts top-2, {a.layers} layers; pp 2 x dp 2, "
          f"{2 * a.batch} x {a.seq} tokens per step")
    print(f"expert bytes per rank: replicated {held[0] / 1e6:.2f} MB, ep 2 {held[1] / 1e6:.2f} MB, "
          f"ratio {held[1] / held[0]:.3f} (goal <= 0.55)")
    print(f"all-to-all bytes per step: measured {sent / 1e6:.3f} MB, analytic {analytic / 1e6:.3f} MB, "
          f"ratio {sent / analytic:.4f} (goal within 5%)")
    print(f"step time ep/replicated: wall {wall[1]:.3f}/{wall[0]:.3f} s = {wall[1] / wall[0]:.2f}, "
          f"cpu {cpu[1]:.3f}/{cpu[0]:.3f} s = {cpu[1] / cpu[0]:.2f}")
    print(f"losses replicated {[round(x, 6) for x in loss[0]]}, ep {[round(x, 6) for x in loss[1]]}")


if __name__ == "__main__":
    main()
