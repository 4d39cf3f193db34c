"""LoRA on pipeline stages, through PEFT's own injection.

A stage module keeps the full model's submodule names (``model.layers.17.self_attn.q_proj``), so
PEFT's ``LoraModel`` injects into it exactly the layers, parameter names
(``...q_proj.lora_A.default.weight``) and initialisation it would inject into the whole HF model:
a stage's adapter names are the ``PeftModel``'s minus its ``base_model.model.`` prefix. This module
only does what a split model needs around that:

- ``all-linear`` is resolved once on the full (meta) model, as ``get_peft_model`` resolves it, so the
  head is excluded and every stage targets the same names;
- each adapter is initialised from a seed derived from its name, so the initial adapters do not
  depend on the pipeline size;
- adapters stay fp32 over a bf16 base (PEFT's ``autocast_adapter_dtype``);
- :func:`adapter_view` gives DCP one module holding only the adapters, so checkpoints hold them
  and their optimizer state only.

Beside it: :mod:`hfpipe.plan.lora` (``hfpipe plan --lora-rank``), :mod:`hfpipe.lora.folder` (PEFT
adapter folders for ``hfpipe verify`` and the quickstart); the adapter export and merge live in
:mod:`hfpipe.export.adapter`.
"""

from __future__ import annotations

import copy
import zlib
from collections.abc import Iterable

import torch
from torch import nn

from hfpipe.errors import HfpipeError

__all__ = ["check_lora_config", "LoraError", "ADAPTER", "PEFT_PREFIX", "lora_config", "resolve_config", "add_adapters",
           "adapter_view", "peft_key", "config_to_dict", "config_from_dict", "from_finetune_config"]

#: PEFT's name for the one adapter hfpipe trains.
ADAPTER = "default"
#: What ``PeftModelForCausalLM`` puts before the HF model's names.
PEFT_PREFIX = "base_model.model."


class LoraError(HfpipeError):
    """A LoRA setting that cannot work (one line, names the option)."""


def lora_config(rank: int, *, alpha: float | None = None, dropout: float = 0.0,
                targets: str | Iterable[str] = "all-linear"):
    """The ``LoraConfig`` of the ``--lora-*`` flags (alpha defaults to 2 x rank)."""
    from peft import LoraConfig

    if isinstance(targets, str) and targets != "all-linear":
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    return LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, lora_dropout=dropout,
                      target_modules=targets if isinstance(targets, str) else list(targets),
                      task_type="CAUSAL_LM", bias="none")


def resolve_config(config, meta_model: nn.Module):
    """A copy of ``config`` whose targets are explicit, checked against the full meta model.

    PEFT resolves ``all-linear`` to every ``nn.Linear`` but the output head only when it sees the
    whole ``PreTrainedModel``; a stage would keep its head. On transformers 5 it also rewrites a MoE
    model's targets first (its v4 -> v5 conversion: on Mixtral, Qwen-MoE and DeepSeek-V2/V3,
    ``all-linear`` and ``gate_proj``/``up_proj``/``down_proj`` become the fused experts' parameters and
    the router's weight, with ranks doubled where gate and up are fused). Doing both here, once, the
    way ``get_peft_model`` does them, gives every stage (and the exported ``adapter_config.json``)
    what one process adapts.

    Raises:
        LoraError: a setting PEFT or a pipeline cannot train exactly, or targets matching nothing.
    """
    from peft.tuners.tuners_utils import _maybe_include_all_linear_layers
    from peft.utils.transformers_weight_conversion import (convert_peft_config_for_transformers,
                                                           get_model_conversion_mapping)

    check_lora_config(config)
    config = copy.deepcopy(config)
    if config.target_modules is None and not config.target_parameters:
        from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as defaults

        model_type = meta_model.config.model_type
        if model_type not in defaults:
            raise LoraError(f"no default LoRA targets for {model_type!r}; pass --lora-targets")
        config.target_modules = set(defaults[model_type])
    all_linear = isinstance(config.target_modules, str) and config.target_modules.lower() == "all-linear"
    convert_peft_config_for_transformers(config, model=meta_model, conversions=get_model_conversion_mapping(meta_model))
    config = _maybe_include_all_linear_layers(config, meta_model)
    if all_linear:
        _drop_grouped_linears(config, meta_model)
    names = [n for n, _ in meta_model.named_modules()]
    _check_targets(config, names, meta_model)
    _check_rank(config, meta_model)
    return config


def check_lora_config(config) -> None:
    """What can be checked without the model, before anything loads: a ``peft.LoraConfig`` whose rank is a
    positive integer (PEFT itself would refuse 0 only when it builds the adapters, in its own words)."""
    from peft import LoraConfig

    if not isinstance(config, LoraConfig):
        raise LoraError(f"lora= takes a peft.LoraConfig, got {type(config).__name__}")
    r = config.r  # the user's rank (PEFT's rank_pattern may double it on fused gate/up experts)
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise LoraError(f"--lora-rank (LoraConfig.r) must be an integer >= 1, got {r!r}")


