"""Proof at load: a family outside the test table runs only if its stages reproduce HF exactly.

For such a ``model_type`` hfpipe builds a tiny random replica of the user's config (the same layer
types and per-layer patterns, few layers, small sizes), runs it once as HF does and once stage by
stage (embedding, one stage per layer, norm + head), and compares each part within 1e-5 on CPU:
a padded batch and a packed one. Equal: one log line, and the verdict is cached per config under
``~/.cache/hfpipe/proofs``. Different: the model is refused naming the first part that differs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch

from hfpipe.models.adapter import Adapter, UnsupportedModelError

__all__ = ["TOL", "prove", "replica_config", "compare_staged", "missing_skeleton"]

log = logging.getLogger(__name__)

TOL = 1e-5
_SIZES = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              vocab_size=384, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
              num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=32,
              qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, max_position_embeddings=256, use_cache=False)
_PROOF_VERSION = 1


def replica_config(config):
    """A small copy of ``config``: same types and patterns, the first layers that show them all."""
    d = config.to_dict()
    n = int(d["num_hidden_layers"])
    # Keep layers up to one past the first occurrence of every value of every per-layer list
    # (layer types, rope/no-rope, dense/MoE), so that each kind of layer runs after another.
    per_layer = [v for v in d.values() if isinstance(v, list) and len(v) == n]
    firsts = [_first_indices(v) for v in per_layer]
    firsts = [i for f in firsts for i in f]
    k = min(n, max([3, int(d.get("first_k_dense_replace") or 0) + 2] + [i + 2 for i in firsts]))
    for key, value in list(d.items()):
        if isinstance(value, list) and len(value) == n:  # per-layer lists follow the layer count
            d[key] = value[:k]
    d.update({key: v for key, v in _SIZES.items() if key in d}, num_hidden_layers=k)
    d.pop("quantization_config", None)
    return type(config).from_dict(d)


def _first_indices(values: list) -> list[int]:
    """Index of the first occurrence of each distinct value (by its text: values may be lists)."""
    seen: dict[str, int] = {}
    for i, v in enumerate(values):
        seen.setdefault(str(v), i)
    return list(seen.values())


def _batches(vocab: int) -> dict[str, dict]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    mask[1, -3:] = 0
    pos = torch.cat([torch.arange(5), torch.arange(7)]).expand(2, -1)
    return {"padded": {"input_ids": ids, "attention_mask": mask}, "packed": {"input_ids": ids, "position_ids": pos}}


def _random_model(config):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=False).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # norms and biases away from their 1/0 init, so that every tensor counts
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model


def _capture(model, batch):
    """HF logits plus each decoder layer's input hidden states and output."""
    inputs, outputs, hooks = {}, {}, []

    def keep_input(i):
        def hook(module, args, kwargs):
            inputs[i] = (args[0] if args else kwargs["hidden_states"]).clone()
        return hook

    def keep_output(i):
        def hook(module, args, out):
            outputs[i] = (out[0] if isinstance(out, tuple) else out).clone()
        return hook

    for i, layer in enumerate(model.model.layers):
        hooks.append(layer.register_forward_pre_hook(keep_input(i), with_kwargs=True))
        hooks.append(layer.register_forward_hook(keep_output(i)))
    try:
        logits = model(**batch, use_cache=False).logits
    finally:
        for h in hooks:
            h.remove()
    return logits, inputs, outputs


def compare_staged(model, adapter: Adapter | None = None) -> tuple[str, float] | None:
    """Run ``model`` as HF and stage by stage; ``(part, max diff)`` of the first part that differs."""
    from hfpipe.models.spec import StageSpec
    from hfpipe.models.stage import PipelineStageModule

    n = len(model.model.layers)
    specs = [StageSpec(0, (), True, False)] + [StageSpec(i + 1, (i,), False, False) for i in range(n)]
    specs.append(StageSpec(n + 1, (), False, True))
    head_weight = model.lm_head.weight
    stages = [PipelineStageModule(s, model.config, model, adapter=adapter) for s in specs]
    stages[-1].lm_head.weight = head_weight  # the stage unties a tied head: keep the model's own
    with torch.no_grad():
        for name, batch in _batches(model.config.vocab_size).items():
            logits, inputs, outputs = _capture(model, batch)
            kwargs = {k: v for k, v in batch.items() if k != "input_ids" or k in stages[0].adapter.layer_inputs}
            h = stages[0](batch["input_ids"], **kwargs)
            parts = [("embedding", h, inputs[0])]
            for i in range(n):
                h = stages[i + 1](h, **kwargs)
                parts.append((f"layer {i}", h, outputs[i]))
            parts.append(("norm/head", stages[-1](h, **kwargs), logits))
            for part, mine, ref in parts:
                diff = (mine - ref).abs().max().item() if mine.shape == ref.shape else float("inf")
                if not diff <= TOL:
                    return f"{part} ({name} batch)", diff
    return None


def _cache_file(config) -> Path:
    import transformers

    text = json.dumps({"v": _PROOF_VERSION, "transformers": transformers.__version__,
                       "config": config.to_dict()}, sort_keys=True, default=str)
    root = Path(os.environ.get("HFPIPE_CACHE", Path.home() / ".cache" / "hfpipe"))
    return root / "proofs" / f"{config.model_type}-{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"


_SKELETON = ("model.embed_tokens", "model.layers", "model.norm", "lm_head")


def missing_skeleton(config) -> list[str]:
    """The parts of the embed -> layers -> norm -> head skeleton the HF model lacks (meta build)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    return [p for p in _SKELETON if _lacks(model, p)]


def _lacks(model, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:
        return True
    return False


def prove(config, adapter: Adapter) -> None:
    """Accept ``config``'s structure (cached) or raise :class:`UnsupportedModelError` naming the part."""
    cache = _cache_file(config)
    if cache.is_file():
        verdict = json.loads(cache.read_text())
    else:
        try:
            result = compare_staged(_random_model(replica_config(config)), adapter)
        except Exception as e:  # a stage cannot call the family's layers as the skeleton does
            result = (f"the stage forward ({type(e).__name__}: {str(e).splitlines()[0][:120]})", float("inf"))
        verdict = {"ok": result is None, "part": result and result[0], "diff": result and result[1]}
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")  # ranks may prove the same config at once
        tmp.write_text(json.dumps(verdict))
        os.replace(tmp, cache)
    if not verdict["ok"]:
        raise UnsupportedModelError(
            f"architecture {config.model_type!r} is not in hfpipe's tested table and its stage-by-stage "
            f"forward differs from transformers' at {verdict['part']} (max diff {verdict['diff']:.3g}); "
            "it is refused rather than approximated")
    log.info("%s: not in the tested table; stage-by-stage forward proven equal to transformers "
             "on a tiny replica (cached in %s)", config.model_type, cache)
