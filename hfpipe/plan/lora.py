"""What a LoRA run costs each rank, for ``hfpipe plan --lora-rank``.

The adapters are counted on the meta model from the modules PEFT would adapt (``rank * (in + out)``
each); the frozen base keeps its weights but has no gradients or optimizer state.
"""

from __future__ import annotations

from torch import nn

from hfpipe.lora.adapters import lora_config, resolve_config

__all__ = ["adapter_params", "rank_memory", "describe_plan"]


def adapter_params(model_config, rank: int, targets: str = "all-linear") -> dict[str, int]:
    """Adapter parameters per part of the model for ``--lora-rank``/``--lora-targets`` (for ``plan``).

    Counted on the meta model from the modules PEFT would adapt: ``rank * (in + out)`` each.

    Returns:
        ``{"embed": n, "head": n, "layer.<i>": n, ...}`` (parts without adapters are 0 or absent).
    """
    from hfpipe.models.meta import build_meta_model, model_config as hf_config

    meta = build_meta_model(hf_config(model_config))
    config = resolve_config(lora_config(rank, targets=targets), meta)
    from peft.tuners.tuners_utils import check_target_module_exists

    out: dict[str, int] = {"embed": 0, "head": 0}
    for name, module in meta.named_modules():
        if not isinstance(module, (nn.Linear, nn.Embedding)) or not check_target_module_exists(config, name):
            continue
        shape = module.weight.shape
        part = name.split(".")
        key = f"layer.{part[2]}" if name.startswith("model.layers.") else (
            "embed" if isinstance(module, nn.Embedding) else "head")
        out[key] = out.get(key, 0) + rank * (shape[0] + shape[1])
    for name, p in meta.named_parameters():  # PEFT's target_parameters: fused expert stacks, routers
        if config.target_parameters and any(name == t or name.endswith("." + t) for t in config.target_parameters):
            key = f"layer.{name.split('.')[2]}"
            experts = p.shape[0] if p.dim() == 3 else 1  # one rank-r adapter per expert
            out[key] = out.get(key, 0) + _rank(config, name) * experts * (p.shape[-2] + p.shape[-1])
    return out


def _rank(config, name: str) -> int:
    """The adapter rank of parameter ``name``: ``rank_pattern`` (PEFT doubles it where gate and up are fused)."""
    import re

    owner = name.rpartition(".")[0] if name.endswith(".weight") else name
    return next((r for pat, r in (config.rank_pattern or {}).items() if re.fullmatch(pat, owner)), config.r)


def rank_memory(rank_report, specs, counts: dict[str, int], dtype: str, dp: int = 1):
    """A plan's :class:`~hfpipe.plan.report.RankReport` for a LoRA run of the same layout.

    The base is frozen: its weights stay but it has no gradients and no AdamW state. The adapters
    are fp32 weights, fp32 gradients and two fp32 AdamW moments: 4 + 4 + 8 bytes each. With
    ``dp > 1`` FSDP2 shards both as it shards a full run (hfpipe.plan.memory.param_bytes): the
    masters and AdamW state split ``dp`` ways, the gathered compute copies and the step's
    unsharded gradients whole. Activations are the full run's: backward still goes through every
    base layer, for the adapters below it.
    """
    import dataclasses

    from hfpipe.plan.memory import fsdp_bytes, param_bytes

    n = sum(counts.get("embed", 0) * s.embed + counts.get("head", 0) * s.head
            + sum(counts.get(f"layer.{i}", 0) for i in s.layers) for s in specs)
    base = rank_report.params
    base_w = param_bytes(dtype, dp)[0]  # a frozen weight costs what a full run's weight costs
    if dp == 1:
        w, g, o = 4, 4, 8
    else:  # adapters: fp32 masters, grads and moments, sharded as param_bytes shards a full run's
        w, g, o = 4 / dp + fsdp_bytes(dtype)[1], 4 + 4 / dp, 8 / dp
    return dataclasses.replace(rank_report, weight_bytes=int(base * base_w + w * n),
                               grad_bytes=int(g * n), optimizer_bytes=int(o * n)), n


def describe_plan(ranks, plan, model_config, dtype: str, rank: int, targets: str, total: int, dp: int = 1):
    """``plan``'s rank reports priced for LoRA, and the line that says so (for ``hfpipe plan``)."""
    counts = adapter_params(model_config, rank, targets)
    out, n_all = [], 0
    for r in ranks:
        report, n = rank_memory(r, plan.stages_of_rank(r.rank), counts, dtype, dp)
        out.append(report)
        n_all += n
    sharded = f", sharded over dp={dp} by FSDP2" if dp > 1 else ""
    line = (f"LoRA rank {rank} on {targets}: {n_all:,} adapter parameters ({100 * n_all / max(1, total):.2f}% "
            f"of the model); base frozen (weights only, no grads or AdamW state), adapters fp32 "
            f"(weights, grads, AdamW){sharded}")
    return tuple(out), line
