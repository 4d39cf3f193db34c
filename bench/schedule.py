"""Benchmark: how close hfpipe's schedules come to their compute, and to transformers, on CPU/gloo.

Builds (once; cached in ``--workdir``) a random Llama (default hidden 512, 8 layers, vocab 384, so
that the decoder layers dominate and both stages are even) and measures, side by side in the same
processes, each figure the median of ``--repeats`` runs after ``--warmup``:

1. pp=2, 1F1B, one thread per rank: the schedule step (``Pipeline.train_step``) / the analytic
   bound ``(m+p-1)/m * C``, where ``C`` is the slowest stage's forward+backward of its own module
   alone over the same ``m`` microbatches (no communication), timed on both ranks at once in the
   same processes. Goal <= 1.10. ``StepEngine.step`` (clipping + AdamW included) is shown too.
2. pp=1, two threads: ``StepEngine.step`` / a plain transformers step (``loss.backward()``,
   ``clip_grad_norm_``, AdamW, ``zero_grad``) on the same model, batch and optimizer. Goal <= 1.05.
3. pp=2, one thread per rank: hfpipe's microbatched forward (``PipelineModel.forward``) throughput /
   transformers' own pipeline parallelism (``from_pretrained(..., distributed_config=
   DistributedConfig(pp_size=2))``), which runs the whole batch through rank 0, then rank 1, and
   broadcasts the logits to every rank. Goal >= 1.7.
4. pp=2, one thread per rank: two 1F1B steps whose sequence lengths change every step (seq -/+ a
   quarter) / two steps at the fixed length (the same token count). Goal <= 1.05.

Ratios are the medians of per-repeat ratios (both sides timed in the same repeat, in rotating
order), so load from other jobs shifts both sides alike; the spread column shows what is left. A
distributed time runs from a barrier to the slowest rank's end. Diagnostic rows split the ratios:
stage compute timed one rank at a time as well as both at once (on a shared machine two ranks may
not run twice as fast as one, and then no pipeline can), and CPU seconds (work done, not waiting).

Run:  python bench/schedule.py [--hidden 512] [--layers 8] [--seq 256] [--microbatch 2]
                               [--microbatches 8] [--repeats 5] [--warmup 1] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the spawned ranks import this file too

GOALS = {"1f1b": ("<=", 1.10), "pp1": ("<=", 1.05), "forward": (">=", 1.7), "shapes": ("<=", 1.05)}


# ---------------------------------------------------------------- setup


def _ensure_checkpoint(folder: Path, dims: dict) -> None:
    from hfpipe.tiny import make_tiny_checkpoint

    stamp = folder / "bench.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == dims:
        print(f"using the cached checkpoint in {folder}")
        return
    print(f"building a random Llama in {folder} ...", flush=True)
    make_tiny_checkpoint(folder, "llama", max_shard_size="100MB", tokenizer=False, **dims)
    stamp.write_text(json.dumps(dims))


def _batch(a: dict) -> dict:
    import torch

    from hfpipe.tiny import VOCAB

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (a["microbatch"] * a["microbatches"], a["seq"]), generator=g)  # (B, T)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _quiet() -> None:
    import logging

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("hfpipe").setLevel(logging.WARNING)


def _timed(fn) -> tuple[float, float]:
    """Wall and CPU seconds (this process, all threads) of ``fn()``.

    CPU seconds count the work done, not the waiting: they separate work a schedule adds from
    time lost to bubbles, and are far less disturbed by other jobs on the machine than wall time.
    """
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w0, time.process_time() - c0


def _sync_time(fn) -> dict:
    """``fn()`` on every rank between two barriers: the slowest rank's wall s, all ranks' CPU s."""
    import torch.distributed as dist

    dist.barrier()
    times = [None] * dist.get_world_size()
    dist.all_gather_object(times, _timed(fn))  # also the closing barrier
    return {"wall": max(w for w, _ in times), "cpu": sum(c for _, c in times)}


def _per_rank(fn, one_at_a_time: bool = False) -> dict:
    """Every rank's wall and CPU seconds for its own ``fn()`` (no communication inside), as lists.

    ``one_at_a_time``: rank 0 runs while the others wait at a barrier, then rank 1, ...; else all
    ranks run at once, as they do inside a pipeline's steady state.
    """
    import torch.distributed as dist

    me, world, t = dist.get_rank(), dist.get_world_size(), (0.0, 0.0)
    for turn in range(world) if one_at_a_time else [me]:
        dist.barrier()
        if turn == me:
            t = _timed(fn)
    times = [None] * world
    dist.all_gather_object(times, t)
    return {"wall": [w for w, _ in times], "cpu": [c for _, c in times]}


def _repeat(a: dict, fns: dict) -> dict[str, list]:
    """Time every entry of ``fns`` once per repeat, in rotating order; warmup runs dropped."""
    out = {k: [] for k in fns}
    names = list(fns)
    for i in range(a["warmup"] + a["repeats"]):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            t = fns[name]()
            if i >= a["warmup"]:
                out[name].append(t)
    return out


def _microbatches(module, batch: dict, a: dict) -> tuple[list[dict], list]:
    """The step's microbatches and this stage's inputs for them.

    A non-first stage gets fixed random hidden states (made here, outside any timed call) that
    require grad, as the schedule's received activations do.
    """
    import torch

    mb, hidden = a["microbatch"], module.config.hidden_size
    chunks = [{k: v[i * mb:(i + 1) * mb] for k, v in batch.items()} for i in range(a["microbatches"])]
    xs = [c["input_ids"] if module.is_first else torch.randn(mb, a["seq"], hidden, requires_grad=True)
          for c in chunks]  # (mb, T) ids or (mb, T, H) hidden states
    return chunks, xs


# ---------------------------------------------------------------- 1. 1F1B vs its analytic bound


def _stage_train(module, batch: dict, a: dict, denominator: float):
    """A function running this stage's module alone: forward+backward of each microbatch."""
    import torch

    from hfpipe.loss.tokens import shift_labels, token_loss_sum

    chunks, xs = _microbatches(module, batch, a)
    grads = None if module.is_last else [torch.randn(a["microbatch"], a["seq"], module.config.hidden_size)
                                         for _ in chunks]  # what the next stage would send back

    def run():
        for i, c in enumerate(chunks):
            out = module(xs[i], attention_mask=c["attention_mask"])
            if module.is_last:
                (token_loss_sum(out, shift_labels(c["labels"])) / denominator).backward()
            else:
                out.backward(grads[i])
            xs[i].grad = None
        module.zero_grad(set_to_none=True)

    return run


