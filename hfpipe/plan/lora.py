"""What a LoRA run costs each rank, for ``hfpipe plan --lora-rank``.

The adapters are counted on the meta model from the modules PEFT would adapt (``rank * (in + out)``
each); the frozen base keeps its weights but has no gradients or optimizer state. Under ``--tp`` a
rank holds the part of each adapter the runtime splits off for it (:func:`adapter_params`), and the
adapters' own collectives are counted with the layers' (:func:`tp_adapters`, :mod:`hfpipe.plan.tensor_comm`).
"""

from __future__ import annotations

from torch import nn

from hfpipe.lora.adapters import lora_config, resolve_config
from hfpipe.plan.cost import _Cache, config_key

__all__ = ["adapter_params", "rank_memory", "describe_plan", "tp_adapters"]

_TARGETS = _Cache()  # (config_key, class, rank, targets, tp) -> _find_targets' answer


def adapter_params(model_config, rank: int, targets: str = "all-linear", tp: int = 1) -> dict[str, int]:
    """Adapter parameters per part of the model for ``--lora-rank``/``--lora-targets`` (for ``plan``),
    on one tensor-parallel rank of ``tp``.

    Counted on the meta model from the modules PEFT would adapt: ``rank * (in + out)`` each. Under tp
    the runtime builds each adapter whole and splits it as its base (:mod:`hfpipe.lora.tensor`):
    on a column-split base ``lora_B``'s out-features over tp (``lora_A`` whole), on a row-split base
    ``lora_A``'s in-features (``lora_B`` whole); on a base the plan leaves whole, both whole.

    Returns:
        ``{"embed": n, "head": n, "layer.<i>": n, ...}`` (parts without adapters are 0 or absent).

    Raises:
        LoraError: under tp, adapters the tp-split stages cannot carry (the runtime's own check).
    """
    meta, config, linears = _linear_targets(model_config, rank, targets, tp)
    out: dict[str, int] = {"embed": 0, "head": 0}
    for key, _, (i, o), style in linears:
        i, o = (i, o // tp) if style == "colwise" else (i // tp, o) if style == "rowwise" else (i, o)
        out[key] = out.get(key, 0) + rank * (i + o)
    for name, p in meta.named_parameters():  # PEFT's target_parameters: fused expert stacks, routers
        if config.target_parameters and any(name == t or name.endswith("." + t) for t in config.target_parameters):
            key = f"layer.{name.split('.')[2]}"
            experts = p.shape[0] if p.dim() == 3 else 1  # one rank-r adapter per expert
            out[key] = out.get(key, 0) + _rank(config, name) * experts * (p.shape[-2] + p.shape[-1])
    return out


def tp_adapters(model_config, rank: int, targets: str, tp: int):
    """What a LoRA run's adapters add to and spare of the tp collectives (:mod:`hfpipe.plan.tensor_comm`):
    per decoder layer ``(ranks on column-split bases, ranks on row-split bases, the row-split bases'
    lora_B elements)``, and the first layer's attention input sums its frozen input spares."""
    from hfpipe.plan.tensor_comm import Adapters, frozen_input_sums

    layers: dict[int, tuple[int, int, int]] = {}
    first: set[str] = set()
    for key, name, (_, o), style in _linear_targets(model_config, rank, targets, tp)[2]:
        if name.startswith("model.layers.0."):
            first.add(name.rsplit(".", 1)[1])
        if key.startswith("layer.") and style:
            col, row, b = layers.get(int(key[6:]), (0, 0, 0))
            layers[int(key[6:])] = (col + rank, row, b) if style == "colwise" else (col, row + rank, b + rank * o)
    return Adapters(layers, frozen_input_sums(model_config, first))


def _linear_targets(model_config, rank: int, targets: str, tp: int):
    """``(meta model, resolved LoraConfig, [(part, name, (in, out), "colwise" | "rowwise" | None)])``
    for every linear PEFT would adapt; the style is the runtime's tp plan's (``None`` at tp 1 or whole)."""
    key = (config_key(model_config), type(model_config), rank, targets, tp)
    if key not in _TARGETS:  # a fit search prices one LoRA run many times
        _TARGETS[key] = _find_targets(model_config, rank, targets, tp)
    return _TARGETS[key]


def _find_targets(model_config, rank: int, targets: str, tp: int):
    from peft.tuners.tuners_utils import check_target_module_exists

    from hfpipe.models.meta import build_meta_model, model_config as hf_config

    meta = build_meta_model(hf_config(model_config))
    config = resolve_config(lora_config(rank, targets=targets), meta)
    styles = _styles(model_config, meta, config, tp)
    linears = []
    for name, module in meta.named_modules():
        if not isinstance(module, (nn.Linear, nn.Embedding)) or not check_target_module_exists(config, name):
            continue
        part = name.split(".")
        key = f"layer.{part[2]}" if name.startswith("model.layers.") else (
            "embed" if isinstance(module, nn.Embedding) else "head")
        linears.append((key, name, (module.weight.shape[1], module.weight.shape[0]), styles.get(name)))
    return meta, config, linears


def _styles(model_config, meta, config, tp: int) -> dict[str, str]:
    """Module name -> ``colwise``/``rowwise`` as the runtime's tp plan splits it (empty at tp 1)."""
    if tp == 1:
        return {}
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from hfpipe.lora.tensor import check_tp_lora
    from hfpipe.parallel.tensor_plan import stage_tp_plan

    check_tp_lora(config, tp)
    plan = stage_tp_plan(model_config, [n for n, _ in meta.named_modules()], True, tp)
    kinds = ((ColwiseParallel, "colwise"), (RowwiseParallel, "rowwise"))  # as split_adapters tells them apart
    return {name: kind for name, style in plan.items() for cls, kind in kinds if isinstance(style, cls)}


def _rank(config, name: str) -> int:
    """The adapter rank of parameter ``name``: ``rank_pattern`` (PEFT doubles it where gate and up are fused)."""
    import re

    owner = name.rpartition(".")[0] if name.endswith(".weight") else name
    return next((r for pat, r in (config.rank_pattern or {}).items() if re.fullmatch(pat, owner)), config.r)


def rank_memory(rank_report, specs, counts: dict[str, int], dtype: str, dp: int = 1, quantized: bool = False):
    """A plan's :class:`~hfpipe.plan.report.RankReport` for a LoRA run of the same layout.

    The base is frozen: its weights stay but it has no gradients and no AdamW state. The adapters
    are fp32 weights, fp32 gradients and two fp32 AdamW moments: 4 + 4 + 8 bytes each (and under
    ``bf16-mixed`` the bf16 copy cast for the forward, 2 more). With
    ``dp > 1`` FSDP2 shards both as it shards a full run (hfpipe.plan.memory.param_bytes): the
    masters and AdamW state split ``dp`` ways, the gathered compute copies and the step's
    unsharded gradients whole. Activations are the full run's: backward still goes through every
    base layer, for the adapters below it.
    """
    import dataclasses

    from hfpipe.plan.memory import frozen_dtype, fsdp_bytes, param_bytes

    n = sum(counts.get("embed", 0) * s.embed + counts.get("head", 0) * s.head
            + sum(counts.get(f"layer.{i}", 0) for i in s.layers) for s in specs)
    base = rank_report.params
    base_w = param_bytes(frozen_dtype(dtype, quantized), dp)[0]  # a full run's weight, in the base's precision
    m = 8 if dtype == "fp64" else 4  # the adapters' masters: fp32, fp64 in an fp64 run
    if dp == 1:  # under bf16-mixed a bf16 compute copy sits beside the fp32 masters, as of the base
        w, g, o = m + 2 * (dtype == "bf16-mixed"), m, 2 * m
    else:  # adapters: masters, grads and moments, sharded as param_bytes shards a full run's
        w, g, o = m / dp + fsdp_bytes(dtype)[1], m, 2 * m / dp  # whole gradients, reduce-scattered unit by unit
    return dataclasses.replace(rank_report, weight_bytes=int(base * base_w + w * n),
                               grad_bytes=int(g * n), optimizer_bytes=int(o * n)), n


def describe_plan(ranks, plan, model_config, dtype: str, rank: int, targets: str, total: int, dp: int = 1,
                  tp: int = 1, quantized: bool = False):
    """``plan``'s rank reports priced for LoRA, and the line that says so (for ``hfpipe plan``).

    ``ranks`` already hold one tensor-parallel rank's share of the base (:func:`hfpipe.plan.tensor.price_ranks`);
    the adapters are priced at the share the runtime's split leaves a rank (:func:`adapter_params`)."""
    whole, held = adapter_params(model_config, rank, targets), adapter_params(model_config, rank, targets, tp)
    out, n_all, n_held = [], 0, 0
    for r in ranks:
        report, n = rank_memory(r, plan.stages_of_rank(r.rank), held, dtype, dp, quantized)
        out.append(report)
        n_held = max(n_held, n)
        n_all += rank_memory(r, plan.stages_of_rank(r.rank), whole, dtype, dp, quantized)[1]
    sharded = f", sharded over dp={dp} by FSDP2" if dp > 1 else ""
    split = f"; split as their tp-split bases, at most {n_held:,} on a GPU" if tp > 1 else ""
    line = (f"LoRA rank {rank} on {targets}: {n_all:,} adapter parameters ({100 * n_all / max(1, total):.2f}% "
            f"of the model); base frozen (weights only, no grads or AdamW state), adapters fp32 "
            f"(weights, grads, AdamW){sharded}{split}")
    return tuple(out), line
