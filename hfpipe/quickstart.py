"""The offline quickstart: build a small Llama, fine-tune it at pp=2, export, verify, generate.

Everything runs on this machine with no hub access: the model is built here, its tokenizer is
trained here on the chat set shipped with hfpipe (so words are tokens and a small model learns to
answer in about a hundred steps), and each step goes through the same code as a real run. Every
stretch that prints nothing on its own (worker start-up and shutdown, verification) gets a line
every few seconds, and a second run in the same folder says what it reuses and starts the run afresh.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

__all__ = ["PROMPTS", "quickstart"]

log = logging.getLogger(__name__)

#: What the model is asked before and after fine-tuning (both are in the shipped chat set).
PROMPTS = ("What colour is the sky on a clear day?", "How does a cat sound?")
_MODEL = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, vocab_size=1024)


def quickstart(out: str | Path = "hfpipe-quickstart", *, steps: int = 120, pp: int = 2,
               echo=print, lora: bool = False) -> dict:
    """Run the quickstart into ``out``; return what it measured.

    Args:
        out: Working folder (created; ``base/``, ``run/`` and ``run/hf`` go inside). A model in
            ``base/`` from an earlier run is reused; an earlier ``run/`` is replaced.
        steps: Optimizer steps of the fine-tune.
        pp: Pipeline ranks.
        echo: Where the human-readable lines go.
        lora: Train rank-16 LoRA adapters (``run-lora/``; the export is a PEFT adapter folder,
            verified against ``PeftModel``) instead of every weight.
    """
    from hfpipe.config.options import OptionError, require_positive

    out = Path(out)
    require_positive(steps=steps, pp=pp)
    if out.exists() and not out.is_dir():
        raise OptionError(f"--out {out} is a file; choose a folder")
    if pp > _MODEL["num_hidden_layers"]:  # one stage per layer at most
        raise OptionError(f"--pp {pp} is more than the quickstart model's {_MODEL['num_hidden_layers']} "
                          f"layers; use --pp 1 to {_MODEL['num_hidden_layers']}")
    _cpu_if_too_few_gpus(pp, echo)
    base, run = out / "base", out / ("run-lora" if lora else "run")
    echo(f"1/4 a small Llama with a tokenizer trained on the shipped chat set, in {base}")
    if (base / "config.json").is_file():
        echo("    reusing the model built by an earlier quickstart (delete the folder to rebuild)")
    else:
        with _ticker(echo, lambda: "building"):
            _build_base(base)
    with _ticker(echo, lambda: "generating"):
        before = _answers(base)
    for prompt, answer in zip(PROMPTS, before):
        echo(f"    prompt: {prompt!r}\n    before fine-tuning: {answer!r}")
    _clear_previous_run(run, echo)
    what = "LoRA rank 16 adapters on the frozen base" if lora else "every weight"
    echo(f"2/4 fine-tuning {steps} steps at pp={pp}, {what} ({pp} worker processes; the loss and a "
         "progress bar follow once they have loaded)")
    first, last = _finetune(base, run, steps, pp, echo, lora)
    echo(f"    loss {first:.3f} -> {last:.3f}")
    hf = run / "hf"
    echo(f"3/4 exported to {hf}" + (" (a PEFT adapter folder)" if lora else ""))
    oracle = "PEFT" if lora else "transformers"
    echo(f"4/4 checking the export: {oracle} in this process vs the pipeline in {pp} processes")
    with _ticker(echo, lambda: "verifying"):
        result = _verify(hf, pp)
    echo(f"    max abs diff of the logits {result['max_abs_diff']:.2e} "
         f"({'PASS' if result['passed'] else 'FAIL'})")
    with _ticker(echo, lambda: "generating"):
        after = _answers(hf)
    for prompt, answer in zip(PROMPTS, after):
        echo(f"    prompt: {prompt!r}\n    after fine-tuning:  {answer!r}")
    echo(f"next: hfpipe chat {hf}")
    return {"first_loss": first, "last_loss": last, "before": before, "after": after, **result}


def _build_base(base: Path) -> None:
    from hfpipe.progress.logs import quiet_transformers
    from hfpipe.tiny import make_tiny_checkpoint, make_tiny_tokenizer

    with quiet_transformers():  # transformers' writing bars would break the quickstart's own lines
        make_tiny_checkpoint(base, "llama", max_shard_size="200KB", tokenizer=False, **_MODEL)
        make_tiny_tokenizer(_MODEL["vocab_size"], _chat_corpus()).save_pretrained(base)


def _chat_corpus() -> list[str]:
    """Every message of the shipped chat set: what the quickstart tokenizer is trained on."""
    path = Path(__file__).parent / "assets" / "data" / "tiny_chat.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [m["content"] for row in rows for m in row["messages"]]


def _clear_previous_run(run: Path, echo) -> None:
    """Start the run afresh: a resumed finished run would train 0 steps and report no loss."""
    if not run.exists():
        return
    if not ((run / "checkpoints").is_dir() or (run / "metrics.jsonl").is_file()):
        from hfpipe.config.names import ConfigError

        raise ConfigError(f"{run} exists and is not a quickstart run; choose another --out")
    shutil.rmtree(run)
    echo(f"    removed the previous quickstart run in {run}: this one starts afresh")


def _finetune(base: Path, run: Path, steps: int, pp: int, echo, lora: bool) -> tuple[float, float]:
    from hfpipe.config.run import FinetuneConfig
    from hfpipe.train.runner import run_finetune

    # LoRA trains far fewer weights: a higher learning rate reaches the same answers in as many steps.
    extra = dict(lora_rank=16, lora_alpha=32, lr=1e-2) if lora else dict(lr=3e-3)
    cfg = FinetuneConfig(model=str(base), output_dir=str(run), pp=pp, schedule="1f1b",
                         dataset="builtin:tiny-chat", seq_len=128, batch_size=8, microbatches=4,
                         max_steps=steps, warmup_steps=5, weight_decay=0.0,
                         save_hf_at_end=True, **extra)
    def status() -> str | None:  # the start is the run's own to tell (hfpipe.train.runner)
        return "stopping workers" if (run / "hf" / "config.json").is_file() else None

    with _ticker(echo, status):
        summary = run_finetune(cfg)
    losses = [row["loss"] for row in summary.get("history", []) if "loss" in row]
    if not losses:
        raise RuntimeError(f"the fine-tune in {run} reported no loss; see the log above")
    return losses[0], losses[-1]


def _verify(hf: Path, pp: int) -> dict:
    from hfpipe.verify import verify

    # The quickstart's own "verifying..." line ticks; verify's logged ticker would say it again in
    # another format (seen on an H200).
    ticks = logging.getLogger("hfpipe.progress.ticker")
    level = ticks.level
    ticks.setLevel(logging.WARNING)
    try:
        r = verify(str(hf), pp=pp)
    finally:
        ticks.setLevel(level)
    return {"max_abs_diff": r.max_abs_diff, "passed": r.passed}


def _answers(folder: Path, max_new_tokens: int = 24) -> list[str]:
    """Greedy answers to :data:`PROMPTS` from the model in ``folder`` (hfpipe generate's code)."""
    from hfpipe.generate import load_generator

    gen = load_generator(folder)
    return [gen.generate(gen.encode(p), max_new_tokens=max_new_tokens).strip() for p in PROMPTS]


def _ticker(echo, what):
    """The shared ticker (:class:`hfpipe.progress.ticker.Ticker`), its lines indented under a step's."""
    from hfpipe.progress.ticker import Ticker

    return Ticker(what, echo=lambda text: echo(f"    {text}"), first=False)  # its step line said what


def _cpu_if_too_few_gpus(pp: int, echo) -> None:
    """The demo runs anywhere: on a machine with fewer GPUs than --pp (NCCL puts one rank on each GPU),
    its ranks run as CPU processes instead, which the tiny model allows, and it says so."""
    from hfpipe.parallel.mesh import visible_gpus

    gpus = visible_gpus()
    if 0 < gpus < pp:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # inherited by the workers the launcher starts
        echo(f"    {gpus} GPU(s) here for {pp} ranks (one rank per GPU): the quickstart runs on CPU processes")