def _train_fns(pm, batch: dict, a: dict) -> dict:
    import torch

    from hfpipe.loss.tokens import count_tokens

    denominator = count_tokens(batch["labels"])
    trainer = pm.trainer(torch.optim.AdamW(pm.parameters(), lr=1e-5), max_grad_norm=1.0)
    compute = _stage_train(pm.modules[0], batch, a, denominator)

    def schedule_step():
        pm.pipe.train_step(batch, denominator)
        for m in pm.modules:
            m.zero_grad(set_to_none=True)

    return {"schedule": lambda: _sync_time(schedule_step), "compute": lambda: _per_rank(compute),
            "compute_alone": lambda: _per_rank(compute, one_at_a_time=True),
            "trainer": lambda: _sync_time(lambda: trainer.step(batch))}


def _shape_fns(pm, a: dict) -> dict:
    """Two 1F1B steps at seq -/+ seq/4 (a new shape every step) vs two at seq: the same tokens."""
    import torch

    from hfpipe.loss.tokens import count_tokens

    short, long = a["seq"] - a["seq"] // 4, a["seq"] + a["seq"] // 4
    batches = {n: _batch({**a, "seq": n}) for n in (short, a["seq"], long)}

    def steps(lengths):
        def run():
            for n in lengths:
                pm.pipe.train_step(batches[n], count_tokens(batches[n]["labels"]))
            for m in pm.modules:
                m.zero_grad(set_to_none=True)
        return lambda: _sync_time(run)

    torch.manual_seed(0)
    return {"varying": steps((short, long)), "fixed": steps((a["seq"], a["seq"]))}


