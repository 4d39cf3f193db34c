"""The two files of a model folder that transformers itself reads: config.json and the tokenizer.

Both are read with remote code refused unless asked for, and every failure becomes one
:class:`SourceError` line naming the file. A floor module: the checkpoint export reads a source's
config here without the rest of :mod:`hfpipe.source.folder`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from hfpipe.errors import HfpipeError
from hfpipe.files import SideFileError, check_folder, read_side_json

__all__ = ["SourceError", "check_config_values", "check_vocab", "load_config", "load_tokenizer", "read_config_json"]


class SourceError(HfpipeError):
    """The model folder or hub id cannot be used (one line: what is wrong and what to do)."""


def load_config(folder: Path, *, trust_remote_code: bool = False):
    """The transformers config of ``folder``, refusing remote code unless asked for, with the
    sizes a model is built from checked (:func:`check_config_values`)."""
    from transformers import AutoConfig

    cfg_path = folder / "config.json"
    if folder.is_dir():
        check_folder(folder)  # transformers reads the folder's files: none may block it (a FIFO)
    if not cfg_path.is_file():
        raise SourceError(f"{folder}: no config.json; point at a Hugging Face model folder")
    raw = read_config_json(cfg_path)
    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except KeyError as e:
        raise SourceError(f"{cfg_path}: unknown model_type {e}; is transformers up to date?") from None
    except Exception as e:  # noqa: BLE001 - transformers' field validators raise many types
        if "trust_remote_code" in str(e) or (raw.get("auto_map") and not trust_remote_code):
            raise SourceError(
                f"{cfg_path}: model type {raw.get('model_type')!r} needs remote code; "
                "pass --trust-remote-code if you trust it"
            ) from None
        raise SourceError(f"{cfg_path}: {_one_line(e)}; fix the field or re-download config.json") from None
    check_config_values(cfg_path, config)
    return config


def read_config_json(cfg_path: Path) -> dict:
    """A model folder's ``config.json`` as a dict, with the fields hfpipe itself reads checked.

    Read through :func:`hfpipe.files.read_side_json` (size-capped; a hub-cache link is followed).
    """
    try:
        raw = read_side_json(cfg_path, follow=True)
    except SideFileError as e:
        raise SourceError(f"{e}; fix or re-download config.json") from None
    if not isinstance(raw, dict):
        raise SourceError(f"{cfg_path}: must hold a JSON object {{...}}, got a {type(raw).__name__}")
    for part in (raw, raw.get("text_config")):
        if isinstance(part, dict):
            _check_raw_fields(cfg_path, part)
    return raw


def _check_raw_fields(cfg_path: Path, raw: dict) -> None:
    """The fields hfpipe reads itself, before transformers (which lets these through to a crash or NaN)."""
    quant = raw.get("quantization_config")
    if quant is not None and not isinstance(quant, dict):
        raise SourceError(f"{cfg_path}: quantization_config must be an object {{\"quant_method\": ...}}, got a "
                          f"{type(quant).__name__}; fix it or re-download config.json")
    block = (quant or {}).get("weight_block_size")
    if (quant or {}).get("quant_method") == "fp8" and block is not None and not (
            isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block)):
        raise SourceError(f"{cfg_path}: quantization_config.weight_block_size must be two positive integers "
                          f"[rows, cols] (the FP8 scales' tile), got {block!r}; fix it or re-download config.json")
    coef = raw.get("router_aux_loss_coef")
    if coef is not None and (isinstance(coef, bool) or not isinstance(coef, (int, float))
                             or not math.isfinite(coef) or coef < 0):
        raise SourceError(f"{cfg_path}: router_aux_loss_coef must be a finite number >= 0 (the weight of the MoE "
                          f"load-balancing loss), got {coef!r}; fix it in config.json")


#: More layers than any model has (the largest have ~130): planning more would take minutes.
MAX_LAYERS = 4096
_POSITIVE = ("num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads",
             "intermediate_size", "max_position_embeddings", "head_dim")


def check_config_values(cfg_path: Path, config) -> None:
    """Refuse the sizes a model cannot be built from, naming the field (of the config's text part).

    transformers checks types and some ratios itself (its errors arrive here as one line too);
    a 0 or negative size, or 100,000 layers, it lets through to a crash or an endless plan.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in _POSITIVE:
        value = getattr(text, name, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise SourceError(f"{cfg_path}: {name} must be a positive integer, got {value!r}")
    layers = getattr(text, "num_hidden_layers", None)
    if layers is not None and layers > MAX_LAYERS:
        raise SourceError(f"{cfg_path}: num_hidden_layers {layers} is beyond what hfpipe plans "
                          f"(at most {MAX_LAYERS}); check the config")
    heads, kv = getattr(text, "num_attention_heads", None), getattr(text, "num_key_value_heads", None)
    if heads and kv and heads % kv:
        raise SourceError(f"{cfg_path}: num_attention_heads {heads} is not a multiple of "
                          f"num_key_value_heads {kv}")


def _one_line(e: BaseException) -> str:
    """The error's text on one line (transformers' validators put the detail on the second)."""
    return " ".join(str(e).split())[:300] or type(e).__name__


def load_tokenizer(folder: str | Path, *, trust_remote_code: bool = False):
    """The tokenizer saved with ``folder`` (training and generation both read it here)."""
    from transformers import AutoTokenizer

    if Path(folder).is_dir():
        check_folder(folder)
    try:
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:  # no files, a broken file (a
        # tokenizer.json without 'added_tokens' is a KeyError), or remote code refused
        if "trust_remote_code" in str(e):
            raise SourceError(f"{folder}: the tokenizer needs remote code; pass --trust-remote-code "
                              "if you trust it") from None
        why = (str(e).splitlines() or [""])[0][:200]
        where = _broken_json(Path(folder)) or folder
        raise SourceError(f"{where}: no usable tokenizer ({type(e).__name__}: {why}); add the base model's "
                          "tokenizer files (tokenizer.json, tokenizer_config.json)") from None


def check_vocab(tokenizer, config, folder) -> None:
    """Token ids beyond the embedding would index past it (a crash, or garbage on GPU)."""
    vocab = getattr(config, "vocab_size", None)
    if vocab is not None and len(tokenizer) > vocab:
        raise SourceError(f"{folder}: the tokenizer has {len(tokenizer)} tokens but config.json's "
                          f"vocab_size is {vocab}; use the model's own tokenizer (or resize the embeddings)")


def _broken_json(folder: Path) -> Path | None:
    """The tokenizer file of ``folder`` that is not valid JSON, if one is (to name it)."""
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        path = folder / name
        try:
            json.loads(path.read_bytes())
        except FileNotFoundError:
            continue
        except (OSError, ValueError):
            return path
    return None


def meta_model(src: Path):
    """The full model of folder ``src`` on the meta device (names, shapes, conversion tables; no memory).

    For exports and merges: remote code is never run, and a quantized source is described as the
    plain model its dequantised weights fill.
    """
    import torch
    from transformers import AutoModelForCausalLM

    cfg = load_config(src, trust_remote_code=False)  # export never runs a source's code, never asks
    if getattr(cfg, "quantization_config", None) is not None:
        del cfg.quantization_config  # we export dequantised weights into a plain model
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg, trust_remote_code=False)


def bundled_ids() -> list[str]:
    """The model ids whose config.json ships with hfpipe (``hfpipe plan`` knows them offline)."""
    folder = Path(__file__).resolve().parent.parent / "assets" / "configs"
    return sorted(p.name.replace("--", "/", 1) for p in folder.iterdir() if (p / "config.json").is_file())


def bundled_config_dir(model_id: str) -> Path | None:
    """The bundled folder holding `model_id`'s real config.json, or None if none is bundled.

    ``meta-llama/Llama-3.1-8B`` maps to ``hfpipe/assets/configs/meta-llama--Llama-3.1-8B``.
    """
    folder = Path(__file__).resolve().parent.parent / "assets" / "configs"
    folder = folder / model_id.strip("/").replace("/", "--")
    return folder if (folder / "config.json").is_file() else None