def _check_rank(config, meta_model: nn.Module) -> None:
    """A rank the layers can hold: no wider than the widest layer it adapts (a larger one only adds numbers,
    and an absurd one would ask for terabytes in every worker)."""
    r = config.r
    from peft.tuners.tuners_utils import check_target_module_exists

    widths = [max(m.weight.shape[-2:]) for n, m in meta_model.named_modules()
              if config.target_modules and isinstance(getattr(m, "weight", None), torch.Tensor)
              and m.weight.dim() >= 2 and check_target_module_exists(config, n)]
    widths += [max(p.shape[-2:]) for n, p in meta_model.named_parameters()
               if p.dim() >= 2 and any(n == t or n.endswith("." + t) for t in config.target_parameters or ())]
    widest = max(widths, default=None)
    if widest is not None and r > widest:
        raise LoraError(f"--lora-rank {r} is wider than every layer it adapts (the widest is {widest}): "
                        f"pass at most {widest}")


def _check_targets(config, names: list[str], meta_model: nn.Module) -> None:
    from peft.tuners.tuners_utils import check_target_module_exists

    hit = [n for n in names if config.target_modules and check_target_module_exists(config, n)]
    if not hit and not config.target_parameters:
        raise LoraError(f"--lora-targets {_targets(config)} match no module of the "
                        f"{meta_model.config.model_type} model; name linear layers such as q_proj,v_proj")
    _check_each_target(config, names, meta_model)
    tied = bool(getattr(meta_model.config, "tie_word_embeddings", False))
    shared = {"model.embed_tokens", "lm_head"}
    if tied and shared & set(hit):
        raise LoraError("--lora-targets: an adapter on the tied embedding/head is not supported under "
                        "pipelining (the two copies would diverge); target the decoder layers")
    if config.modules_to_save or config.trainable_token_indices:
        raise LoraError("LoraConfig.modules_to_save / trainable_token_indices are not supported; "
                        "train adapters only")
    if config.init_lora_weights not in (True, False, "gaussian"):
        # PiSSA, OLoRA, CorDA, LoftQ and EVA rewrite the base weights or need data at injection:
        # the base would no longer be the checkpoint a LoRA checkpoint points at.
        raise LoraError(f"LoraConfig init_lora_weights={config.init_lora_weights!r} is not supported; "
                        "use True (PEFT's default) or 'gaussian'")
    if config.use_dora:
        raise LoraError("LoraConfig use_dora=True (DoRA) is not supported under pipelining yet; use LoRA")