# ---------------------------------------------------------------- 3. forward vs transformers' PP


def _hf_pp_model(folder: str):
    """transformers' own pp=2 model on this rank, or the error text on every rank if it fails."""
    import torch.distributed as dist

    model, error = None, None
    try:
        from transformers import AutoModelForCausalLM, DistributedConfig

        model = AutoModelForCausalLM.from_pretrained(folder, distributed_config=DistributedConfig(pp_size=2))
        model.eval()
    except Exception as e:  # reported, not hidden: the ratio is then printed as unavailable
        error = f"{type(e).__name__}: {e}"
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    errors = [e for e in errors if e]
    return (None, errors[0]) if errors else (model, None)


def _stage_forward(module, batch: dict, a: dict):
    """A function running this stage's module alone: forward of each microbatch, no grad."""
    import torch

    chunks, xs = _microbatches(module, batch, a)

    @torch.no_grad()
    def run():
        for x, c in zip(xs, chunks):
            module(x, attention_mask=c["attention_mask"])

    return run


def _forward_fns(pm, folder: str, batch: dict, a: dict) -> tuple[dict, str | None, list[str]]:
    import torch

    model, error = _hf_pp_model(folder)
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    compute = _stage_forward(pm.modules[0], batch, a)
    fns = {"hfpipe": lambda: _sync_time(lambda: pm.forward(inputs)), "compute": lambda: _per_rank(compute),
           "compute_alone": lambda: _per_rank(compute, one_at_a_time=True)}
    kinds = []
    if model is not None:
        @torch.no_grad()
        def hf_forward():
            model(**inputs)

        fns["transformers"] = lambda: _sync_time(hf_forward)
        kinds = [type(layer).__name__ for layer in model.model.layers]
    return fns, error, kinds


# ---------------------------------------------------------------- rank entry points


def _pp2_rank(folder: str, a: dict) -> dict:
    """One of two ranks: items 1 and 3."""
    import torch

    from hfpipe.api import load_pipeline

    _quiet()
    pm = load_pipeline(folder, pp=2, schedule="1f1b", microbatches=a["microbatches"])
    batch = _batch(a)
    train = _repeat(a, _train_fns(pm, batch, a))
    fns, error, hf_layers = _forward_fns(pm, folder, batch, a)
    forward = _repeat(a, fns)
    builds = pm.pipe.builds
    shapes = _repeat(a, _shape_fns(pm, a))
    shapes["rebuilds"] = pm.pipe.builds - builds
    return {"train": train, "forward": forward, "shapes": shapes, "hf_error": error, "threads": torch.get_num_threads(),
            "stages": [(s.layers[0], s.layers[-1], s.embed, s.head) for s in pm.plan.stages],
            "hf_layers": hf_layers}


def _pp1_rank(folder: str, a: dict) -> dict:
    """The single rank of item 2: hfpipe's pp=1 step and the plain transformers step, alternating."""
    import torch
    from transformers import AutoModelForCausalLM

    from hfpipe.api import load_pipeline

    _quiet()
    batch = _batch(a)
    pm = load_pipeline(folder, pp=1, schedule="1f1b", microbatches=1)
    trainer = pm.trainer(torch.optim.AdamW(pm.parameters(), lr=1e-5), max_grad_norm=1.0)
    model = AutoModelForCausalLM.from_pretrained(folder)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def hf_step():
        model(**batch).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    fns = {"hfpipe": lambda: _sync_time(lambda: trainer.step(batch)), "transformers": lambda: _sync_time(hf_step)}
    return {"times": _repeat(a, fns), "threads": torch.get_num_threads()}


# ---------------------------------------------------------------- report


def _verdict(key: str, ratio: float | None) -> str:
    op, goal = GOALS[key]
    if ratio is None:
        return "unavailable"
    return "met" if (ratio <= goal if op == "<=" else ratio >= goal) else "NOT met"


