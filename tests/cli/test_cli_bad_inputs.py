"""The bad-input matrix: every command, every way a user (or an attacker) can hand it bad input.

Each case is one command line run in-process through the Typer app. The spec for all of them:
exit code 2, exactly one stderr line ``error: ...`` that names the file or option (the asserted
text), no traceback, and nothing written: the tree under the test's folder is the same after as
before. Inputs are a good tiny model and checkpoint (shared, never modified) and per-case copies
broken in one way each. The 26 cases of tests/cli/test_cli.py run there too; these extend them.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
from pathlib import Path

import pytest
from typer.testing import CliRunner

from _trust import rerecord_metadata, error_lines
from hfpipe.cli.main import app
from hfpipe.tiny import make_tiny_checkpoint
from hfpipe.checkpoint.dcp import record_checksums

INDEX = "model.safetensors.index.json"
SHARD = "model-00002-of-00008.safetensors"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama")


@pytest.fixture(scope="module")
def ckpt(tiny, tmp_path_factory) -> Path:
    """A DCP checkpoint of ``tiny`` as a run writes it (model keys, hfpipe.json with its config)."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    from hfpipe.config.run import FinetuneConfig

    model = AutoModelForCausalLM.from_pretrained(tiny)
    root = tmp_path_factory.mktemp("run") / "out"
    path = root / "checkpoints" / "step-00000002"
    dcp.save({"model." + k: v for k, v in model.state_dict().items()}, checkpoint_id=path, no_dist=True)
    cfg = FinetuneConfig(model=str(tiny), output_dir=str(root), pp=2, seq_len=32, batch_size=2)
    meta = {"format": 1, "step": 2, "source": str(tiny), "source_dtype": "float32", "tied": False,
            "config": cfg.to_dict(), "world": {"pp": 2, "dp": 1},
            "train": {"position": {"step": 2, "epoch": 0, "batch_in_epoch": 2}, "scheduler": {}}}
    (path / "hfpipe.json").write_text(json.dumps(meta))
    record_checksums(path)  # as every checkpoint hfpipe saves
    return path


# --- ways to break a copy -------------------------------------------------------------------------


def edit_json(path: Path, fn) -> None:
    path.write_text(json.dumps(fn(json.loads(path.read_text()))))


