"""Benchmark: what one pipeline rank reads and holds to load its stage, against ``from_pretrained``.

Builds (once; cached in ``--workdir``) a random Llama checkpoint of >= 1 GB (default bf16, ~1.7 GB
in 200 MB shards), plans it for ``--pp`` ranks, and for each rank runs, each in a fresh process:

- hfpipe: ``load_rank_stages(source, plan, rank)`` (the rank's stage only),
- transformers: ``AutoModelForCausalLM.from_pretrained(folder)`` (the whole model; what a rank
  would hold if it loaded the model and then cut its stage out).

Per rank it reports, against the rank's stage tensor bytes:

- read ratio: bytes read while loading and then reading every weight once / stage bytes (goal
  <= 1.05 for hfpipe), as ``rchar`` from /proc/self/io and as the loader's ``stats.bytes_read``;
- memory ratio: (peak RSS - peak RSS of a bare ``import torch, transformers`` process) / stage
  bytes (goal <= 1.25 for hfpipe); and the same over a "ready to load" process (imports, config,
  plan, meta model, no weights), which isolates the weights from a fixed ~110 MB: reading a config
  through ``AutoConfig`` makes transformers import accelerate -> torch._dynamo -> sympy, numpy, PIL.

Run:  python bench/load.py [--pp 4] [--dtype bf16] [--workdir /tmp/hfpipe-bench-load] [--rebuild]

With ``--ep N`` it measures expert parallelism instead: a Mixtral-shaped MoE saved in both key layouts
hub checkpoints use (per-expert 2-D tensors, and fused 3-D ``gate_up_proj``/``down_proj``), loaded by
N ranks (pp 1, dp N, ep N) in real gloo processes; per rank and layout, what it read against its share
(its tensors' bytes: the shared layers whole, its E/N experts). Goal: <= 1.05.

Reading the numbers: ``rchar`` counts bytes *requested from the kernel* by read() calls, served
from the page cache or the disk alike, and it cannot see memory-mapped reads (safetensors'
``safe_open``, which ``from_pretrained`` uses, shows ~0 there). So before every child the
checkpoint's pages are dropped from the page cache (``posix_fadvise(DONTNEED)`` on its files only)
and ``read_bytes`` (bytes fetched from storage, page faults and kernel readahead included) is shown
too: it is the number that also covers ``from_pretrained``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def _build(folder: Path, dims: dict, dtype: str) -> None:
    """Child: a random Llama saved by transformers in 200 MB shards."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(**dims, num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, DTYPES[dtype]))
    model.save_pretrained(folder, max_shard_size="200MB")
    (folder / "bench.json").write_text(json.dumps({**dims, "dtype": dtype}))


def _io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(":") for line in f)}


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _measure(load) -> dict:
    """Run ``load()``; the I/O counters' deltas around it and the process's peak RSS."""
    before, t0 = _io(), time.perf_counter()
    out = load()
    seconds, after = time.perf_counter() - t0, _io()
    return {"out": out, "load_s": seconds, "maxrss": _maxrss(),
            "rchar": after["rchar"] - before["rchar"], "read_bytes": after["read_bytes"] - before["read_bytes"]}


def _touch(modules) -> None:
    """Read every weight once, as a first training step would.

    ``from_pretrained`` may leave weights as views of the memory-mapped shards, paged in (read and
    counted in RSS) only when first used; the comparison is about weights ready to use.
    """
    for module in modules:
        for t in module.state_dict().values():
            if t.numel():
                t.max()  # a reduction: reads every element, allocates nothing large


def _unique_bytes(tensors) -> int:
    seen = {id(t): t for t in tensors}  # a tied head counted once
    return sum(t.numel() * t.element_size() for t in seen.values())


def _rank(folder: Path, pp: int, rank: int, dtype: str) -> dict:
    """Child: load one rank's stage with hfpipe."""
    sys.path.insert(0, str(REPO))
    import torch

    from hfpipe.pipeline.build import load_rank_stages
    from hfpipe.plan.split import plan_pipeline
    from hfpipe.source.folder import ModelSource
    from hfpipe.models.meta import build_meta_model

    src = ModelSource.open(folder)
    plan = plan_pipeline(src.config, pp)
    build_meta_model(src.config)  # imports the model family's modules outside the measured window
    def load():
        modules, stats = load_rank_stages(src, plan, rank, torch.device("cpu"), getattr(torch, DTYPES[dtype]))
        _touch(modules)
        return modules, stats

    m = _measure(load)
    modules, stats = m.pop("out")
    specs = plan.stages_of_rank(rank)
    tensors = [t for mod in modules for t in list(mod.parameters()) + list(mod.buffers(recurse=True))]
    persistent = [t for mod in modules for t in mod.state_dict(keep_vars=True).values()]
    return {**m, "stage_bytes": _unique_bytes(persistent), "held_bytes": _unique_bytes(tensors),
            "bytes_read": stats.bytes_read, "files": len(stats.files_opened),
            "layers": f"{specs[0].layers[0]}-{specs[-1].layers[-1]}",
            "parts": ("embed " if specs[0].embed else "") + ("head" if specs[-1].head else "")}