def _med(xs) -> float:
    return statistics.median(list(xs))


def _row(label: str, ours: list | None, ref: list | None, key: str | None = None, times: bool = True) -> str:
    """One table line: median times, the median of per-repeat ratios ours/ref (ref/ours for >= goals), spread."""
    def num(x, w):
        return f"{x:{w}.3f}" if x is not None else f"{'n/a':>{w}}"

    higher = key is not None and GOALS[key][0] == ">="
    ratios = [(r / o if higher else o / r) for o, r in zip(ours, ref)] if ours and ref else []
    ratio = _med(ratios) if ratios else None
    spread = f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else "-"
    goal = f"{GOALS[key][0]} {GOALS[key][1]:<5} {_verdict(key, ratio)}" if key else "(diagnostic)"
    ours_s, ref_s = (_med(ours) if ours else None, _med(ref) if ref else None) if times else (None, None)
    return (f"{label:<56} {num(ours_s, 8)} {num(ref_s, 8)} "
            f"{num(ratio, 6)} {spread:>10}   {goal}")


def _col(runs: list[dict], key: str = "wall") -> list:
    return [r[key] for r in runs]


def _bounds(section: dict, a: dict) -> dict:
    """Per repeat: the 1F1B bound from the slowest stage timed with both ranks busy, and one at a time.

    ``speedup`` is how much sooner two ranks finish their stages at once than one after the other:
    2.0 on two free cores; less where the machine cannot run two ranks at full speed.
    """
    factor = (a["microbatches"] + 2 - 1) / a["microbatches"]
    busy, alone = _col(section["compute"]), _col(section["compute_alone"])
    return {"busy": [factor * max(r) for r in busy], "alone": [factor * max(r) for r in alone],
            "sum_alone": [sum(r) for r in alone], "speedup": [sum(x) / max(y) for x, y in zip(alone, busy)],
            "cpu": [sum(r) for r in _col(section["compute"], "cpu")]}


def _report_1f1b(a: dict, train: dict) -> None:
    m, b = a["microbatches"], _bounds(train, a)
    sched = _col(train["schedule"])
    print(_row(f"1. pp=2 1F1B step / ({m}+2-1)/{m} x slowest stage", sched, b["busy"], "1f1b"))
    print(_row("   same, stages timed one rank at a time", sched, b["alone"]))
    print(_row("   trainer.step (+ clip, AdamW) / the bound", _col(train["trainer"]), b["busy"]))
    print(_row("   CPU s, both ranks: 1F1B step / stage compute", _col(train["schedule"], "cpu"), b["cpu"]))


def _report_pp1(pp1: dict) -> None:
    ours, ref = pp1["times"]["hfpipe"], pp1["times"]["transformers"]
    print(_row("2. pp=1 hfpipe step / transformers step", _col(ours), _col(ref), "pp1"))
    print(_row("   CPU s: hfpipe step / transformers step", _col(ours, "cpu"), _col(ref, "cpu")))


def _report_forward(a: dict, fw: dict) -> None:
    b, ours, hf = _bounds(fw, a), fw["hfpipe"], fw.get("transformers")
    print(_row("3. forward throughput: hfpipe / transformers PP", _col(ours), hf and _col(hf), "forward"))
    print(_row("   hfpipe forward / (m+p-1)/m x slowest stage fwd", _col(ours), b["busy"]))
    if hf:
        print(_row("   transformers PP / sum of stage fwds, one at a time", _col(hf), b["sum_alone"]))
        print(_row("   CPU s, both ranks: hfpipe forward / transformers PP", _col(ours, "cpu"), _col(hf, "cpu")))
    ceiling = [x / y for x, y in zip(b["sum_alone"], b["busy"])]
    print(_row("   ratio 3 if both ran at their compute bound, here", ceiling, [1.0] * len(ceiling), times=False))


