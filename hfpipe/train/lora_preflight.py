"""A LoRA run's checks before any process starts: targets, the quantized base's blocks, resume kind.

Kept apart from :mod:`hfpipe.lora.adapters` because it also asks the quantized base
(:mod:`hfpipe.quant`), which the adapters themselves (and the exports that read them) never need.
"""

from __future__ import annotations

from hfpipe.lora.adapters import LoraError, from_finetune_config, resolve_config

__all__ = ["check_lora_run"]


def check_lora_run(cfg, model_config, resume: str | None = None) -> None:
    """Check a run's LoRA settings on the meta model, and that a resumed checkpoint is of the same kind.

    Raises:
        LoraError: targets matching nothing, or a LoRA/full checkpoint resumed by the other kind of run.
        QuantError: a ``--quantize-base`` block size that does not fit the model, or torchao missing.
    """
    from hfpipe.files import read_side_json

    config = from_finetune_config(cfg)
    if config is not None:
        from hfpipe.models.meta import build_meta_model, model_config as hf_config

        full = build_meta_model(hf_config(model_config))
        resolved = resolve_config(config, full)
        if cfg.tp > 1:
            from hfpipe.lora.tensor import check_tp_lora

            check_tp_lora(resolved, cfg.tp)
        if getattr(cfg, "quantize_base", None) is not None:  # block sizes and torchao, before any process starts
            from hfpipe.quant.linear import check_quantize

            check_quantize(model_config, cfg.quantize_base, cfg.quantize_block_size, tp=cfg.tp)  # plan calls it too
    if resume is None:
        return
    meta = read_side_json(resume / "hfpipe.json")  # checked whole by the resume preflight before this
    saved = meta.get("lora")
    if (saved is None) != (config is None):
        kind = "a LoRA" if saved is not None else "a full fine-tuning"
        fix = "add --lora-rank" if saved is not None else "drop --lora-rank"
        raise LoraError(f"--resume {resume} is {kind} checkpoint; {fix} to resume it, or start afresh")
    if saved is not None and saved.get("r") != config.r:
        raise LoraError(f"--resume {resume} holds rank-{saved.get('r')} adapters; pass --lora-rank {saved.get('r')}")
    was = (meta.get("quantize_base") or {}).get("kind")
    if saved is not None and was != getattr(cfg, "quantize_base", None):
        fix = f"pass --quantize-base {was}" if was else "drop --quantize-base"
        raise LoraError(f"--resume {resume} trained its adapters on a {was or 'full-precision'} base; {fix}")
