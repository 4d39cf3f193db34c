"""Tiny random checkpoints and a tiny tokenizer, built offline.

Tests, benchmarks and the quickstart need real HF folders (config.json, sharded safetensors with an
index, a tokenizer) without a hub. These builders make them with transformers' own classes and
``save_pretrained``, so every loading path exercised on them is the real one.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from hfpipe.errors import HfpipeError

__all__ = ["TINY_KINDS", "TABLE_KINDS", "tiny_config", "make_tiny_checkpoint", "make_tiny_tokenizer", "make_fp8_checkpoint"]

log = logging.getLogger(__name__)

VOCAB = 384  # 256 byte symbols + merges + specials: small but a real BPE

# One entry per architecture family the test matrix covers.
TINY_KINDS = ("llama", "llama_tied", "deepseek_v2", "deepseek_v3", "qwen3", "mistral", "qwen3_moe")

# Further families of the model test table: model_type -> config overrides beyond the common sizes.
# Each is built with its own transformers config class; small values keep MoE and sliding windows
# active on 16-token batches.
_MOE = dict(num_experts_per_tok=2, output_router_logits=False)
TABLE_KINDS = {
    "qwen2": dict(tie_word_embeddings=False),
    "qwen2_moe": dict(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32, **_MOE),
    "mixtral": dict(num_local_experts=4, sliding_window=None, **_MOE),
    "phi3": dict(tie_word_embeddings=False),
    "olmo": dict(tie_word_embeddings=False),
    "olmo2": dict(tie_word_embeddings=False),
    "olmo3": dict(tie_word_embeddings=False, sliding_window=6),
    "smollm3": dict(tie_word_embeddings=False, no_rope_layer_interval=2),
    "gemma": dict(head_dim=16, tie_word_embeddings=True),
    "gemma2": dict(head_dim=16, sliding_window=6, final_logit_softcapping=3.0, attn_logit_softcapping=5.0),
    "gemma3_text": dict(head_dim=16, sliding_window=6, sliding_window_pattern=2, final_logit_softcapping=3.0,
                        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    "granite": dict(embedding_multiplier=3.0, residual_multiplier=0.5, logits_scaling=4.0, attention_multiplier=0.2,
                    tie_word_embeddings=False),
    "granitemoe": dict(embedding_multiplier=3.0, residual_multiplier=0.5, logits_scaling=4.0, num_local_experts=4,
                       attention_multiplier=0.2, **_MOE),
    "cohere": dict(logit_scale=0.5),
    "cohere2": dict(logit_scale=0.5, sliding_window=6),
    "starcoder2": dict(sliding_window=6, tie_word_embeddings=False),
    "gpt_oss": dict(head_dim=16, num_local_experts=4, sliding_window=6, **_MOE),
    "glm": dict(head_dim=16, tie_word_embeddings=False),
    "glm4": dict(head_dim=16, tie_word_embeddings=False),
    "ernie4_5": dict(head_dim=16, tie_word_embeddings=False),
    "helium": dict(head_dim=16, tie_word_embeddings=False),
    "exaone4": dict(sliding_window=6, sliding_window_pattern=2, tie_word_embeddings=False),
    "arcee": dict(tie_word_embeddings=False),
    "apertus": dict(tie_word_embeddings=False),
    "ministral": dict(head_dim=16, sliding_window=6, tie_word_embeddings=False),
    "seed_oss": dict(head_dim=16, tie_word_embeddings=False, attention_dropout=0.0, residual_dropout=0.0),
    "deepseek_v32": dict(),
    # hyper-connection streams, hash-routed first layer, compressed and sliding attention
    "deepseek_v4": dict(num_key_value_heads=1, head_dim=16, q_lora_rank=32, moe_intermediate_size=32,
                        n_routed_experts=4, n_shared_experts=1, o_groups=2, o_lora_rank=16, index_n_heads=2,
                        index_head_dim=16, index_topk=4, sliding_window=6, hc_mult=2, hc_sinkhorn_iters=3,
                        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
                        num_hash_layers=1, **_MOE),
}

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

_MLA = dict(  # DeepSeek multi-head latent attention, shrunk
    num_key_value_heads=4,
    kv_lora_rank=16,
    q_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
    head_dim=8,
    moe_intermediate_size=32,
    n_shared_experts=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    first_k_dense_replace=2,
)


_DSV3 = dict(
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    num_nextn_predict_layers=1,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
)


def tiny_config(kind: str, **overrides):
    """The transformers config of a tiny model of ``kind`` (one of :data:`TINY_KINDS`)."""
    from transformers import (
        DeepseekV2Config,
        DeepseekV3Config,
        LlamaConfig,
        MistralConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    common = {**_COMMON, **overrides}  # overrides go to the constructor: some fields derive from others
    mla = {**_COMMON, **_MLA, **overrides}
    if kind == "llama":
        cfg = LlamaConfig(**{"tie_word_embeddings": False, **common})
    elif kind == "llama_tied":
        cfg = LlamaConfig(**{**common, "tie_word_embeddings": True})
    elif kind == "deepseek_v2":
        cfg = DeepseekV2Config(**{"topk_method": "greedy", "n_group": 1, "topk_group": 1, **mla})
    elif kind == "deepseek_v3":
        cfg = DeepseekV3Config(**{**_DSV3, **mla})
    elif kind == "qwen3":
        cfg = Qwen3Config(**{"head_dim": 16, "tie_word_embeddings": False, **common})
    elif kind == "mistral":
        cfg = MistralConfig(**{"sliding_window": None, "tie_word_embeddings": False, **common})
    elif kind == "qwen3_moe":
        cfg = Qwen3MoeConfig(**{"head_dim": 16, "moe_intermediate_size": 32, "num_experts": 8,
                                "num_experts_per_tok": 2, **common})
    elif kind == "deepseek_v32":
        from transformers import DeepseekV32Config

        cfg = DeepseekV32Config(**{**_DSV3, **mla, "index_n_heads": 2, "index_head_dim": 16, "index_topk": 4,
                                   **overrides})
    elif kind in TABLE_KINDS:
        from transformers import CONFIG_MAPPING

        cfg = CONFIG_MAPPING[kind](**{**_COMMON, **TABLE_KINDS[kind], **overrides})
    else:
        raise HfpipeError(f"unknown tiny model kind {kind!r}; choose one of {', '.join(TINY_KINDS + tuple(TABLE_KINDS))}")
    return cfg


def make_tiny_checkpoint(
    out_dir: str | Path,
    kind: str = "llama",
    *,
    seed: int = 0,
    max_shard_size: str | int = "150KB",
    dtype: torch.dtype = torch.float32,
    tokenizer: bool = True,
    **overrides,
) -> Path:
    """Save a randomly initialised tiny model (several safetensors shards) and tokenizer.

    Args:
        out_dir: Folder to write; created if missing.
        kind: Architecture, one of :data:`TINY_KINDS`.
        seed: Seed of the random weights.
        max_shard_size: Passed to ``save_pretrained``; the default gives ≥ 4 shards for every kind.
        dtype: Dtype the weights are saved in.
        tokenizer: Also save the tiny tokenizer (with a chat template).
        overrides: Config attributes to set, e.g. ``num_hidden_layers=8``.

    Returns:
        The folder.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config(kind, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, trust_remote_code=False)
    _perturb_zero_inits(model, seed)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model.save_pretrained(out, max_shard_size=max_shard_size)
    if tokenizer:
        make_tiny_tokenizer().save_pretrained(out)
    return out