def _hf(folder: Path, dtype: str) -> dict:
    """Child: load the whole model with transformers."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):  # imports the model family's modules outside the measured window
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    def load():
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, DTYPES[dtype]))
        _touch([model])
        return model

    m = _measure(load)
    model = m.pop("out")
    return {**m, "model_bytes": _unique_bytes(model.state_dict(keep_vars=True).values())}


def _baseline() -> dict:
    for name in ("torch", "transformers"):  # imported for their memory alone: the baseline a load adds to
        importlib.import_module(name)

    return {"maxrss": _maxrss()}


def _ready(folder: Path, pp: int) -> dict:
    """Child: everything a loading process does before its first weight (imports, config, plan, meta)."""
    sys.path.insert(0, str(REPO))
    from hfpipe.plan.split import plan_pipeline
    from hfpipe.source.folder import ModelSource
    from hfpipe.models.meta import build_meta_model

    src = ModelSource.open(folder)
    plan_pipeline(src.config, pp)
    build_meta_model(src.config)
    return {"maxrss": _maxrss()}


def _ep_rank(folder: str, ep: int, dtype: str) -> dict:
    """One of ``ep`` ranks (spawned): load every layer with this rank's experts only."""
    import torch

    from hfpipe.parallel.dims import ParallelDims
    from hfpipe.parallel.mesh import init_distributed
    from hfpipe.pipeline.build import load_rank_stages
    from hfpipe.models.stage import build_meta_model
    from hfpipe.plan.split import plan_pipeline
    from hfpipe.source.folder import ModelSource

    info = init_distributed(ParallelDims(pp=1, dp=ep, ep=ep))
    src = ModelSource.open(folder)
    plan = plan_pipeline(src.config, 1)
    build_meta_model(src.config)
    mesh = info.expert_mesh()
    m = _measure(lambda: load_rank_stages(src, plan, 0, torch.device("cpu"), getattr(torch, DTYPES[dtype]),
                                          expert_mesh=mesh))
    (stage,), stats = m.pop("out")
    local = [t.to_local() if hasattr(t, "to_local") else t for t in stage.state_dict(keep_vars=True).values()]
    return {**m, "share": _unique_bytes(local), "bytes_read": stats.bytes_read, "files": len(stats.files_opened)}


def _ep_report(a: argparse.Namespace) -> None:
    """Per layout and rank: bytes read at ``--ep`` over the rank's share."""
    sys.path.insert(0, str(REPO))
    from hfpipe.parallel.launch import launch

    root = Path(a.workdir) / "moe"
    dims = dict(hidden_size=a.hidden // 4, intermediate_size=a.intermediate // 4, num_hidden_layers=a.layers // 2,
                vocab_size=a.vocab // 4)
    folders = {layout: root / layout for layout in ("per-expert", "fused")}
    if a.rebuild or not all((f / "config.json").is_file() for f in folders.values()):
        print(f"building a random Mixtral-shaped MoE in {root} ...", flush=True)
        args = ["--child", "moe", str(root), json.dumps(dims), a.dtype]
        subprocess.run([sys.executable, __file__, *args], check=True, capture_output=True)
    head = f"{'layout':>10} {'rank':>4} {'share MB':>8} {'files':>5} | {'rchar':>6} {'stats':>6} {'time s':>6}"
    print(f"ep={a.ep}: {dims} with 8 experts, {a.dtype}\n{head}\n" + "-" * len(head))
    worst = 0.0
    for layout, folder in folders.items():
        _evict(folder)
        for rank, r in sorted(launch(_ep_rank, a.ep, str(folder), a.ep, a.dtype, threads_per_rank=1).items()):
            ratios = (r["rchar"] / r["share"], r["bytes_read"] / r["share"])
            worst = max(worst, *ratios)
            print(f"{layout:>10} {rank:>4} {r['share'] / 1e6:>8.1f} {r['files']:>5} | {ratios[0]:>6.3f} "
                  f"{ratios[1]:>6.3f} {r['load_s']:>6.1f}")
    print(f"\nworst read ratio at ep={a.ep} {worst:.3f} (goal <= 1.05); rchar and stats as above, over the rank's share")


def _build_moe(root: Path, dims: dict, dtype: str) -> None:
    """Child: one random Mixtral-shaped MoE, saved per-expert (as the hub) and fused (in-memory keys)."""
    import torch
    from transformers import AutoModelForCausalLM, MixtralConfig

    cfg = MixtralConfig(**dims, num_attention_heads=8, num_key_value_heads=4, num_local_experts=8,
                        num_experts_per_tok=2, sliding_window=None, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, DTYPES[dtype]))
    model.save_pretrained(root / "per-expert", max_shard_size="50MB")
    model.save_pretrained(root / "fused", max_shard_size="50MB", save_original_format=False)


def _child(*args: str) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"child {args} failed:\n{proc.stderr[-3000:]}")
    return json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])


