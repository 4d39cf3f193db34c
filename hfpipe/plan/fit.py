"""Does a run fit its GPUs? The plan of a :class:`~hfpipe.config.run.FinetuneConfig`, checked per rank
against a memory size, and the nearest changes that make it fit.

``hfpipe plan`` prices exactly what ``hfpipe finetune`` would run: both start from the same
FinetuneConfig (its defaults, a recipe, flags), and :func:`plan_kwargs` is the one place that turns
its fields into :func:`hfpipe.plan.report.plan_report` arguments. A feature that changes memory
(e.g. LoRA's rank) adds its field there and in ``plan_report``; the fit check, the suggestions and
the CLI then follow without change.

The suggestions try one lever at a time, cheapest first, and report the smallest step of each that
fits with 10% to spare: activation checkpointing (selective, then full), more pipeline ranks, more data-parallel
pipelines, for a MoE model expert parallelism (more ep over the dp ranks there are, or more dp
with ep over them), more tensor parallelism (powers of two up to the GPUs of one node), more
context parallelism (powers of two, while each rank keeps a long chunk of the sequence:
:data:`CP_MIN_TOKENS`), and FSDP2 resharded per microbatch (at the dp there is, or with more dp);
if no single lever fits, full activation checkpointing together with one of these. Then a search over every axis at once
(:func:`fewest_gpus`), whatever the starting mesh: the meshes that fit on the fewest GPUs. Each
suggestion carries its bubble, the price of a longer pipeline.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from dataclasses import dataclass

from hfpipe.errors import PlanError
from hfpipe.models.moe import routed_experts
from hfpipe.plan.text import size as _size

__all__ = ["CP_MIN_TOKENS", "RankFit", "Suggestion", "fewest_gpus", "fit_report", "format_fit", "parse_memory",
           "plan_kwargs", "report_for", "suggest"]

_AC_ORDER = ("none", "selective", "full")
_DP_STEPS = (2, 4, 8, 16, 32, 64, 128)
_PP_FACTORS = (1.25, 1.5, 2, 3, 4, 6, 8)
_HEADROOM = 0.9  # below 10% free, a plan "fits, tightly": CUDA context, allocator fragmentation
#: Fewest tokens of a sequence a cp rank keeps in what the fit search proposes. cp costs a K/V gather
#: per layer that a rank's attention over its chunk has to hide, and pays off where the sequence is
#: what does not fit; the published layouts keep 8k or more a rank (Llama 3 trained 128k at cp 16,
#: Megatron-Bridge runs Llama-3.1-70B at 64k with cp 8, torchtitan Llama-3.1-8B at 128k with cp 4).
#: On shorter chunks dp (the same FSDP2 shards, more tokens a step) is the better use of the GPUs,
#: and the search stays as quick as before at short sequences. A --cp given is priced whatever it is.
CP_MIN_TOKENS = 8192


def parse_memory(text: str) -> int:
    """Bytes of GPU memory in ``80GB``, ``80GiB``, ``141G`` or a number of bytes.

    GB counts as GiB here, as GPU makers use it: an "80GB" H100 has 79.6 GiB (81559 MiB), so
    reading 80 * 10**9 would wrongly refuse a plan that fits. Plans within 10% of the size are
    reported as tight.

    Raises:
        PlanError: not a size.
    """
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]?)I?B?", str(text).strip().upper())
    if not m or float(m.group(1)) <= 0:
        raise PlanError(f"--gpu-memory {text!r} is not a size like 80GB or 141GB")
    return int(float(m.group(1)) * 1024 ** " KMGT".index(m.group(2) or " "))


def plan_kwargs(cfg) -> dict:
    """:func:`~hfpipe.plan.report.plan_report` arguments for a FinetuneConfig (bar the model config).

    Args:
        cfg: A :class:`hfpipe.config.run.FinetuneConfig`.
    """
    # Every option that changes memory goes through here, so fits, suggestions and the PNG follow.
    return dict(pp=cfg.pp, dp=cfg.dp, vpp=cfg.vpp, schedule=cfg.schedule, layout=cfg.layout,
                method=cfg.plan_method, microbatches=cfg.num_microbatches, seq_len=cfg.seq_len,
                batch_size=cfg.batch_size, dtype=cfg.dtype,
                activation_checkpointing=cfg.activation_checkpointing, lora_rank=cfg.lora_rank,
                lora_targets=cfg.lora_targets, ep=cfg.ep, quantize_base=cfg.quantize_base, tp=cfg.tp, cp=cfg.cp,
                sequence_parallel=cfg.sequence_parallel, reshard_per_microbatch=cfg.reshard_per_microbatch,
                quantize_block_size=cfg.quantize_block_size, train_method=cfg.method,
                fp8=cfg.fp8_recipe if cfg.fp8 else None)


def report_for(model_config, cfg, name: str | None = None):
    """The :class:`~hfpipe.plan.report.PlanReport` of running ``cfg`` on ``model_config``.

    Reports are kept by their arguments: :func:`suggest` asks again for plans it (or the caller)
    already priced, and a report is a frozen value of its arguments alone.
    """
    from hfpipe.plan.cost import config_key
    from hfpipe.plan.report import plan_report

    kwargs = plan_kwargs(cfg)
    key = (config_key(model_config), type(model_config), name or cfg.model, tuple(sorted(kwargs.items())))
    if key not in _REPORTS:
        if len(_REPORTS) >= 4096:  # a mesh search prices a few hundred plans
            _REPORTS.clear()
        _REPORTS[key] = plan_report(model_config, name=name or cfg.model, **kwargs)
    return _REPORTS[key]


_REPORTS: dict = {}


@dataclass(frozen=True)
class RankFit:
    """One rank's peak against the GPU's memory."""

    rank: int
    peak: int
    limit: int

    @property
    def fits(self) -> bool:
        return self.peak <= self.limit

    @property
    def tight(self) -> bool:
        return self.fits and self.peak > _HEADROOM * self.limit


def fit_report(report, limit: int) -> list[RankFit]:
    """Each rank of ``report`` against ``limit`` bytes."""
    return [RankFit(r.rank, r.total_bytes, limit) for r in report.ranks]


@dataclass(frozen=True)
class Suggestion:
    """A change of flags that fits, and the peak it gives."""

    changes: dict  # FinetuneConfig field -> new value
    peak: int
    gpus: int  # pp * dp * cp * tp
    bubble: float = 0.0  # idle share of a step at the new mesh
    search: bool = False  # found by the search over every axis (fewest_gpus), not one lever

    def flags(self) -> str:
        return " ".join(_flag(k, v) for k, v in self.changes.items())


def _flag(key: str, value) -> str:
    name = f"--{key.replace('_', '-')}"
    if isinstance(value, bool):
        return name if value else f"--no-{key.replace('_', '-')}"
    return f"{name} {value}"


_LEVERS = ("pp", "dp", "ep", "dp+ep", "tp", "cp", "reshard", "dp+reshard")


def suggest(model_config, cfg, limit: int, gpus_per_node: int = 8) -> list[Suggestion]:
    """The nearest changes of ``cfg`` that fit ``limit`` bytes per rank, then the meshes of fewest GPUs
    that do (see the module docstring); tp goes up to ``gpus_per_node``."""
    experts = routed_experts(model_config)[0]
    levers = [_ladder(cfg, lever, experts, gpus_per_node) for lever in _LEVERS]
    ac = [[{"activation_checkpointing": a} for a in _AC_ORDER[_AC_ORDER.index(cfg.activation_checkpointing) + 1:]]]
    found = [s for s in (_lever(model_config, cfg, limit, changes) for changes in ac + levers) if s is not None]
    if not found and cfg.activation_checkpointing != "full":
        full = {"activation_checkpointing": "full"}
        found = [s for s in (_lever(model_config, cfg, limit, [{**full, **c} for c in ladder]) for ladder in levers)
                 if s is not None]
    seen = {s.flags() for s in found}
    return found + [s for s in fewest_gpus(model_config, cfg, limit, gpus_per_node) if s.flags() not in seen]


def _ladder(cfg, lever: str, experts: int = 0, gpus_per_node: int = 8) -> list[dict]:
    """The rungs of one lever. ``ep``: shard a MoE model's routed experts over more of the dp
    ranks it has; ``dp+ep``: more pipelines, the experts sharded over as many of them as divide;
    ``tp``: powers of two up to a node; ``cp``: powers of two while a rank keeps
    :data:`CP_MIN_TOKENS`; ``reshard``: FSDP2 per microbatch, at this dp or more."""
    if lever == "tp":
        return [{"tp": t} for t in _powers_of_two(gpus_per_node) if t > cfg.tp]  # plan refuses a t heads refuse
    if lever == "cp":
        return [{"cp": c} for c in _cp_choices(cfg.seq_len) if c > cfg.cp]
    if lever == "reshard" or lever == "dp+reshard":
        if cfg.reshard_per_microbatch or cfg.lora_rank is not None:
            return []
        if lever == "reshard":
            return [{"reshard_per_microbatch": True}] if cfg.dp > 1 else []
        return [{"dp": d, "reshard_per_microbatch": True} for d in _DP_STEPS if d > cfg.dp]
    if lever == "ep":
        return [{"ep": e} for e in range(cfg.ep + 1, cfg.dp + 1) if experts and not cfg.dp % e
                and not experts % e]
    if lever == "dp+ep":
        return [{"dp": d, "ep": math.gcd(d, experts)} for d in _DP_STEPS
                if experts and d > cfg.dp and math.gcd(d, experts) > cfg.ep]
    if lever == "dp":
        return [{"dp": d} for d in _DP_STEPS if d > cfg.dp]
    if cfg.layout:  # a pinned layout fixes the stage count
        return []
    values = sorted({max(cfg.pp + 1, round(cfg.pp * f)) for f in _PP_FACTORS})
    return [_with_microbatches(cfg, p) for p in values]


def _with_microbatches(cfg, pp: int) -> dict:
    """``--pp pp``, plus the microbatches and batch size a schedule needs at that many stages."""
    change = {"pp": pp}
    stages = pp * cfg.vpp
    if cfg.microbatches and cfg.microbatches < stages:
        change["microbatches"] = stages
    m = change.get("microbatches", cfg.microbatches or stages)
    if cfg.batch_size % m:
        change["batch_size"] = -(-cfg.batch_size // m) * m
    return change


def _lever(model_config, cfg, limit: int, ladder: list[dict]) -> Suggestion | None:
    """The first change on ``ladder`` whose plan fits, or None."""
    from hfpipe.config.names import ConfigError

    for changes in ladder:
        try:
            trial = dataclasses.replace(cfg, **changes)
            report = report_for(model_config, trial)
        except (ConfigError, ValueError):  # not a legal plan (too many stages, ...): next rung
            continue
        peak = max(r.total_bytes for r in report.ranks)
        if peak <= _HEADROOM * limit:  # a suggestion should not be tight itself
            return Suggestion(changes, peak, report.gpus, report.bubble)
    return None


def _powers_of_two(most: int) -> list[int]:
    return [2**i for i in range(most.bit_length()) if 2**i <= most]


def _cp_choices(seq_len: int) -> list[int]:
    """Powers of two that cut ``seq_len`` into ``2 * cp`` equal chunks of :data:`CP_MIN_TOKENS` a rank or more."""
    return [c for c in _powers_of_two(max(1, seq_len // CP_MIN_TOKENS)) if not seq_len % (2 * c) or c == 1]


def _tp_choices(model_config, most: int) -> list[int]:
    """Powers of two up to ``most`` that split the attention and key/value heads (hfpipe.plan.tensor)."""
    heads = model_config.num_attention_heads
    kv = getattr(model_config, "num_key_value_heads", None) or heads
    return [t for t in _powers_of_two(most) if not heads % t and not kv % t]


def fewest_gpus(model_config, cfg, limit: int, gpus_per_node: int = 8, keep: int = 3) -> list[Suggestion]:
    """The meshes on the fewest GPUs that fit ``limit`` with 10% to spare, searched over every axis
    from any start: tp (powers of two up to a node), dp (with ep over as many of its ranks as divide
    a MoE model's experts), cp (:func:`_cp_choices`, and the one set), FSDP2 per microbatch or per
    step, activation checkpointing as set or full, and for each the fewest pipeline ranks that fit.
    Fewest GPUs first, then smallest bubble, then the least cp (dp shards as much and runs more tokens)."""
    experts = routed_experts(model_config)[0]
    best: list[Suggestion] = []
    most = 4096  # GPUs: a bound the search tightens as meshes fit
    cps = sorted(set(_cp_choices(cfg.seq_len)) | {cfg.cp})
    axes = itertools.product(reversed(_tp_choices(model_config, gpus_per_node)), (1,) + _DP_STEPS, cps)
    for ac, (tp, dp, cp) in itertools.product(dict.fromkeys((cfg.activation_checkpointing, "full")), list(axes)):
        for reshard in ((False, True) if dp > 1 and cfg.lora_rank is None else (False,)):
            if dp * cp * tp > most:
                continue
            mesh = {"tp": tp, "dp": dp, "cp": cp, "ep": math.gcd(dp, experts) if experts else cfg.ep,
                    "reshard_per_microbatch": reshard, "activation_checkpointing": ac}
            s = _fewest_pp(model_config, cfg, limit, mesh, most // (dp * cp * tp))
            if s is not None:
                best.append(s)
                most = min(most, s.gpus)
    best = sorted((s for s in best if s.gpus == most),
                  key=lambda s: (s.bubble, s.changes.get("cp", cfg.cp), s.peak))
    return best[:keep]


def _fewest_pp(model_config, cfg, limit: int, mesh: dict, most: int) -> Suggestion | None:
    """The fewest pipeline ranks (at most ``most``) on which ``cfg`` with ``mesh`` fits, by bisection."""
    if cfg.layout:  # a pinned layout fixes the stage count
        candidates = [cfg.pp] if cfg.pp <= most else []
    else:
        candidates = list(range(1, min(most, model_config.num_hidden_layers) + 1))
    lo, hi, found = 0, len(candidates) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        s = _lever(model_config, cfg, limit, [_mesh_changes(cfg, {**mesh, **_with_microbatches(cfg, candidates[mid])})])
        if s is None:
            lo = mid + 1
        else:
            found, hi = dataclasses.replace(s, search=True), mid - 1
    return found


def _mesh_changes(cfg, mesh: dict) -> dict:
    """``mesh`` as flags: the three degrees always, the rest only where they differ from ``cfg``."""
    first = {k: mesh[k] for k in ("pp", "dp", "tp")}
    return {**first, **{k: v for k, v in mesh.items() if k not in first and getattr(cfg, k) != v}}


def format_fit(report, limit: int, suggestions: list[Suggestion] | None = None) -> str:
    """Per rank: fits, fits tightly, or does not fit by how much; then the verdict and suggestions."""
    fits = fit_report(report, limit)
    lines = [f"memory per rank against --gpu-memory {_size(limit)}:"]
    for f in fits:
        if not f.fits:
            verdict = f"does NOT fit, by {_size(f.peak - f.limit)}"
        else:
            verdict = f"fits, {_size(f.limit - f.peak)} free" + (" (tight: under 10%)" if f.tight else "")
        lines.append(f"  rank {f.rank:>3}: {_size(f.peak):>10}  {verdict}")
    bad = [f for f in fits if not f.fits]
    gpus = report.gpus
    if not bad:
        lines.append(f"fits: every rank within {_size(limit)} ({gpus} GPUs)")
        return "\n".join(lines)
    lines.append(f"does NOT fit: {len(bad)} of {len(fits)} ranks over {_size(limit)}")
    levers, meshes = ([s for s in suggestions or () if s.search == flag] for flag in (False, True))
    if levers:
        lines.append("nearest changes that fit (with 10% to spare):")
        lines += [f"  {s.flags():<48} {_fit_price(s)}" for s in levers]
    if meshes:
        lines.append("fewest GPUs that fit, every axis searched (tp up to a node):")
        lines += [f"  {s.flags():<48} {_fit_price(s)}" for s in meshes]
    if suggestions is not None and not suggestions:
        lines.append("no single change fits; a rank cannot hold its share at this size even with "
                     "full activation checkpointing and more pp or dp")
    return "\n".join(lines)


def _fit_price(s: Suggestion) -> str:
    return f"peak {_size(s.peak)}, {s.gpus} GPUs, bubble {100 * s.bubble:.1f}%"
