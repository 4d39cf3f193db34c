"""The offline quickstart: build a small Llama, fine-tune it at pp=2, export, verify, generate.

Everything runs on this machine with no hub access: the model and tokenizer are built here, the
data is the chat set shipped with hfpipe, and each step goes through the same code as a real run.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

__all__ = ["quickstart"]

log = logging.getLogger(__name__)

PROMPT = [{"role": "user", "content": "What colour is the sky?"}]


def quickstart(out: str | Path = "hfpipe-quickstart", *, steps: int = 60, pp: int = 2,
               echo=print) -> dict:
    """Run the quickstart into ``out``; return what it measured.

    Args:
        out: Working folder (created; ``base/``, ``run/`` and ``run/hf`` go inside).
        steps: Optimizer steps of the fine-tune.
        pp: Pipeline ranks.
        echo: Where the human-readable lines go.
    """
    from hfpipe.config import FinetuneConfig
    from hfpipe.tiny import make_tiny_checkpoint
    from hfpipe.train.runner import finetune

    from hfpipe.options import OptionError, require_positive

    out = Path(out)
    require_positive(steps=steps, pp=pp)
    if out.exists() and not out.is_dir():
        raise OptionError(f"--out {out} is a file; choose a folder")
    if pp > 4:  # the quickstart model has 4 layers: one stage per layer at most
        raise OptionError(f"--pp {pp} is more than the quickstart model's 4 layers; use --pp 1 to 4")
    base = out / "base"
    if not (base / "config.json").is_file():
        make_tiny_checkpoint(base, "llama", hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                             max_shard_size="200KB")
    echo(f"1/4 built a small Llama (random weights) with a tokenizer in {base}")
    echo(f"    before fine-tuning: {_generate(base)!r}")
    cfg = FinetuneConfig(model=str(base), output_dir=str(out / "run"), pp=pp, schedule="1f1b",
                         dataset="builtin:tiny-chat", seq_len=128, batch_size=8, microbatches=4,
                         max_steps=steps, lr=3e-3, warmup_steps=5, weight_decay=0.0,
                         save_hf_at_end=True, resume="auto")
    summary = finetune(cfg)
    hist = summary.get("history", [])
    first, last = (hist[0]["loss"], hist[-1]["loss"]) if hist else (float("nan"), float("nan"))
    echo(f"2/4 fine-tuned {steps} steps at pp={pp}: loss {first:.3f} -> {last:.3f}")
    hf = out / "run" / "hf"
    echo(f"3/4 exported to {hf}")
    result = _verify(hf, pp)
    echo(f"4/4 transformers vs pipeline logits: max abs diff {result['max_abs_diff']:.2e} "
         f"({'PASS' if result['passed'] else 'FAIL'})")
    echo(f"    after fine-tuning:  {_generate(hf)!r}")
    return {"first_loss": first, "last_loss": last, **result}


def _verify(hf: Path, pp: int) -> dict:
    from hfpipe.verify import verify

    r = verify(str(hf), pp=pp)
    return {"max_abs_diff": r.max_abs_diff, "passed": r.passed}


@torch.no_grad()
def _generate(folder: Path, max_new_tokens: int = 16) -> str:
    """A short greedy answer to :data:`PROMPT` from the model in ``folder``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=False).eval()
    ids = tok.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    gen = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    return tok.decode(gen[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
