"""The bad-input matrix, extended: values that overflow in workers, resumes that change the
run, data files broken by line, model folders with wrong-typed fields or dtypes, files that would
block a read forever, and other inputs that used to be accepted silently.

The spec is tests/cli/test_cli_bad_inputs.py's, case for case: exit 2, exactly one ``error: ...`` line on
stderr naming the file or option (the asserted text), no traceback, and nothing written: the tree
under the test's folder and the shared model are the same after as before. Tokens: {tiny}, {ckpt},
{run}, {out}, {file} as there; {m:<damage>} a model copy broken one way; {d:<name>} a data file;
{r:<variant>} a copy of the run whose checkpoint records other settings; {y:<name>} a recipe.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from hfpipe.cli.main import app
from test_cli_bad_inputs import SHARD, ckpt, edit_json, tiny, tree  # noqa: F401 - ckpt, tiny: fixtures
from _trust import error_lines

TOK = "tokenizer.json"


def _rewrite_shard(m: Path, fn) -> None:
    """Rewrite SHARD with ``fn(tensors)`` applied (safetensors' own writer: a valid file)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(m / SHARD)
    fn(tensors)
    save_file(tensors, m / SHARD, metadata={"format": "pt"})


def _first(tensors: dict, ndim: int = 1) -> str:
    return sorted(k for k in tensors if k.endswith(".weight") and tensors[k].ndim == ndim)[0]


def _as_int(t: dict) -> None:
    k = _first(t)
    t[k] = t[k].view(torch.int32)  # same bytes, an integer dtype


def _as_fp8(t: dict) -> None:
    k = _first(t, 2)
    t[k] = t[k].to(torch.float8_e4m3fn)


def _fp8_config(m: Path) -> None:
    edit_json(m / "config.json", lambda c: {**c, "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}})


def _fifo(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path)


def _cfg(**fields):
    return lambda m: edit_json(m / "config.json", lambda c: {**c, **fields})


MODEL_DAMAGE = {
    "config-list": lambda m: (m / "config.json").write_text("[1, 2]"),
    "config-binary": lambda m: (m / "config.json").write_bytes(b"\x89PNG\0\xff\xfe"),
    "layers-str": _cfg(num_hidden_layers="4"),
    "layers-0": _cfg(num_hidden_layers=0),
    "layers-100000": _cfg(num_hidden_layers=100_000),
    "heads-not-dividing": _cfg(num_attention_heads=3),
    "kv-heads-not-dividing": _cfg(num_key_value_heads=3),
    "hidden-negative": _cfg(hidden_size=-64),
    "vocab-0": _cfg(vocab_size=0),
    "rope-list": _cfg(rope_parameters=[1, 2]),
    "tokenizer-garbage": lambda m: (m / TOK).write_text("garbage{"),
    "tokenizer-binary": lambda m: (m / TOK).write_bytes(bytes(range(256))),
    "weight-as-i32": lambda m: _rewrite_shard(m, _as_int),
    "fp8-without-quantization-config": lambda m: _rewrite_shard(m, _as_fp8),
    "fp8-without-scale": lambda m: (_rewrite_shard(m, _as_fp8), _fp8_config(m)),
    "shard-fifo": lambda m: _fifo(m / SHARD),
    "tokenizer-fifo": lambda m: _fifo(m / TOK),
    "config-fifo": lambda m: _fifo(m / "config.json"),
}

DATA = {
    "binary.jsonl": bytes(range(256)) * 4,
    "bad-line.jsonl": b'{"text": "a"}\n{"text": "b"\n',
    "not-object.jsonl": b'{"text": "a"}\n[1, 2]\n',
    "latin1.jsonl": b'{"text": "a"}\n{"text": "caf\xe9 au lait"}\n',
    "doubled-key.jsonl": b'{"text": "a"}\n{"text": "a", "text": "b"}\n',
    "doubled-key.json": b'[{"text": "a"}, {"text": "a", "text": "b"}]',
    "latin1.txt": b"one line\ncaf\xe9\n",
    "nul.txt": b"one line\nbin\0ary\n",
    "latin1.csv": b"text,id\na,1\ncaf\xe9,2\n",
    "cut-utf8.txt": b"one line\ncaf\xc3",
    "garbage.parquet": b"PAR1 this is not a parquet file at all",
    "empty.parquet": b"",
}
DATA_FIFO = ("fifo.jsonl", "folder-with-fifo")

RECIPES = {"doubled-key": "pp: 2\nseq_len: 32\npp: 4", "doubled-nested": "columns: {a: text, a: prompt}"}

# Another run's settings recorded in the checkpoint (its hfpipe.json), for --resume.
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def _lora_run(meta: dict) -> dict:
    return {**meta, "config": {**meta["config"], "lora_rank": 4}}


def _template_run(meta: dict, template: str) -> dict:
    import hashlib

    digest = hashlib.sha256(b"an older template").hexdigest()
    return {**meta, "config": {**meta["config"], "chat_template": template},
            "data": {"chat_template_sha256": digest}}


FT = "finetune {tiny} --pp 2 --seq-len 32 --batch-size 2 --output-dir {out}"
RESUME = "finetune {tiny} --pp 2 --seq-len 32 --batch-size 2 --resume auto --output-dir"

CASES = [
    # values that overflow in a worker (gloo's timeout, numpy's and torch's seeds, int64 tensors)
    *[(f"finetune: {flag} {value}", f"{FT} {flag} {value}", message) for flag, value, message in [
        ("--timeout", "1e15", "--timeout must be at most 31536000 seconds"),
        ("--seed", str(2**64), "--seed must be < 2**32"), ("--seed", str(2**32), "--seed must be < 2**32"),
        ("--max-steps", str(10**23), f"--max-steps {10**23} is too large"),
        ("--warmup-steps", str(2**63), f"--warmup-steps {2**63} is too large"),
        ("--save-every", str(2**70), f"--save-every {2**70} is too large"),
    ]],
    # a resume that changes the data stream, its masks or the adapters (refused like --seq-len)
    *[(f"finetune --resume: {what}", f"{RESUME} {{run}} {flags}", message) for what, flags, message in [
        ("train on prompts", "--train-on-prompt", "--train-on-prompt False -> True"),
        ("another eval fraction", "--eval-fraction 0.1", "--eval-fraction None -> 0.1"),
        ("a chat template", "--chat-template {file}", "--chat-template None -> "),
        ("renamed columns", "--columns messages=conversations", "--columns None -> {'messages': 'conversations'}"),
        ("mapped roles", "--roles bot=assistant", "--roles None -> {'bot': 'assistant'}"),
        ("LoRA now", "--lora-rank 4", "--lora-rank None -> 4"),
    ]],
    *[(f"finetune --resume: LoRA {what}", f"{RESUME} {{r:lora}} --lora-rank 4 {flags}", message)
      for what, flags, message in [
          ("alpha", "--lora-alpha 16", "--lora-alpha None -> 16.0"),
          ("targets", "--lora-targets q_proj,v_proj", "--lora-targets 'all-linear' -> 'q_proj,v_proj'"),
          ("dropout", "--lora-dropout 0.1", "--lora-dropout 0.0 -> 0.1"),
      ]],
    ("finetune --resume: the chat template file changed", f"{RESUME} {{r:template}} --chat-template {{template}}",
     "the file changed since the checkpoint"),
    # data files: one line naming the file (and the line)
    *[(f"finetune: data {name}", f"{FT} --dataset {{d:{name}}}", message) for name, message in [
        ("binary.jsonl", "binary.jsonl line 1: binary data (a NUL byte), not a text file"),
        ("bad-line.jsonl", "bad-line.jsonl line 2: not valid JSON"),
        ("not-object.jsonl", "not-object.jsonl line 2: expected a JSON object"),
        ("latin1.jsonl", "latin1.jsonl line 2: not UTF-8 text (byte 0xe9)"),
        ("doubled-key.jsonl", "doubled-key.jsonl line 2: key 'text' given twice in one record"),
        ("doubled-key.json", "doubled-key.json: key 'text' given twice in one record"),
        ("latin1.txt", "latin1.txt line 2: not UTF-8 text (byte 0xe9)"),
        ("nul.txt", "nul.txt line 2: binary data (a NUL byte)"),
        ("latin1.csv", "latin1.csv line 3: not UTF-8 text (byte 0xe9)"),
        ("cut-utf8.txt", "cut-utf8.txt line 2: not UTF-8 text"),
        ("garbage.parquet", "garbage.parquet could not be loaded (ArrowInvalid: "),
        ("empty.parquet", "empty.parquet could not be loaded"),
        ("fifo.jsonl", "fifo.jsonl: is a FIFO (named pipe), not a regular file"),
        ("folder-with-fifo", "b.jsonl: is a FIFO (named pipe), not a regular file"),
    ]],
    # model folders: a field of the wrong type or value, a broken tokenizer, a wrong dtype, a FIFO
    *[(f"finetune: model {how}", FT.replace("{tiny}", "{m:" + how + "}"), message) for how, message in [
        ("config-list", "config.json: must hold a JSON object {...}, got a list"),
        ("config-binary", "config.json: not valid JSON"),
        ("layers-str", "config.json: Validation error for field 'num_hidden_layers'"),
        ("layers-0", "config.json: num_hidden_layers must be a positive integer, got 0"),
        ("layers-100000", "config.json: num_hidden_layers 100000 is beyond what hfpipe plans"),
        ("heads-not-dividing", "The hidden size (64) is not a multiple of the number of attention heads (3)"),
        ("kv-heads-not-dividing", "config.json: num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
        ("hidden-negative", "config.json: hidden_size must be a positive integer, got -64"),
        ("vocab-0", "config.json: vocab_size must be a positive integer, got 0"),
        ("rope-list", "config.json: Validation error for field 'rope_parameters'"),
        ("tokenizer-garbage", f"{TOK}: no usable tokenizer"), ("tokenizer-binary", f"{TOK}: no usable tokenizer"),
        ("weight-as-i32", "is stored as I32, but it is a float parameter"),
        ("fp8-without-quantization-config", "is FP8 (F8_E4M3) but config.json has no quantization_config"),
        ("fp8-without-scale", "_scale_inv' beside it; without its scale it cannot be dequantised"),
        ("shard-fifo", f"{SHARD}: is a FIFO (named pipe), not a regular file"),
        ("tokenizer-fifo", f"{TOK}: is a FIFO (named pipe), not a regular file"),
        ("config-fifo", "config.json: is a FIFO (named pipe), not a regular file"),
    ]],
    *[(f"{cmd.split()[0]}: model {how}", cmd.replace("{m}", "{m:" + how + "}"), message) for cmd, how, message in [
        ("plan {m} --pp 2", "layers-100000", "num_hidden_layers 100000 is beyond what hfpipe plans"),
        ("plan {m} --pp 2", "config-list", "must hold a JSON object"),
        ("verify {m}", "weight-as-i32", "is stored as I32"), ("verify {m}", "shard-fifo", "is a FIFO"),
        ("verify {m}", "fp8-without-scale", "without its scale"),
        ("generate {m} --prompt hi", "tokenizer-fifo", "is a FIFO"),
        ("generate {m} --prompt hi", "config-fifo", "is a FIFO"),
        ("export {ckpt} {out} --no-progress --source {m}", "config-list", "must hold a JSON object"),
    ]],
    # other inputs that were accepted silently
    ("finetune --recipe: a key given twice", "finetune --recipe {y:doubled-key} --output-dir {out}",
     "key 'pp' given twice (lines 2 and 4)"),
    ("plan --recipe: a key given twice", "plan --recipe {y:doubled-key}", "key 'pp' given twice"),
    ("finetune --recipe: a nested key given twice", "finetune --recipe {y:doubled-nested} --output-dir {out}",
     "key 'a' given twice"),
    ("finetune --recipe: a FIFO", "finetune --recipe {d:fifo.jsonl} --output-dir {out}", "is a FIFO"),
    ("finetune: a LoRA target matching nothing", f"{FT} --lora-rank 4 --lora-targets q_proj,v_prj",
     "--lora-targets 'v_prj' matches no module of the llama model (did you mean v_proj?)"),
    ("finetune: --rdzv-endpoint unresolvable",
     f"{FT} --nnodes 2 --node-rank 1 --rdzv-endpoint no-such-host.invalid:29500", "does not resolve"),
    ("finetune: --rdzv-endpoint without a port", f"{FT} --nnodes 2 --node-rank 1 --rdzv-endpoint head",
     "--rdzv-endpoint 'head' is not HOST:PORT"),
    ("export: --max-shard-size below a byte", "export {ckpt} {out} --max-shard-size 0.5B", "is below one byte"),
    ("export: a .tmp-step folder", "export {tmpstep} {out} --no-progress", "is an unfinished save"),
    ("verify: --seq-len 1", "verify {tiny} --seq-len 1", "--seq-len must be >= 2, got 1"),
    ("generate: --temperature nan", "generate {tiny} --prompt hi --temperature nan",
     "--temperature must be a finite number >= 0, got nan"),
    ("generate: --temperature inf", "generate {tiny} --prompt hi --temperature inf", "--temperature must be a finite"),
    ("generate: --top-p nan", "generate {tiny} --prompt hi --top-p nan", "--top-p must be in (0, 1], got nan"),
    ("generate: --max-new-tokens 0", "generate {tiny} --prompt hi --max-new-tokens 0", "--max-new-tokens must be >= 1"),
    ("chat: --temperature nan", "chat {tiny} --temperature nan", "--temperature must be a finite number"),
]


def _data(folder: Path, name: str) -> Path:
    folder.mkdir(exist_ok=True)
    path = folder / name
    if name == "fifo.jsonl":
        os.mkfifo(path)
    elif name == "folder-with-fifo":
        path.mkdir()
        (path / "a.jsonl").write_text('{"text": "a"}\n')
        os.mkfifo(path / "b.jsonl")
    else:
        path.write_bytes(DATA[name])
    return path


def _run_copy(ckpt: Path, dest: Path, edit) -> Path:
    shutil.copytree(ckpt.parents[1], dest)
    edit_json(dest / "checkpoints" / ckpt.name / "hfpipe.json", edit)
    return dest


def _prepare(line: str, tiny: Path, ckpt: Path, tmp: Path) -> dict[str, str]:
    """The case's inputs, made under ``tmp``: token -> path."""
    (tmp / "a-file").write_text("not a folder")
    template = tmp / "template.jinja"
    template.write_text(TEMPLATE)
    subst = {"{tiny}": str(tiny), "{ckpt}": str(ckpt), "{out}": str(tmp / "out"), "{file}": str(tmp / "a-file"),
             "{template}": str(template)}
    for token in set(line.split()):
        kind, _, name = token[1:-1].partition(":")
        if kind == "m":
            shutil.copytree(tiny, tmp / name)
            MODEL_DAMAGE[name](tmp / name)
            subst[token] = str(tmp / name)
        elif kind == "d":
            subst[token] = str(_data(tmp / "data", name))
        elif kind == "y":
            (tmp / "recipe.yaml").write_text(f"model: {tiny}\n{RECIPES[name]}\n")
            subst[token] = str(tmp / "recipe.yaml")
        elif kind == "r":
            edit = _lora_run if name == "lora" else lambda m: _template_run(m, str(template))
            subst[token] = str(_run_copy(ckpt, tmp / f"run-{name}", edit))
    if "{run}" in line:
        subst["{run}"] = str(shutil.copytree(ckpt.parents[1], tmp / "run"))
    if "{tmpstep}" in line:
        subst["{tmpstep}"] = str(shutil.copytree(ckpt, tmp / "checkpoints" / ".tmp-step-00000002"))
    return subst


@pytest.mark.parametrize("line, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tiny, ckpt, tmp_path, line, message):
    subst = _prepare(line, tiny, ckpt, tmp_path)
    args = []
    for token in line.split():
        for key, value in subst.items():
            token = token.replace(key, value)
        args.append(token)
    before, source_before = tree(tmp_path), tree(tiny)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, (result.exit_code, result.stderr[-2000:])
    lines = error_lines(result.stderr)  # a progress line may come first on a loaded machine
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-2000:]
    assert message.replace("{out}", subst["{out}"]) in lines[0], lines[0]
    assert "Traceback" not in result.stdout + result.stderr
    assert tree(tmp_path) == before and tree(tiny) == source_before  # nothing half-written, inputs untouched


def test_round_two_adds_at_least_60_cases_across_its_classes():
    assert len(CASES) >= 60 and len({c[0] for c in CASES}) == len(CASES)
    assert {"finetune", "finetune --resume", "plan", "verify", "generate", "export", "chat"} <= {
        c[0].split(":")[0] for c in CASES}