def _report(a: dict, pp2: dict, pp1: dict) -> None:
    m = a["microbatches"]
    print(f"\nmodel: {a['dims']}; batch {a['microbatch'] * m} x {a['seq']} tokens = {m} microbatches of "
          f"{a['microbatch']}; {a['repeats']} repeats after {a['warmup']} warmup; threads per rank: pp=2 "
          f"{pp2['threads']}, pp=1 {pp1['threads']}")
    print(f"hfpipe stages (first layer, last layer, embed, head): {pp2['stages']}; "
          f"transformers pp=2 modules on rank 0: {pp2['hf_layers'] or '-'}")
    for name, sec in (("fwd+bwd", pp2["train"]), ("fwd", pp2["forward"])):
        busy = [_med(c) for c in zip(*_col(sec["compute"]))]
        alone = [_med(c) for c in zip(*_col(sec["compute_alone"]))]
        print(f"stage {name} over {m} microbatches, median s per rank: both ranks busy "
              f"{', '.join(f'{t:.3f}' for t in busy)}; one rank at a time {', '.join(f'{t:.3f}' for t in alone)}; "
              f"two ranks at once finish {_med(_bounds(sec, a)['speedup']):.2f}x sooner than one after the other "
              "(2.00 on two free cores)")
    head = f"{'measurement':<56} {'hfpipe s':>8} {'ref s':>8} {'ratio':>6} {'spread':>10}   goal"
    print("\n" + head + "\n" + "-" * (len(head) + 20))
    _report_1f1b(a, pp2["train"])
    _report_pp1(pp1)
    _report_forward(a, pp2["forward"])
    sh = pp2["shapes"]
    print(_row("4. pp=2 steps at varying lengths / fixed length, same tokens", _col(sh["varying"]),
               _col(sh["fixed"]), "shapes"))
    print(_row("   CPU s, both ranks: varying / fixed", _col(sh["varying"], "cpu"), _col(sh["fixed"], "cpu")))
    print(f"   (lengths {a['seq'] - a['seq'] // 4} and {a['seq'] + a['seq'] // 4} vs {a['seq']} twice; schedules "
          f"built during these steps: {sh['rebuilds']})")
    if pp2["hf_error"]:
        print(f"\ntransformers' pipeline parallelism could not run here: {pp2['hf_error']}")
    print("\nratio 3 = transformers' time / hfpipe's (throughput, higher is better); the others hfpipe / ref. "
          "Ratios: median of per-repeat ratios (spread: min-max); times: medians. Where two ranks at once are "
          "not ~2x faster than one after the other, ratio 3 can reach only the 'compute bound' row, not "
          "2m/(m+p-1).")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1408)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--microbatch", type=int, default=2, help="sequences per microbatch")
    p.add_argument("--microbatches", type=int, default=8, help="m: microbatches per step (pp=2 runs)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--workdir", default="/tmp/hfpipe-bench-schedule", help="checkpoint cache; raw times go here")
    args = p.parse_args()

    from hfpipe.parallel.launch import launch

    dims = dict(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                num_attention_heads=args.heads, num_key_value_heads=args.heads, max_position_embeddings=args.seq)
    folder = Path(args.workdir) / "llama"
    _ensure_checkpoint(folder, dims)
    a = {k: getattr(args, k) for k in ("seq", "microbatch", "microbatches", "repeats", "warmup")}
    print("pp=2 (1F1B step, stage compute, forward vs transformers PP), one thread per rank ...", flush=True)
    pp2 = launch(_pp2_rank, 2, str(folder), a, threads_per_rank=1)[0]
    print("pp=1 (hfpipe step vs transformers step), two threads ...", flush=True)
    pp1 = launch(_pp1_rank, 1, str(folder), a, threads_per_rank=2)[0]
    raw = Path(args.workdir) / "results.json"
    raw.write_text(json.dumps({"args": {**a, "dims": dims}, "pp2": pp2, "pp1": pp1}, indent=1))
    print(f"raw times: {raw}")
    _report({**a, "dims": dims}, pp2, pp1)


if __name__ == "__main__":
    main()
