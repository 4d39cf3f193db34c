"""Talk to a model after training: one answer (``hfpipe generate``) or a conversation (``hfpipe chat``).

One process, transformers' own ``generate`` (so the output is exactly what a transformers script
gives), from a Hugging Face folder or hub id, or straight from a training checkpoint: a step folder
or a run folder (its newest checkpoint), read tensor by tensor through the DCP reader the exporter
uses, into the model built from the source folder recorded in the checkpoint's ``hfpipe.json``.
Nothing is written to disk.
"""

from __future__ import annotations

import copy
import math
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from hfpipe.errors import HfpipeError
from hfpipe.progress.logs import quiet_transformers

__all__ = ["GenerateError", "Generator", "load_generator"]

log = logging.getLogger(__name__)

_DTYPES = {"auto": "auto", "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class GenerateError(HfpipeError):
    """The model or the request cannot be used (one line: what and the fix)."""


def load_generator(model: str | Path, *, dtype: str = "auto", source: str | Path | None = None,
                   trust_remote_code: bool = False) -> Generator:
    """Load a model and its tokenizer for generation.

    Args:
        model: Hugging Face folder or hub id; or a training checkpoint: a step folder, or a run
            folder (its newest checkpoint).
        dtype: ``auto`` (as stored: the checkpoint's training dtype, the folder's ``dtype``) or
            ``fp32``/``bf16``/``fp16``.
        source: For a checkpoint: the HF folder the run started from, if it moved since training.
        trust_remote_code: Allow code from the model repository.

    Raises:
        GenerateError, CheckpointError, ExportError, SourceError: the message names the fix.
    """
    from hfpipe.checkpoint.find import find_checkpoint, is_checkpoint_like
    from hfpipe.source.folder import load_tokenizer
    from hfpipe.progress.ticker import Ticker

    if dtype not in _DTYPES:
        raise GenerateError(f"--dtype must be one of {', '.join(_DTYPES)}; got {dtype!r}")
    with Ticker(f"loading {model}"):
        if is_checkpoint_like(model):
            ckpt = find_checkpoint(model, "MODEL")
            net, folder = _from_checkpoint(ckpt, source, trust_remote_code)
            if dtype != "auto":
                net = net.to(_DTYPES[dtype])
        else:
            net, folder = _from_folder_or_adapter(str(model), dtype, trust_remote_code)
        return Generator(net.eval(), load_tokenizer(folder, trust_remote_code=trust_remote_code))


def _from_folder_or_adapter(name: str, dtype: str, trust_remote_code: bool):
    """An HF model folder, or a PEFT adapter folder on its base (the export of a LoRA run)."""
    from hfpipe.lora.folder import check_adapter_weights, read_adapter_folder

    adapter = read_adapter_folder(name) if Path(name).expanduser().is_dir() else None
    if adapter is None:
        return _from_folder(name, dtype, trust_remote_code), name
    from peft import PeftModel

    base = adapter[0]
    net = _from_folder(base, dtype, trust_remote_code)
    check_adapter_weights(name, adapter[1], net.config)  # keys and ranks from the headers, before PEFT allocates
    with quiet_transformers():
        net = PeftModel.from_pretrained(net, name)
    has_tokenizer = any((Path(name) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
    return net, name if has_tokenizer else base


def _from_folder(name: str, dtype: str, trust_remote_code: bool):
    from transformers import AutoModelForCausalLM

    from hfpipe.files import check_folder, check_model_name, did_you_mean

    local = Path(name).expanduser()
    check_model_name(name)  # the hub's "couldn't connect" would mislead
    if local.is_dir():
        check_folder(local)
    try:
        with quiet_transformers():  # its loading bar would break the ticker's lines
            return AutoModelForCausalLM.from_pretrained(name, dtype=_DTYPES[dtype],
                                                        trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:  # missing files, unknown repo, remote code refused
        where = "" if local.is_dir() else f" is no folder here{did_you_mean(local)}, and as a hub id"
        raise GenerateError(f"MODEL {name}{where}: {str(e).splitlines()[0]}") from None


def _from_checkpoint(ckpt: Path, source: str | Path | None, trust_remote_code: bool):
    """The full model of a training checkpoint, in memory; and the source folder (tokenizer)."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    from hfpipe.checkpoint.safe_metadata import _DcpReader
    from hfpipe.checkpoint.meta import read_checkpoint_meta
    from hfpipe.source.folder import load_config
    from hfpipe.models.meta import build_meta_model

    meta = read_checkpoint_meta(ckpt)
    if meta.get("lora"):
        raise GenerateError(f"checkpoint {ckpt} holds a LoRA run's adapters only: export it first "
                            f"(hfpipe export {ckpt} OUT) and generate from OUT, the PEFT adapter folder")
    src = Path(source if source is not None else meta["source"]).expanduser()
    if not (src / "config.json").is_file():
        raise GenerateError(f"source folder {src} of checkpoint {ckpt} has no config.json (moved?); "
                            "pass --source <the HF model folder the run started from>")
    config = copy.deepcopy(load_config(src, trust_remote_code=trust_remote_code))
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config  # the checkpoint holds dequantised training weights
    model = build_meta_model(config)
    expected = remove_tied_weights_from_state_dict(dict(model.state_dict()), model)
    reader = _DcpReader(ckpt)
    saved = reader.tensors("model.")
    missing = [k for k in expected if k not in saved]
    if missing:
        raise GenerateError(f"checkpoint {ckpt} lacks model.{missing[0]} ({len(missing)} tensors) of "
                            f"{src}; pass --source <the HF folder the run started from>")
    log.info("loading %d tensors from %s (step %d)", len(expected), ckpt, meta["step"])
    state = {k: reader.read("model." + k) for k in expected}
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    _rebuild_buffers(model)
    return model, src


def _rebuild_buffers(model: torch.nn.Module) -> None:
    """Give the rotary embedding real ``inv_freq`` (non-persistent: not in any checkpoint)."""
    rotary = getattr(model.model, "rotary_emb", None)
    if rotary is not None:
        model.model.rotary_emb = type(rotary)(config=rotary.config)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise GenerateError(f"{type(model).__name__}: {left[0]} has no value after loading the "
                            "checkpoint; export it with hfpipe export and generate from the folder")


class Generator:
    """A loaded model and tokenizer that answer prompts.

    Args:
        model: A transformers causal LM, in eval mode.
        tokenizer: Its tokenizer.
    """

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, prompt: str | list[dict], chat_template: bool = True) -> torch.Tensor:
        """Token ids ``[1, T]`` of a prompt: chat messages (or one user turn) through the chat
        template when there is one and ``chat_template``, else the raw text."""
        if isinstance(prompt, str) and not (chat_template and self.has_chat_template):
            ids = self.tokenizer(prompt, return_tensors="pt")["input_ids"]  # (1, T)
            if ids.shape[-1] == 0:  # no BOS either: nothing to continue (transformers fails on a reshape)
                raise GenerateError("--prompt is empty and this tokenizer adds no BOS token, so there is "
                                    "nothing to continue; give a prompt")
            return ids
        if not self.has_chat_template:
            raise GenerateError("this tokenizer has no chat template; use hfpipe generate "
                                "--no-chat-template, or a model with a chat template")
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        from hfpipe.data.template import render_chat, template_file

        # first as text: a template that fails, leaves jinja's sandbox or drops a turn is one line
        render_chat(self.tokenizer, messages, None, template_file(self.tokenizer), add_generation_prompt=True)
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 return_tensors="pt", return_dict=True)
        return out["input_ids"]

    def generate(self, input_ids: torch.Tensor, *, stream: Callable[[str], None] | None = None,
                 **options) -> str:
        """The completion of ``input_ids`` as text (new tokens only, special tokens skipped);
        ``stream`` receives it piece by piece as it is produced. Options: :meth:`generate_ids`."""
        ids = self.generate_ids(input_ids, stream=stream, **options)
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @torch.no_grad()
    def generate_ids(self, input_ids: torch.Tensor, *, max_new_tokens: int = 128,
                     temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                     stream: Callable[[str], None] | None = None) -> torch.Tensor:
        """The new token ids after ``input_ids`` (``[1, T]``), by transformers' ``generate``.

        Greedy when ``temperature`` is 0, else sampled (seeded by ``seed``).
        """
        check_options(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed)
        self._check_context(input_ids.shape[-1], max_new_tokens)
        torch.manual_seed(seed)
        out = self.model.generate(
            input_ids.to(self.model.device), attention_mask=torch.ones_like(input_ids),
            generation_config=self._config(max_new_tokens, temperature, top_p),
            streamer=_streamer(self.tokenizer, stream) if stream else None)
        return out[0, input_ids.shape[1]:].cpu()

    def _check_context(self, prompt: int, max_new_tokens: int) -> None:
        """The prompt and its answer must fit the model's positions (beyond, the output is noise)."""
        from hfpipe.data.config import context_limit

        limit = context_limit(self.model.config)
        if limit is not None and prompt >= limit:
            raise GenerateError(f"the prompt has {prompt} tokens, the model's context "
                                f"(max_position_embeddings) is {limit}; shorten the prompt")
        if limit is not None and prompt + max_new_tokens > limit:
            raise GenerateError(f"the prompt ({prompt} tokens) and --max-new-tokens {max_new_tokens} exceed "
                                f"the model's context of {limit} tokens; use --max-new-tokens {limit - prompt} "
                                "or less")

    def check_can_chat(self) -> None:
        """Raise :class:`GenerateError` if the tokenizer has no chat template (before any banner or prompt)."""
        if not self.has_chat_template:
            raise GenerateError("this tokenizer has no chat template, so it cannot chat; use "
                                "hfpipe generate --no-chat-template --prompt ...")

    def chat(self, read: Callable[[str], str], write: Callable[[str], None], *, system: str | None = None,
             **options) -> list[dict]:
        """A conversation: user turns from ``read(prompt)`` until it raises EOFError or the user
        types ``/exit``; ``/reset`` forgets the history. Answers stream through ``write``.

        Returns:
            The conversation, as chat messages.
        """
        self.check_can_chat()
        start = [{"role": "system", "content": system}] if system else []
        messages = list(start)
        while True:
            try:
                line = read("you> ").strip()
            except (EOFError, KeyboardInterrupt):
                write("\n")
                return messages
            if line in ("/exit", "/quit"):
                return messages
            if line == "/reset":
                messages = list(start)
                write("(history cleared)\n")
                continue
            if not line:
                continue
            messages.append({"role": "user", "content": line})
            write("model> ")
            answer = self.generate(self.encode(messages), stream=write, **options)
            write("\n")
            messages.append({"role": "assistant", "content": answer})

    def _config(self, max_new_tokens: int, temperature: float, top_p: float):
        """The model's generation config with our choice of decoding on top (greedy by default,
        whatever sampling the folder's generation_config.json asks for)."""
        cfg = copy.deepcopy(self.model.generation_config)
        sample = temperature > 0
        cfg.update(max_new_tokens=max_new_tokens, do_sample=sample, num_beams=1,
                   temperature=temperature if sample else None, top_p=top_p if sample else None,
                   top_k=None, max_length=None)
        if cfg.pad_token_id is None:
            cfg.pad_token_id = self.tokenizer.pad_token_id or self.tokenizer.eos_token_id
        if cfg.eos_token_id is None:
            cfg.eos_token_id = self.tokenizer.eos_token_id
        return cfg


def check_options(*, max_new_tokens: int, temperature: float, top_p: float, seed: int) -> None:
    """Refuse decoding options before any model loads (nan passes every ``<`` test: say it)."""
    if max_new_tokens < 1:
        raise GenerateError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if not math.isfinite(temperature) or temperature < 0:
        raise GenerateError(f"--temperature must be a finite number >= 0, got {temperature}")
    if not math.isfinite(top_p) or not 0 < top_p <= 1:
        raise GenerateError(f"--top-p must be in (0, 1], got {top_p}")
    if not 0 <= seed < 2**63:
        raise GenerateError(f"--seed must be in [0, 2**63), got {seed}")


def _streamer(tokenizer, write: Callable[[str], None]):
    """transformers' TextStreamer (word-safe pieces, prompt skipped), writing through ``write``."""
    from transformers import TextStreamer

    class Streamer(TextStreamer):
        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            if text:
                write(text)

    return Streamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