def edit_header(path: Path, fn, length: int | None = None) -> None:
    """Rewrite a shard's header through ``fn`` (data bytes kept)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = fn(json.loads(raw[8:8 + n]))
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", length or len(text)) + text + raw[8 + n:])


def tensors(h: dict) -> list[str]:
    return sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])


def _set(h, key_index, **entry):
    k = tensors(h)[key_index]
    h[k] = {**h[k], **entry}
    return h


def _drop_offsets(h):
    del h[tensors(h)[0]]["data_offsets"]
    return h


MODEL_DAMAGE = {
    "no-config": lambda m: (m / "config.json").unlink(),
    "config-not-json": lambda m: (m / "config.json").write_text("{"),
    "gpt2": lambda m: (m / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 4})),
    "auto-map": lambda m: edit_json(m / "config.json", lambda c: {**c, "model_type": "my_llama",
                                                                  "auto_map": {"AutoConfig": "x.Config"}}),
    "missing-shard": lambda m: (m / SHARD).unlink(),
    "truncated-shard": lambda m: os.truncate(m / SHARD, (m / SHARD).stat().st_size // 2),
    "empty-shard": lambda m: (m / SHARD).write_bytes(b""),
    "shard-is-folder": lambda m: ((m / SHARD).unlink(), (m / SHARD).mkdir()),
    "malformed-index": lambda m: (m / INDEX).write_text('{"metadata": {}}'),
    "index-not-json": lambda m: (m / INDEX).write_text("{nope"),
    "index-parent": lambda m: edit_json(m / INDEX, lambda i: _point(i, "../x.safetensors")),
    "index-absolute": lambda m: edit_json(m / INDEX, lambda i: _point(i, "/etc/passwd")),
    "index-subdir-escape": lambda m: edit_json(m / INDEX, lambda i: _point(i, "a/../../x.safetensors")),
    "index-not-safetensors": lambda m: edit_json(m / INDEX, lambda i: _point(i, "config.json")),
    "header-list": lambda m: edit_header(m / SHARD, lambda h: [h]),
    "header-no-offsets": lambda m: edit_header(m / SHARD, _drop_offsets),
    "header-reversed": lambda m: edit_header(m / SHARD, lambda h: _set(h, 0, data_offsets=h[tensors(h)[0]]["data_offsets"][::-1])),
    "header-overlap": lambda m: edit_header(m / SHARD, lambda h: _set(h, 1, data_offsets=[0, h[tensors(h)[1]]["data_offsets"][1] - h[tensors(h)[1]]["data_offsets"][0]])),
    "header-out-of-range": lambda m: edit_header(m / SHARD, lambda h: _set(h, -1, data_offsets=[h[tensors(h)[-1]]["data_offsets"][0], 10**12])),
    "header-shape": lambda m: edit_header(m / SHARD, lambda h: _set(h, 0, shape=[10**6, 10**6])),
    "header-dtype": lambda m: edit_header(m / SHARD, lambda h: _set(h, 0, dtype="Q4_K")),
    "header-length": lambda m: edit_header(m / SHARD, lambda h: h, length=10**13),
    "pickle-only": lambda m: ([p.unlink() for p in m.glob("model*")], (m / "pytorch_model.bin").write_bytes(b"x")),
    "no-tokenizer": lambda m: [(m / n).unlink() for n in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")],
    "small-vocab": lambda m: edit_json(m / "config.json", lambda c: {**c, "vocab_size": 100}),
    "tied": lambda m: edit_json(m / "config.json", lambda c: {**c, "tie_word_embeddings": True}),
    "mismatched-config": lambda m: edit_json(m / "config.json", lambda c: {**c, "intermediate_size": 96}),
}


def _point(index: dict, name: str) -> dict:
    key = sorted(index["weight_map"])[0]
    index["weight_map"][key] = name
    return index


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch /tmp/hfpipe-pwned",))


def _distcp(c: Path) -> Path:
    return sorted(c.glob("*.distcp"))[0]


CKPT_DAMAGE = {
    "no-metadata": lambda c: (c / ".metadata").unlink(),
    "no-meta-json": lambda c: (c / "hfpipe.json").unlink(),
    "meta-not-json": lambda c: (c / "hfpipe.json").write_text("{"),
    "meta-list": lambda c: (c / "hfpipe.json").write_text("[]"),
    "meta-format-2": lambda c: edit_json(c / "hfpipe.json", lambda m: {**m, "format": 2}),
    "meta-step-str": lambda c: edit_json(c / "hfpipe.json", lambda m: {**m, "step": "2"}),
    "crafted-metadata": lambda c: ((c / ".metadata").write_bytes(pickle.dumps(_RunsCode())), rerecord_metadata(c)),
    "metadata-garbage": lambda c: ((c / ".metadata").write_bytes(b"not a pickle"), rerecord_metadata(c)),
    "metadata-escape": lambda c: (_escape_metadata(c), rerecord_metadata(c)),
    "missing-distcp": lambda c: _distcp(c).unlink(),
    "truncated-distcp": lambda c: os.truncate(_distcp(c), 10),
    "tied-mismatch": lambda c: edit_json(c / "hfpipe.json", lambda m: {**m, "tied": True}),
}


def _escape_metadata(c: Path) -> None:
    from hfpipe.checkpoint.safe_metadata import read_metadata

    md = read_metadata(c)
    for info in md.storage_data.values():
        info.relative_path = "../../../etc/passwd"
    (c / ".metadata").write_bytes(pickle.dumps(md))


RECIPES = {"float": "seq_len: 1.5", "word": "pp: two", "negative": "batch_size: -1", "nan": "lr: .nan",
           "inf": "lr: .inf", "one-beta": "betas: [0.9]", "zero": "microbatches: 0", "maybe": "packing: maybe",
           "list": "[1, 2]", "broken": "pp: ["}

# --- the matrix: (id, command line, message) -------------------------------------------------------
# {tiny} good model, {m:<damage>} a broken copy, {ckpt} good checkpoint, {c:<damage>} a broken copy,
# {run} the good checkpoint's run folder (copied), {out} a folder that does not exist, {file} a file.

FT = "finetune {tiny} --pp 2 --seq-len 32 --batch-size 2 --output-dir {out}"
EXPORT_SRC = "export {ckpt} {out} --no-progress --source"

CASES = [
    # finetune: non-finite and out-of-range options (refused before anything starts)
    *[(f"finetune: {flag} {value}", f"{FT} {flag} {value}", f"{flag} must be a finite number")
      for flag, value in [("--lr", "nan"), ("--lr", "inf"), ("--weight-decay", "inf"), ("--eps", "inf"),
                          ("--eps", "nan"), ("--max-grad-norm", "inf"), ("--max-grad-norm", "nan"),
                          ("--min-lr", "nan"), ("--timeout", "inf"), ("--weight-decay", "nan")]],
    ("finetune: --betas nan", f"{FT} --betas 0.9 nan", "--betas must be a finite number"),
    *[(f"finetune: {flag} {value}", f"{FT} {flag} {value}", message) for flag, value, message in [
        ("--lr", "-1", "--lr must be >= 0"), ("--eps", "0", "--eps must be > 0"),
        ("--max-grad-norm", "0", "--max-grad-norm must be > 0"), ("--timeout", "0", "--timeout must be > 0"),
        ("--pp", "0", "--pp must be >= 1"), ("--dp", "0", "--dp must be >= 1"),
        ("--seq-len", "0", "--seq-len must be >= 1"), ("--batch-size", "0", "--batch-size must be >= 1"),
        ("--grad-accum", "0", "--grad-accum must be >= 1"), ("--epochs", "0", "--epochs must be >= 1"),
        ("--keep", "0", "--keep must be >= 1"), ("--log-every", "0", "--log-every must be >= 1"),
        ("--microbatches", "0", "--microbatches must be >= 1"), ("--max-steps", "0", "--max-steps must be >= 1"),
        ("--save-every", "0", "--save-every must be >= 1"), ("--threads-per-rank", "0", "--threads-per-rank must be >= 1"),
        ("--warmup-steps", "-1", "--warmup-steps must be >= 0"), ("--seed", "-1", "--seed must be >= 0"),
        ("--min-lr", "1", "--min-lr (1.0) must be <= --lr"), ("--betas", "1.0 0.9", "--betas must both be in [0, 1)"),
        ("--schedule", "zigzag", "--schedule must be one of"), ("--lr-schedule", "step", "--lr-schedule must be one of"),
        ("--dtype", "int8", "--dtype must be one of"), ("--activation-checkpointing", "some", "--activation-checkpointing must be one of"),
        ("--plan-method", "random", "--plan-method must be one of"), ("--vpp", "3", "--vpp must be 1 for --schedule 1f1b"),
        ("--lr", "fast", "Invalid value for '--lr'"), ("--pp", "1.5", "Invalid value for '--pp'"),
        ("--nnodes", "0", "--nnodes must be >= 1"), ("--nnodes", "3", "--nnodes 3 does not divide"),
        ("--node-rank", "1", "--node-rank 1 is out of range"), ("--node-rank", "-1", "--node-rank -1 is out of range"),
        ("--threads-per-rank", "100000", "--threads-per-rank 100000"),
        ("--nnodes", "2", "--nnodes > 1 needs --rdzv-endpoint"),
    ]],
    ("finetune: --schedule zbv --vpp 3", f"{FT} --schedule zbv --vpp 3", "--vpp must be 2 for --schedule zbv"),
    ("finetune: too few microbatches", "finetune {tiny} --pp 4 --microbatches 2 --batch-size 4 --output-dir {out}",
     "microbatches"),
    ("finetune: pp above the layers", "finetune {tiny} --pp 8 --batch-size 8 --output-dir {out}", "reduce --pp"),
    ("finetune: seq-len above the positions", "finetune {tiny} --pp 2 --seq-len 4096 --batch-size 2 --output-dir {out}",
     "exceeds the model's max_position_embeddings 256"),
    ("finetune: missing dataset file", f"{FT} --dataset {{out}}.jsonl", "--dataset"),
    ("finetune: output folder is a file", "finetune {tiny} --pp 2 --seq-len 32 --batch-size 2 --output-dir {file}",
     "--output-dir"),
    ("finetune: checkpoints without --resume", "finetune {tiny} --pp 2 --seq-len 32 --batch-size 2 --output-dir {run}",
     "already holds checkpoints; pass --resume auto"),
    ("finetune: --resume path missing", f"{FT} --resume {{out}}/checkpoints/step-00000009", "no such checkpoint folder"),
    # finetune: a model folder broken in one way
    *[(f"finetune: model {how}", FT.replace("{tiny}", "{m:" + how + "}"), message) for how, message in [
        ("no-config", "no config.json"), ("config-not-json", "config.json: not valid JSON"),
        ("gpt2", "'gpt2' is not supported: its model has no model.embed_tokens"), ("auto-map", "pass --trust-remote-code"),
        ("missing-shard", f"{SHARD}: shard file is missing"), ("truncated-shard", f"{SHARD}: truncated shard"),
        ("empty-shard", f"{SHARD}: truncated safetensors file"), ("shard-is-folder", f"{SHARD}: is a folder"),
        ("malformed-index", f"{INDEX}: malformed index"), ("index-not-json", f"{INDEX}: malformed index"),
        ("index-parent", "'../x.safetensors', which is not a plain file name inside the model folder"),
        ("index-absolute", "'/etc/passwd', which is not a plain file name"),
        ("index-subdir-escape", "not a plain file name"), ("index-not-safetensors", "not a plain file name"),
        ("header-list", f"{SHARD}: header is a JSON list"), ("header-no-offsets", "data_offsets None is not [begin, end]"),
        ("header-reversed", "are reversed"), ("header-overlap", "overlaps the tensor before it"),
        ("header-out-of-range", "data_offsets span 999999"), ("header-shape", "needs 4000000000000 bytes"),
        ("header-dtype", "unknown dtype 'Q4_K'"), ("header-length", "corrupt safetensors header length 10000000000000"),
        ("pickle-only", "only pickle weights"), ("no-tokenizer", "no usable tokenizer"),
        ("small-vocab", "the tokenizer has 384 tokens but config.json's vocab_size is 100"),
    ]],
    # finetune --resume: a checkpoint of another run, or a damaged one
    *[(f"finetune --resume: {what}", f"finetune {{tiny}} --pp 2 --output-dir {{run}} --resume auto {flags}", message)
      for what, flags, message in [
          ("another seq-len", "--seq-len 16 --batch-size 2", "--seq-len 32 -> 16"),
          ("another batch size", "--seq-len 32 --batch-size 4", "--batch-size 2 -> 4"),
          ("another seed", "--seq-len 32 --batch-size 2 --seed 7", "--seed 0 -> 7"),
          ("another dataset", "--seq-len 32 --batch-size 2 --dataset builtin:tiny-text", "--dataset 'builtin:tiny-chat' -> 'builtin:tiny-text'"),
          ("another grad-accum", "--seq-len 32 --batch-size 2 --grad-accum 2", "--grad-accum 1 -> 2"),
          ("no packing", "--seq-len 32 --batch-size 2 --no-packing", "--packing True -> False"),
      ]],
 ("finetune --resume: another tied-ness", "finetune {m:tied} --pp 2 --seq-len 32 --batch-size 2 --output-dir {run} --resume auto",
     "tie_word_embeddings False -> True"),
    ("finetune --resume: another model", "finetune {m:small-vocab} --pp 2 --seq-len 32 --batch-size 2 --output-dir {run} --resume auto",
     "vocab_size is 100"),
    *[(f"finetune --resume: checkpoint {how}", f"{FT} --resume {{c:{how}}}", message) for how, message in [
        ("no-metadata", "incomplete: .metadata missing"), ("no-meta-json", "incomplete: hfpipe.json missing"),
        ("meta-not-json", "hfpipe.json: not valid JSON"), ("crafted-metadata", "never runs code"),
        ("metadata-garbage", ".metadata cannot be read"), ("metadata-escape", "outside the checkpoint folder"),
        ("missing-distcp", "missing (1 of"),
    ]],
    # recipe values: what YAML can smuggle past the flags' types
    *[(f"finetune --recipe: {RECIPES[key]}", "finetune --recipe {y:" + key + "} --output-dir {out}", message)
      for key, message in [
          ("float", "--seq-len must be an integer, got 1.5"), ("word", "--pp must be an integer"),
          ("negative", "--batch-size must be >= 1"), ("nan", "--lr must be a finite number"),
          ("inf", "--lr must be a finite number"), ("one-beta", "--betas must be a list of 2 numbers"),
          ("zero", "--microbatches must be >= 1"), ("maybe", "--packing must be true or false"),
          ("list", "expected a mapping"), ("broken", "not valid YAML"),
      ]],
    # export
    *[(f"export: checkpoint {how}", "export {c:" + how + "} {out} --no-progress", message) for how, message in [
        ("no-metadata", "incomplete: .metadata missing"), ("no-meta-json", "incomplete: hfpipe.json missing"),
        ("meta-not-json", "hfpipe.json: not valid JSON"), ("meta-list", "must hold a JSON object"),
        ("meta-format-2", "format 2 is not supported"), ("meta-step-str", "field 'step' must be int"),
        ("crafted-metadata", "not a DCP checkpoint's metadata (refusing posix.system)"),
        ("metadata-garbage", "corrupt DCP metadata"), ("metadata-escape", "names data file '../../../etc/passwd'"),
        ("missing-distcp", "is missing or unreadable"), ("truncated-distcp", "is truncated"),
        ("tied-mismatch", "trained with tie_word_embeddings=True but the source"),
    ]],
    *[(f"export: source {how}", EXPORT_SRC + " {m:" + how + "}", message) for how, message in [
        ("no-config", "has no config.json"), ("auto-map", "needs remote code; pass --trust-remote-code"),
        ("index-parent", "not a plain file name"), ("index-absolute", "not a plain file name"),
        ("header-list", "header is a JSON list"), ("header-dtype", "unknown dtype 'Q4_K'"),
        ("header-overlap", "overlaps"), ("config-not-json", "not valid JSON"), ("mismatched-config", "--source"),
    ]],
    ("export: no such checkpoint", "export {out} {out}2", "not found; pass a run folder (OUT) or a step folder"),
    ("export: OUT holds the checkpoint", "export {run}/checkpoints/step-00000002 {run}/checkpoints/step-00000002/.. --force",
     "would overwrite"),
    ("export: OUT is the source", "export {ckpt} {tiny} --force", "would overwrite"),
    ("export: OUT exists", "export {ckpt} {file}", "exists; pass --force"),
    ("export: --max-shard-size 0", "export {ckpt} {out} --max-shard-size 0", "not a size like"),
    ("export: --max-shard-size -5GB", "export {ckpt} {out} --max-shard-size -5GB", "not a size like"),
    ("export: --dtype int4", "export {ckpt} {out} --dtype int4", "'int4' is not one of"),
    ("export: OUT busy", "export {ckpt} {busy}", "OUT {busy} is in use by process"),
    # plan
    *[(f"plan: {args}", f"plan {{tiny}} {args}", message) for args, message in [
        ("--pp 0", "--pp"), ("--pp -1", "--pp"), ("--pp 2 --batch-size -2", "--batch-size"),
        ("--pp 2 --microbatches 0", "--microbatches"), ("--pp 2 --seq-len 0", "--seq-len"),
        ("--pp 2 --vpp 0", "--vpp"), ("--pp 2 --dtype int8", "--dtype must be one of"),
        ("--pp 2 --plan-method random", "random"), ("--pp 2 --layout xyz", "--layout"),
    ]],
    ("plan: no such model", "plan {out} --pp 2", "{out}"),
    ("plan: config not JSON", "plan {m:config-not-json} --pp 2", "not valid JSON"),
    # verify
    *[(f"verify: {args}", f"verify {{tiny}} {args}", message) for args, message in [
        ("--pp 0", "--pp"), ("--pp 9", "reduce --pp"), ("--seq-len 0", "--seq-len must be >= 2"),
        ("--seq-len 4096", "exceeds the model's max_position_embeddings 256"),
        ("--batch-size 0", "--batch-size"), ("--tolerance nan", "--tolerance"), ("--tolerance -1", "--tolerance"),
    ]],
    *[(f"verify: model {how}", "verify {m:" + how + "}", message) for how, message in [
        ("header-reversed", "are reversed"), ("header-no-offsets", "data_offsets None"),
        ("header-shape", "needs 4000000000000 bytes"), ("header-length", "corrupt safetensors header length"),
        ("index-parent", "not a plain file name"), ("auto-map", "pass --trust-remote-code"), ("gpt2", "gpt2"),
        ("empty-shard", "truncated safetensors file"),
    ]],
    # quickstart: options checked before it writes anything
    ("quickstart: --steps 0", "quickstart --out {out} --steps 0", "--steps"),
    ("quickstart: --pp 0", "quickstart --out {out} --pp 0", "--pp"),
    ("quickstart: --pp 9", "quickstart --out {out} --pp 9", "--pp"),
    ("quickstart: --out is a file", "quickstart --out {file}", "--out"),
    # the command line itself
    ("no such option", "finetune {tiny} --learning-rate 1", "No such option"),
    ("unknown command", "train {tiny}", "No such command 'train'"),
]


def tree(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): (p.stat().st_size if p.is_file() else -1)
            for p in sorted(root.rglob("*")) if not p.is_symlink()}


@pytest.mark.parametrize("line, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tiny, ckpt, tmp_path, line, message):
    subst = {"{tiny}": str(tiny), "{ckpt}": str(ckpt), "{out}": str(tmp_path / "out"),
             "{file}": str(tmp_path / "a-file"), "{busy}": str(tmp_path / "busy")}
    (tmp_path / "a-file").write_text("not a folder")
    for token in set(line.split()):
        if token.startswith("{m:"):
            folder = tmp_path / token[3:-1]
            shutil.copytree(tiny, folder)
            MODEL_DAMAGE[token[3:-1]](folder)
            subst[token] = str(folder)
        elif token.startswith("{c:"):
            folder = tmp_path / "ckpts" / token[3:-1]
            shutil.copytree(ckpt, folder)
            CKPT_DAMAGE[token[3:-1]](folder)
            subst[token] = str(folder)
    for token in set(line.split()):
        if token.startswith("{y:"):
            recipe = tmp_path / "recipe.yaml"
            text = RECIPES[token[3:-1]]
            recipe.write_text((f"model: {tiny}\n" if ":" in text and not text.startswith("[") else "") + text + "\n")
            subst[token] = str(recipe)
    if "{run}" in line:
        shutil.copytree(ckpt.parents[1], tmp_path / "run")
        subst["{run}"] = str(tmp_path / "run")
    args = []
    for token in line.split():
        for key, value in subst.items():
            token = token.replace(key, value)
        args.append(token)
    message = message.replace("{out}", subst["{out}"]).replace("{busy}", subst["{busy}"])
    lock = _hold(tmp_path / ".busy.lock", tmp_path / "busy") if "{busy}" in line else None
    before, source_before = tree(tmp_path), tree(tiny)
    try:
        result = CliRunner().invoke(app, args)
        after = tree(tmp_path)
    finally:
        if lock is not None:
            lock.release()
    assert result.exit_code == 2, (result.exit_code, result.stderr[-2000:])
    lines = error_lines(result.stderr)  # a progress line may come first on a loaded machine
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-2000:]
    assert message in lines[0], lines[0]
    assert "Traceback" not in result.stdout + result.stderr
    assert after == before and tree(tiny) == source_before  # nothing half-written, inputs untouched
    assert not Path("/tmp/hfpipe-pwned").exists()


def _hold(lock_file: Path, folder: Path):
    from hfpipe.parallel.lock import FolderLock

    return FolderLock(lock_file, folder, "OUT").acquire()


def test_the_matrix_covers_every_command_with_120_cases():
    commands = {line.split()[0] for _, line, _ in CASES}
    assert {"finetune", "export", "plan", "verify", "quickstart"} <= commands
    assert len(CASES) + 26 >= 120 and len({c[0] for c in CASES}) == len(CASES)