def _check_each_target(config, names: list[str], meta_model: nn.Module) -> None:
    """Every name in a target list must match a module: a typo would silently drop its adapters."""
    import difflib

    targets = config.target_modules
    if isinstance(targets, str) or not targets:  # a regex or all-linear: matched as a whole above
        return
    leaves = sorted({n.rsplit(".", 1)[-1] for n in names if n})
    for target in sorted(targets):
        if not any(n == target or n.endswith("." + target) for n in names):
            close = difflib.get_close_matches(target, leaves, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise LoraError(f"--lora-targets {target!r} matches no module of the "
                            f"{meta_model.config.model_type} model{hint}; its adapters would be "
                            "silently missing: fix or drop the name")


def _drop_grouped_linears(config, meta_model: nn.Module) -> None:
    """Drop from an all-linear set the linear subclasses that multiply otherwise (DeepSeek-V4's grouped
    ``o_a_proj``, block-diagonal over head groups): PEFT takes them, and its LoRA layer then fails in forward."""
    from hfpipe.models.targets import plain_linear

    linears = {n: plain_linear(m) for n, m in meta_model.named_modules() if isinstance(m, nn.Linear)}

    def plain(target: str) -> bool:  # a full name, or a leaf name (as PEFT's MoE conversion leaves them)
        hits = [p for n, p in linears.items() if n == target or n.endswith("." + target)]
        return not hits or any(hits)

    config.target_modules = {t for t in config.target_modules if plain(t)}


def _targets(config) -> str:
    t = config.target_modules
    return t if isinstance(t, str) else ",".join(sorted(t or ()))


def _has_targets(module: nn.Module, config) -> bool:
    from peft.tuners.tuners_utils import check_target_module_exists

    if config.target_parameters:
        params = {n for n, _ in module.named_parameters()}
        if any(p == t or p.endswith("." + t) for p in params for t in config.target_parameters):
            return True
    return any(check_target_module_exists(config, n) for n, _ in module.named_modules())


def _name_seed(seed: int, name: str) -> int:
    """A seed for one adapter from the run seed and its module name (stable across processes)."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def add_adapters(modules: list[nn.Module], config, *, seed: int = 0, master_dtype: torch.dtype | None = None) -> None:
    """Inject PEFT LoRA adapters into this rank's stage modules and freeze everything else.

    Args:
        modules: This rank's stage modules, loaded (not meta).
        config: A ``LoraConfig`` from :func:`resolve_config`.
        seed: Seeds each adapter's PEFT initialisation together with its module name, so the
            initial adapters are the same at any pipeline size.
        master_dtype: The run's parameter dtype. fp32 (bf16-mixed) over a base held in bf16: the adapters
            are initialised in fp32, as over an fp32 base (PEFT initialises in the base's dtype), so where
            the base is held does not move the start.
    """
    from peft.tuners.lora import LoraModel
    from peft.tuners.tuners_utils import BaseTunerLayer, cast_adapter_dtype

    for module in modules:
        for p in module.parameters():
            p.requires_grad_(False)
        if not _has_targets(module, config):
            continue  # e.g. a stage holding only the head: nothing to adapt here
        with torch.random.fork_rng(devices=[]):  # injection draws random numbers; keep the run's RNG
            LoraModel(module, copy.deepcopy(config), ADAPTER)
            if master_dtype == torch.float32:
                cast_adapter_dtype(module, ADAPTER, autocast_adapter_dtype=True)
            for name, layer in module.named_modules():
                if isinstance(layer, BaseTunerLayer) and ADAPTER in layer.lora_A:
                    _whole_size(layer)
                    torch.manual_seed(_name_seed(seed, name))
                    layer.reset_lora_parameters(ADAPTER, config.init_lora_weights)
        cast_adapter_dtype(module, ADAPTER, autocast_adapter_dtype=True)  # fp32 adapters on a bf16 base
        del module.peft_config  # set by LoraModel; the PipelineModel keeps the config


def _whole_size(layer: nn.Module) -> None:
    """Give a linear's adapters the whole layer's shapes where PEFT sized them by a tp-split base.

    PEFT sizes the adapters of a linear whose weight is a tensor-parallel DTensor by its local shard
    (``peft.tuners.tuners_utils._get_in_out_features``) and initialises each rank's on its own. hfpipe
    initialises the whole adapters, as one process does, and splits them afterwards
    (:mod:`hfpipe.lora.tensor`), so the start does not depend on --tp.
    """
    base = layer.get_base_layer()
    if not isinstance(base, nn.Linear) or (layer.in_features, layer.out_features) == (base.in_features,
                                                                                       base.out_features):
        return
    a, b = layer.lora_A[ADAPTER], layer.lora_B[ADAPTER]
    like = dict(device=a.weight.device, dtype=a.weight.dtype)
    layer.lora_A[ADAPTER] = nn.Linear(base.in_features, a.out_features, bias=False, **like)
    layer.lora_B[ADAPTER] = nn.Linear(b.in_features, base.out_features, bias=b.bias is not None, **like)
    layer.in_features, layer.out_features = base.in_features, base.out_features


def adapter_view(modules: list[nn.Module]) -> nn.Module:
    """One module holding only this rank's adapters, under their full-model names (for DCP).

    DCP reshards by name, so a checkpoint of it loads at any pipeline size; frozen base weights
    are not in it (they are re-read from the base model on resume).
    """
    view = nn.Module()
    for module in modules:
        for name, p in module.named_parameters():
            if not p.requires_grad:
                continue
            owner_path, _, _ = name.rpartition(".")
            _attach(view, owner_path, module.get_submodule(owner_path))
    trainable = {id(p) for m in modules for p in m.parameters() if p.requires_grad}
    if {id(p) for p in view.parameters()} != trainable:
        raise LoraError("an adapter module also holds frozen parameters; this LoraConfig is not supported")
    return view


def _attach(root: nn.Module, path: str, leaf: nn.Module) -> None:
    *parents, last = path.split(".")
    node = root
    for part in parents:
        if not hasattr(node, part) or getattr(node, part) is None:
            node.add_module(part, nn.Module())
        node = getattr(node, part)
    node.add_module(last, leaf)


def peft_key(name: str) -> str:
    """The key PEFT saves a stage's adapter parameter ``name`` under (``adapter_model.safetensors``)."""
    from peft.tuners.lora import LoraModel

    return LoraModel._remove_adapter_name_from_key(PEFT_PREFIX + name, ADAPTER)


def config_to_dict(config) -> dict:
    """JSON-ready fields of a ``LoraConfig`` (sets become sorted lists), as PEFT saves them."""
    d = config.to_dict()
    return {k: sorted(v) if isinstance(v, set) else v for k, v in d.items()}


def config_from_dict(d: dict):
    """The ``LoraConfig`` saved by :func:`config_to_dict` (in ``hfpipe.json``)."""
    from peft import LoraConfig

    return LoraConfig.from_peft_type(**d)


def from_finetune_config(cfg):
    """The ``LoraConfig`` of a :class:`~hfpipe.config.run.FinetuneConfig`'s ``lora_*`` fields, or ``None``."""
    if cfg.lora_rank is None:
        return None
    return lora_config(cfg.lora_rank, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout, targets=cfg.lora_targets)
