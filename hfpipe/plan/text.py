"""``hfpipe plan``'s report as plain text: the stage and rank tables, then the mesh, balance and bubble.

Apart from :mod:`hfpipe.plan.report` (which prices a plan) so that pricing and printing each stay a
file that fits; the sizes and counts are written the same way wherever ``plan`` prints them.
"""

from __future__ import annotations

from hfpipe.plan.memory import param_bytes

__all__ = ["format_report", "size"]


def size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(int(n))


def _table(header: list[str], rows: list[list], left: int = -1) -> list[str]:
    """Right-aligned columns, except column ``left``."""
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]

    def line(row) -> str:
        return "  ".join(str(c).ljust(w) if i == left else str(c).rjust(w)
                         for i, (c, w) in enumerate(zip(row, widths))).rstrip()

    return [line(header), "  ".join("-" * w for w in widths)] + [line(r) for r in rows]


def _per_layer(r) -> str:
    low, high = (f"{b / max(1, r.hidden):.1f}*hidden B" for b in r.layer_act)
    return low if low == high else f"{low} to {high}"


def _mesh_words(r) -> tuple[str, str, str]:
    """(the axes beside pp, how a parameter is sharded, the mesh of the GPUs) in words."""
    per_mb = ", resharded per microbatch" if r.reshard_per_microbatch else ""
    shards = r.dp * r.cp
    sharding = f", dp {r.dp} (FSDP2{per_mb})" if r.dp > 1 else ""
    sharding += f", cp {r.cp} (sequence / {r.cp})" if r.cp > 1 else ""
    sharding += f", tp {r.tp}{' (sequence parallel)' if r.sequence_parallel else ''}" if r.tp > 1 else ""
    over = f"dp {r.dp} x cp {r.cp}" if r.cp > 1 else f"dp {r.dp}"
    fsdp = (f", FSDP2 over {over}{per_mb}" if shards > 1 else "") + (f", / tp {r.tp}" if r.tp > 1 else "")
    axes = [f"{n} {d}" for n, d in (("pp", r.plan.pp), ("dp", r.dp), ("cp", r.cp), ("tp", r.tp))
            if n in ("pp", "dp") or d > 1]
    mesh = f" ({' x '.join(axes)})" if r.tp > 1 or r.cp > 1 else ""
    return sharding, fsdp, mesh


def format_report(report) -> str:
    """The report as plain-text tables: stages, then ranks, then balance and bubble."""
    r, plan = report, report.plan
    w, g, o = (f"{b:g}" for b in param_bytes(r.dtype, r.dp * r.cp, r.reshard_per_microbatch))
    sharding, fsdp, mesh = _mesh_words(r)
    lines = [
        f"{r.model}: {_count(r.total_params)} parameters, {r.num_layers} decoder layers",
        f"pipeline: pp {plan.pp} x vpp {plan.vpp} ({plan.style} style){sharding}, schedule {r.schedule}, "
        f"{r.microbatches} microbatches of {r.microbatch_size} x {r.seq_len} tokens, {r.dtype}, "
        f"activation checkpointing {r.activation_checkpointing}",
        "",
    ]
    lines += _table(["stage", "rank", "holds", "params", "cost/mean", "in flight", "activations"], [
        [s.index, s.rank, s.holds, _count(s.params), f"{s.cost_share:.3f}", s.in_flight,
         size(s.activation_bytes)] for s in r.stages], left=2)
    lines += [""] + _rank_table(r)
    worst = max(r.ranks, key=lambda k: k.total_bytes)
    tokens = r.microbatches * r.microbatch_size * r.seq_len * r.dp
    lines += [
        "",
        f"balance {r.balance:.3f} (costliest stage / mean; 1.000 is perfect)",
        f"bubble {100 * r.bubble:.1f}% of each step idle ({r.schedule}, analytic)",
        f"tokens per schedule step: {tokens:,} ({r.microbatches * r.microbatch_size} sequences"
        f"{f' = {r.microbatches * r.microbatch_size // 2} pairs' if r.method == 'dpo' else ''} x "
        f"{r.seq_len} x dp {r.dp}) on {r.gpus} GPUs{mesh}",
        f"peak memory {size(worst.total_bytes)} on rank {worst.rank}",
        f"per parameter: weights {w} B, grads {g} B, AdamW {o} B ({r.dtype}{fsdp}); activations "
        f"{_per_layer(r)} per token per layer (measured on transformers' layer), logits on the head stage",
    ]
    apart = max(k.apart_bytes for k in r.ranks)
    if apart:
        lines.append(f"total: gradients and activations as they coexist over the schedule (up to {size(apart)} "
                     "less than their columns' sum: a backward frees a layer's activations as it makes its gradients)")
    if r.lora:
        lines.append(r.lora)
    lines += r.notes
    return "\n".join(lines)


def _rank_table(r) -> list[str]:
    """One row per pipeline rank: its memory, then the traffic of each axis it uses."""
    dequant = any(k.transient_bytes for k in r.ranks)
    traffic = [(name, field) for name, field, used in (
        ("all-to-all/step", "all_to_all_bytes", r.ep > 1), ("tp comm/step", "tp_bytes", r.tp > 1),
        ("cp comm/step", "cp_bytes", r.cp > 1), ("fsdp comm/step", "fsdp_bytes", r.reshard_per_microbatch)) if used]
    return _table(["rank", "stages", "params", "weights", "grads", "optimizer", "activations"]
                  + ["dequant"] * dequant + ["total"] + [name for name, _ in traffic], [
        [k.rank, ",".join(map(str, k.stages)), _count(k.params), size(k.weight_bytes),
         size(k.grad_bytes), size(k.optimizer_bytes), size(k.activation_bytes)]
        + [size(k.transient_bytes)] * dequant + [size(k.total_bytes)]
        + [size(getattr(k, field)) for _, field in traffic] for k in r.ranks])