def _evict(folder: Path) -> None:
    """Drop this checkpoint's pages (only its files) from the page cache: every child reads cold."""
    for path in folder.glob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _ensure_checkpoint(folder: Path, dims: dict, dtype: str, rebuild: bool) -> None:
    stamp = folder / "bench.json"
    if not rebuild and stamp.is_file() and json.loads(stamp.read_text()) == {**dims, "dtype": dtype}:
        print(f"using the cached checkpoint in {folder}")
        return
    for path in folder.glob("*"):
        path.unlink()
    print(f"building a random Llama in {folder} ...", flush=True)
    args = ["--child", "build", str(folder), json.dumps(dims), dtype]
    subprocess.run([sys.executable, __file__, *args], check=True, capture_output=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="checkpoint and stage dtype")
    p.add_argument("--workdir", default="/tmp/hfpipe-bench-load", help="the checkpoint is cached here")
    p.add_argument("--rebuild", action="store_true", help="rebuild the cached checkpoint")
    p.add_argument("--ep", type=int, default=0, help="measure expert-parallel loading at this ep instead")
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        kind, *rest = a.child
        if kind in ("build", "moe"):
            (_build if kind == "build" else _build_moe)(Path(rest[0]), json.loads(rest[1]), rest[2])
            return
        children = {
            "base": lambda: _baseline(),
            "ready": lambda: _ready(Path(rest[0]), int(rest[1])),
            "rank": lambda: _rank(Path(rest[0]), int(rest[1]), int(rest[2]), rest[3]),
            "hf": lambda: _hf(Path(rest[0]), rest[1]),
        }
        out = children[kind]()
        print(json.dumps(out))
        return
    if a.ep:
        return _ep_report(a)
    folder = Path(a.workdir) / "llama"
    folder.mkdir(parents=True, exist_ok=True)
    dims = dict(hidden_size=a.hidden, intermediate_size=a.intermediate, num_hidden_layers=a.layers,
                vocab_size=a.vocab)
    _ensure_checkpoint(folder, dims, a.dtype, a.rebuild)
    _report(folder, a, _child("base")["maxrss"], _child("ready", str(folder), str(a.pp))["maxrss"])


def _report(folder: Path, a: argparse.Namespace, base: int, ready: int) -> None:
    total = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    shards = len(list(folder.glob("*.safetensors")))
    print(f"checkpoint: {total / 1e9:.2f} GB in {shards} shards ({a.dtype}); pp={a.pp}; "
          f"bare `import torch, transformers` peak RSS {base / 1e6:.0f} MB, "
          f"ready to load (imports, config, plan, meta model) {ready / 1e6:.0f} MB")
    head = (f"{'rank':>4} {'layers':>6} {'parts':>11} {'stage MB':>8} {'files':>5} | {'loader':<9}"
            f" {'rchar':>6} {'stats':>6} {'disk':>6} {'RSS':>6} {'RSS*':>6} {'time s':>6}")
    print(head + "\n" + "-" * len(head))
    worst = {"read": 0.0, "rss": 0.0}
    for rank in range(a.pp):
        _evict(folder)
        r = _child("rank", str(folder), str(a.pp), str(rank), a.dtype)
        _evict(folder)
        h = _child("hf", str(folder), a.dtype)
        stage = r["stage_bytes"]
        for name, m, stats in (("hfpipe", r, r["bytes_read"] / stage), ("from_pre", h, None)):
            lead = f"{rank:>4} {r['layers']:>6} {r['parts']:>11} {stage / 1e6:>8.0f} {r['files']:>5}"
            lead = lead if name == "hfpipe" else " " * len(lead)
            stats_col = f"{stats:>6.3f}" if stats is not None else f"{'-':>6}"
            print(f"{lead} | {name:<9} {m['rchar'] / stage:>6.3f} {stats_col} {m['read_bytes'] / stage:>6.3f}"
                  f" {(m['maxrss'] - base) / stage:>6.3f} {(m['maxrss'] - ready) / stage:>6.3f} {m['load_s']:>6.1f}")
        worst["read"] = max(worst["read"], r["rchar"] / stage, r["bytes_read"] / stage)
        worst["rss"] = max(worst["rss"], (r["maxrss"] - base) / stage)
    print(f"\nworst hfpipe read ratio {worst['read']:.3f} (goal <= 1.05), "
          f"memory ratio {worst['rss']:.3f} (goal <= 1.25)")
    print("columns are ratios to the rank's stage tensor bytes: rchar = /proc/self/io rchar delta around the load "
          "(bytes requested from the kernel by read(), page cache or disk alike; blind to mmap, which "
          "from_pretrained uses); stats = the loader's stats.bytes_read; disk = read_bytes delta with the "
          "checkpoint evicted from the page cache first (storage reads incl. mmap faults and readahead); "
          "RSS = (peak RSS - bare-import peak RSS); RSS* = (peak RSS - ready-to-load peak RSS): the weights' share, "
          "without the fixed cost of the modules transformers imports to read a config and build a model; "
          "time s = the load plus one read of every weight (from_pretrained maps the shards lazily: its weights "
          "are read, and count in RSS, only when first used, so both children touch every weight once).")


if __name__ == "__main__":
    main()