def _perturb_zero_inits(model: torch.nn.Module, seed: int) -> None:
    """Give zero- or one-initialised tensors (norms, router biases) random values.

    A freshly initialised model has all-ones norms and an all-zero DeepSeek score-correction bias;
    a loader that forgot to load them would still pass. Random values make every tensor count.
    """
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if not tensor.is_floating_point() or "rotary" in name or "inv_freq" in name:
                continue
            if name.endswith("e_score_correction_bias"):
                tensor.copy_(torch.rand(tensor.shape, generator=gen) * 0.1)
            elif tensor.ndim == 1:
                tensor.copy_(1.0 + 0.1 * torch.randn(tensor.shape, generator=gen))


_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Pipeline parallelism splits a model into stages that run on different devices.",
    "Each stage receives hidden states, runs its layers, and sends the result onward.",
    "A user asks a question and the assistant answers it politely and precisely.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Punctuation: , . ; : ! ? ( ) [ ] { }",
    "Hello world! How are you today? I am fine, thank you.",
]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|eos|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tiny_tokenizer(vocab_size: int = VOCAB, corpus: list[str] | None = None):
    """A byte-level BPE tokenizer of ``vocab_size`` tokens with chat special tokens.

    Byte-level, so any text encodes; trained deterministically on ``corpus`` (default a built-in
    one). The quickstart trains it on its chat data, so that words are tokens and a small model
    learns to answer in a few dozen steps.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4 if corpus is None else corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|pad|>",
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        model_max_length=_COMMON["max_position_embeddings"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


FP8_QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8"}


def make_fp8_checkpoint(src_dir: str | Path, out_dir: str | Path, block: int = 128, *,
                        num_shards: int = 4, dtype: torch.dtype | None = torch.bfloat16) -> Path:
    """Write a DeepSeek-V3-style block-FP8 copy of the checkpoint in ``src_dir``.

    Every linear weight inside a decoder layer (2-D ``model.layers.*.weight``, except the MoE
    router ``mlp.gate.weight``) becomes ``float8_e4m3fn`` with a ``<name>_scale_inv`` fp32 tensor
    holding one scale per ``block x block`` tile, so that ``w ≈ fp8.float() * scale`` (tiles at the
    edges may be partial). As DeepSeek-V3 ships, the other tensors are stored in ``dtype`` (``None``
    keeps theirs) except the router's fp32 ``e_score_correction_bias``. config.json gets the FP8
    ``quantization_config``; the other files are copied.

    Args:
        src_dir: A folder from :func:`make_tiny_checkpoint` (any safetensors checkpoint).
        out_dir: Folder to write; created if missing.
        block: Tile edge, DeepSeek-V3's ``weight_block_size`` is 128.
        num_shards: Number of safetensors shards (contiguous runs of sorted keys) plus an index.
        dtype: Dtype of the tensors that are not quantised.

    Returns:
        The folder.
    """
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    src, out = Path(src_dir), Path(out_dir)
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"), dirs_exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(src.glob("*.safetensors")):
        for key, w in load_file(path).items():
            if _is_fp8_linear(key, w):
                tensors[key], tensors[key + "_scale_inv"] = _quantize_blocks(w, block)
            elif dtype is not None and w.is_floating_point() and not key.endswith("e_score_correction_bias"):
                tensors[key] = w.to(dtype)
            else:
                tensors[key] = w
    keys = sorted(tensors)
    size = -(-len(keys) // num_shards)
    weight_map = {}
    for i in range(num_shards):
        name = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        part = keys[i * size:(i + 1) * size]
        save_file({k: tensors[k].contiguous() for k in part}, out / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {**FP8_QUANTIZATION_CONFIG, "weight_block_size": [block, block]}
    if dtype is not None:
        cfg["dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    return out


def _is_fp8_linear(key: str, w: torch.Tensor) -> bool:
    """Whether DeepSeek-V3 stores ``key`` in FP8: decoder-layer linear weights but the router."""
    return key.startswith("model.layers.") and key.endswith(".weight") and w.ndim == 2 \
        and not key.endswith("mlp.gate.weight")


def _quantize_blocks(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-FP8: the e4m3 weight and its fp32 per-tile scale (tile max maps to e4m3's max)."""
    rows, cols = w.shape
    r, c = -(-rows // block), -(-cols // block)
    padded = torch.zeros(r * block, c * block)
    padded[:rows, :cols] = w.float()
    tiles = padded.view(r, block, c, block)  # (r, block, c, block)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
    q = (tiles / scale[:, None, :, None]).view(r * block, c * block)[:rows, :cols]
    return q.to(torch.float8_e4m3fn).contiguous(), scale
