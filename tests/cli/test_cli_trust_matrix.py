"""The bad-input matrix of what an input must never make hfpipe do, run through the ``hfpipe`` command
in-process.

Every case is one command line against an input broken in one way: a crafted byte item in a
checkpoint (1), a planted lock file (2), an ``export --force`` into something hfpipe did not write
(3), flipped bytes or a damaged checksum record (4), a chat template that leaves the sandbox or
drops a message (5). The spec for each, as in tests/cli/test_cli_bad_inputs.py: exit code 2, exactly one
stderr line ``error: ...`` holding the asserted text, no traceback, and nothing written or lost:
the test folder (victim files, planted links and all) and the model folder are byte for byte as
before, and no payload's marker file exists. The default run takes a representative slice; the
whole matrix is ``-m slow``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from _trust import (  # noqa: F401 - ckpt and tiny are fixtures
    PAYLOADS, ckpt, copy_checkpoint, error_lines, flip, flip_file, plant, replace_item, tiny, tree,
)
from hfpipe.cli.main import app

LR = "optim.param_groups.model.layers.0.mlp.up_proj.weight.lr"
BETAS = "optim.param_groups.lm_head.weight.betas"
WEIGHT = "model.model.layers.1.self_attn.q_proj.weight"
FT = "finetune {tiny} --pp 2 --seq-len 32 --batch-size 2 --max-steps 1"



# --- inputs broken in one way each; every function gets (folder, marker) ----------------------------

CKPT = {
    **{f"crafted-{name}": (lambda p: lambda c, m: replace_item(c, LR, PAYLOADS[p](f"touch {m}")))(name)
       for name in PAYLOADS},
    "crafted-record-stale": lambda c, m: replace_item(c, LR, PAYLOADS["os.system"](f"touch {m}"), rerecord=False),
    "crafted-betas": lambda c, m: replace_item(c, BETAS, PAYLOADS["eval"](f"touch {m}")),
    "tensor-as-bytes": lambda c, m: replace_item(c, WEIGHT, PAYLOADS["os.system"](f"touch {m}"), as_bytes=True),
    "flip-layer": lambda c, m: flip(c, WEIGHT),
    "flip-embed-64": lambda c, m: flip(c, "model.model.embed_tokens.weight", 64),
    "flip-head-zip-header": lambda c, m: flip(c, "model.lm_head.weight", 4, at=0.01),
    "flip-betas": lambda c, m: flip(c, BETAS, at=0.9),
    "record-deleted": lambda c, m: (c / "checksums.json").unlink(),
    "record-edited": lambda c, m: (c / "checksums.json").write_text((c / "checksums.json").read_text().replace("a", "b", 1)),
    "metadata-flipped": lambda c, m: flip_file(c / ".metadata"),
}


LOCKS = {"symlink": "is a symbolic link", "dangling-symlink": "is a symbolic link", "hard-link": "has 2 hard links",
         "fifo": "is not a regular file", "folder": "is not a regular file"}


def _out_folder(kind: str, out: Path, root: Path) -> None:
    """What stands at OUT before ``export --force``."""
    if kind == "unrelated":
        out.mkdir()
        (out / "thesis.tex").write_text("years of work")
    elif kind == "file":
        out.write_text("a file")
    elif kind == "link":
        (root / "elsewhere").mkdir()
        (root / "elsewhere" / "notes.txt").write_text("keep")
        out.symlink_to(root / "elsewhere")
    elif kind == "subfolder-only":
        (out / "data").mkdir(parents=True)
    else:
        out.mkdir()
        (out / "model.safetensors").write_text("not ours")
        record = out / "hfpipe_export.json"
        if kind == "foreign-record":
            record.write_text('{"written_by": "someone"}')
        elif kind == "record-link":
            record.symlink_to(root / "a-file")
        else:
            record.write_text("{not json")


OUTS = {"unrelated": "holds files and no hfpipe_export.json", "file": "is a file, not a folder",
        "link": "is a symbolic link", "subfolder-only": "holds files and no hfpipe_export.json",
        "foreign-record": "holds a hfpipe_export.json hfpipe did not write",
        "record-link": "holds a hfpipe_export.json that is not a file",
        "record-garbage": "holds an unreadable hfpipe_export.json"}

TEMPLATES = {
    "escape-class": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "escape-cycler": "{{ cycler.__init__.__globals__.os.system('touch MARKER') }}",
    "escape-joiner": "{{ joiner.__init__.__globals__ }}",
    "escape-namespace": "{{ namespace.__init__.__globals__ }}",
    "escape-lipsum": "{{ lipsum.__globals__['os'].system('touch MARKER') }}",
    "escape-raise": "{{ raise_exception.__globals__ }}",
    "escape-self": "{{ self.__init__.__globals__ }}",
    "escape-format": "{{ '{0.__class__}'.format(messages) }}",
    "drop-user": "{% for m in messages %}<|{{ m.role }}|>{% if m.role == 'assistant' %}{{ m.content }}{% endif %}<|eos|>{% endfor %}",
    "drop-assistant": "{% for m in messages %}<|{{ m.role }}|>{% if m.role == 'user' %}{{ m.content }}{% endif %}<|eos|>{% endfor %}",
    "roles-only": "{% for m in messages %}<|{{ m.role }}|><|eos|>{% endfor %}",
    "first-turn-only": "<|user|>{{ messages[0].content }}<|eos|><|assistant|>{{ messages[1].content }}<|eos|>",
    "truncating": "{% for m in messages %}<|{{ m.role }}|>{{ m.content[:5] }}<|eos|>{% endfor %}",
    "syntax": "{% for m in messages %}{{ m.content }",
    "raise": "{{ raise_exception('this template refuses everything') }}",
    "unknown-filter": "{% for m in messages %}{{ m.content | shout }}{% endfor %}",
}
_ESCAPE = "the chat template tries to leave jinja's sandbox"
TEMPLATE_MESSAGES = {
    **{k: _ESCAPE for k in TEMPLATES if k.startswith("escape-")},
    # the sandbox renders these unsafe attributes as undefined (empty): left is a template that drops the turns
    "escape-raise": "the chat template drops the text of message 0 (user)",
    "escape-format": "the chat template drops the text of message 0 (user)",
    **{k: f"the chat template drops the text of message {i} ({role})" for k, i, role in [
        ("drop-user", 0, "user"), ("drop-assistant", 1, "assistant"), ("roles-only", 0, "user"),
        ("first-turn-only", 2, "user"), ("truncating", 0, "user")]},
    "syntax": "the chat template fails (TemplateSyntaxError",
    "raise": "the chat template fails (TemplateError: this template refuses everything)",
    "unknown-filter": "the chat template fails (TemplateAssertionError: No filter named 'shout'",
}
# the model folder's own template: {m:<name>} is a copy of tiny whose chat_template.jinja is TEMPLATES[name]


def slow(name: str, line: str, message: str):
    return pytest.param(line, message, marks=pytest.mark.slow, id=name)


def fast(name: str, line: str, message: str):
    return pytest.param(line, message, id=name)


EXPORT = "export {c:%s} {out} --no-progress"
CASES = [
    # 1. crafted byte items run nothing: resume (preflight), export, generate, verify
    *[(fast if p in ("os.system", "eval") else slow)(
        f"resume: byte item {p}", f"{FT} --output-dir {{out}} --resume {{c:crafted-{p}}}",
        "stored item optim.param_groups.model.layers.0.mlp.up_proj.weight.lr is not plain data (refusing ")
      for p in PAYLOADS],
    slow("resume auto: byte item", f"{FT} --output-dir {{r:crafted-exec}} --resume auto", "is not plain data (refusing "),
    slow("resume: byte item, stale record", f"{FT} --output-dir {{out}} --resume {{c:crafted-record-stale}}",
         ".metadata is damaged (fails its xxh3_64 checksum)"),
    fast("export: byte item", EXPORT % "crafted-os.system", "is not plain data (refusing posix.system)"),
    slow("export: betas byte item", EXPORT % "crafted-betas", f"stored item {BETAS} is not plain data (refusing"),
    slow("export: weight stored as a byte item", EXPORT % "tensor-as-bytes",
         f"stored item {WEIGHT} is not plain data (refusing posix.system)"),
    fast("generate: byte item", "generate {c:crafted-subprocess} --prompt hi", "is not plain data (refusing "),
    slow("generate: weight stored as a byte item", "generate {c:tensor-as-bytes} --prompt hi", "is not plain data"),
    slow("verify: a crafted checkpoint folder", "verify {c:crafted-os.system}", "config.json"),
    # 2. a planted lock file clobbers nothing: the run lock, a node's lock, the export lock
    *[(fast if k == "symlink" else slow)(
        f"finetune: run lock {k}", f"{FT} --output-dir {{lock:run:{k}}}",
        f"its lock file {{lockfile}} {LOCKS[k]}; hfpipe never writes through one") for k in LOCKS],
    slow("finetune: node lock symlink",
         f"{FT} --output-dir {{lock:node1:symlink}} --nnodes 2 --node-rank 1 --rdzv-endpoint 127.0.0.1:9",
         "its lock file {lockfile} is a symbolic link"),
    *[(fast if k == "symlink" else slow)(
        f"export: OUT lock {k}", "export {ckpt} {lock:export:%s} --no-progress" % k,
        f"its lock file {{lockfile}} {LOCKS[k]}; hfpipe never writes through one") for k in LOCKS],
    # 3. export --force replaces only an earlier export
    *[(fast if k in ("unrelated", "file") else slow)(
        f"export --force: OUT {k}", "export {ckpt} {force:%s} --force --no-progress" % k, OUTS[k]) for k in OUTS],
    fast("export --force: the working folder", "export {ckpt} {cwd} --force --no-progress", "is the working folder"),
    slow("export --force: a parent of the working folder", "export {ckpt} {cwd}/.. --force --no-progress",
         "is a parent of the working folder"),
    slow("export --force: /", "export {ckpt} / --force --no-progress", "is /"),
    slow("export --force: the checkpoints folder", "export {c:copy} {c:copy}/.. --force --no-progress", "would overwrite"),
    slow("export --force: the run folder", "export {c:copy} {c:copy}/../.. --force --no-progress", "would overwrite"),
    slow("export --force: a parent of the source", "export {ckpt} {tiny}/.. --force --no-progress", "would overwrite"),
    slow("export --force: a link to the checkpoints folder", "export {c:copy} {ckpt-link} --force --no-progress",
         "would overwrite"),
    # 4. flipped bytes and damaged records are named in one line
    fast("export: a flipped byte", EXPORT % "flip-layer",
         f"{WEIGHT} is damaged (__0_0.distcp bytes"),
    slow("export: 64 flipped bytes", EXPORT % "flip-embed-64", "model.model.embed_tokens.weight is damaged"),
    slow("export: a flipped zip header", EXPORT % "flip-head-zip-header", "model.lm_head.weight is damaged"),
    slow("export --dtype bf16: a flipped byte", (EXPORT % "flip-layer") + " --dtype bf16", f"{WEIGHT} is damaged"),
    slow("export: flipped byte item", EXPORT % "flip-betas", f"{BETAS} is damaged"),
    fast("generate: a flipped byte", "generate {c:flip-layer} --prompt hi", f"{WEIGHT} is damaged"),
    fast("resume: a flipped byte item", f"{FT} --output-dir {{out}} --resume {{c:flip-betas}}", f"{BETAS} is damaged"),
    slow("export: record deleted", EXPORT % "record-deleted", "checksums.json named by hfpipe.json cannot be read"),
    slow("export: record edited", EXPORT % "record-edited", "checksums.json is damaged or was replaced"),
    slow("resume: record edited", f"{FT} --output-dir {{out}} --resume {{c:record-edited}}",
         "checksums.json is damaged or was replaced"),
    slow("export: .metadata flipped", EXPORT % "metadata-flipped", ".metadata is damaged"),
    # 5. chat templates: --chat-template FILE, the model folder's own, and generate's
    *[(fast if k in ("escape-cycler", "drop-user", "syntax") else slow)(
        f"finetune --chat-template {k}", f"{FT} --output-dir {{out}} --chat-template {{t:{k}}}",
        f"{{t:{k}}}: {TEMPLATE_MESSAGES[k]}") for k in TEMPLATES],
    slow("finetune: the model's own template leaves the sandbox", f"{FT.replace('{tiny}', '{m:escape-lipsum}')} --output-dir {{out}}",
         f"{{m:escape-lipsum}}/chat_template.jinja: {_ESCAPE}"),
    fast("generate: the model's own template leaves the sandbox", "generate {m:escape-cycler} --prompt hi",
         f"{{m:escape-cycler}}/chat_template.jinja: {_ESCAPE}"),
    slow("generate: the model's own template drops the prompt", "generate {m:roles-only} --prompt hi",
         "{m:roles-only}/chat_template.jinja: the chat template drops the text of message 0 (user)"),
]


#: what may come before the error: log lines of work done so far, transformers' loading bar


def _setup(line: str, tiny: Path, ckpt: Path, root: Path, marker: Path) -> dict[str, str]:
    """Build each input the line names under ``root``; return token -> path."""
    subst = {"{tiny}": str(tiny), "{ckpt}": str(ckpt), "{out}": str(root / "out"), "{cwd}": str(root / "work")}
    (root / "work").mkdir()
    (root / "a-file").write_text("a file")
    victim = root / "victim.txt"
    victim.write_text("precious")
    for token in dict.fromkeys(t.split("/..")[0] for t in line.split()):
        if token.startswith("{c:") or token.startswith("{r:"):
            name = token[3:-1]
            folder = copy_checkpoint(ckpt, root / "runs" / name / "checkpoints" / "step-00000001")
            if name != "copy":
                CKPT[name](folder, marker)
            subst[token] = str(folder if token.startswith("{c:") else folder.parents[1])
        elif token == "{ckpt-link}":
            (root / "ckpt-link").symlink_to(root / "runs" / "copy" / "checkpoints")
            subst[token] = str(root / "ckpt-link")
        elif token.startswith("{lock:"):
            _, which, kind = token[1:-1].split(":")
            out = root / "lockout"
            (root if which == "export" else out).mkdir(exist_ok=True)
            lock = {"run": out / ".hfpipe.parallel.lock", "node1": out / ".hfpipe.node1.lock",
                    "export": root / ".lockout.lock"}[which]
            plant(kind, lock, victim)
            subst.update({token: str(out), "{lockfile}": str(lock)})
        elif token.startswith("{force:"):
            _out_folder(token[7:-1], root / "forced", root)
            subst[token] = str(root / "forced")
        elif token.startswith("{t:"):
            path = root / f"{token[3:-1]}.jinja"
            path.write_text(TEMPLATES[token[3:-1]].replace("MARKER", str(marker)))
            subst[token] = str(path)
        elif token.startswith("{m:"):
            folder = Path(shutil.copytree(tiny, root / token[3:-1]))
            (folder / "chat_template.jinja").write_text(TEMPLATES[token[3:-1]].replace("MARKER", str(marker)))
            subst[token] = str(folder)
    return subst


@pytest.mark.parametrize("line, message", CASES)
def test_a_hostile_input_is_one_line_exit_2_and_changes_nothing(tiny, ckpt, tmp_path, monkeypatch, line, message):
    root, marker = tmp_path / "case", tmp_path / "pwned"
    root.mkdir()
    subst = _setup(line, tiny, ckpt, root, marker)
    monkeypatch.chdir(root / "work")
    args = []
    for token in line.split():
        for key in sorted(subst, key=len, reverse=True):
            token = token.replace(key, subst[key])
        args.append(token)
    for key in sorted(subst, key=len, reverse=True):
        message = message.replace(key, subst[key])
    before, model_before = tree(root), tree(tiny)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, (result.exit_code, result.stderr[-2000:])
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-2000:]
    assert message in lines[0], lines[0]
    assert "Traceback" not in result.stdout + result.stderr
    assert tree(root) == before and tree(tiny) == model_before  # nothing written, nothing lost
    assert not marker.exists() and (root / "victim.txt").read_text() == "precious"


def test_the_matrix_has_a_case_per_attack_and_at_least_40():
    names = [c.id for c in CASES]
    assert len(names) == len(set(names)) and len(names) >= 40
    assert {"finetune", "export", "generate", "verify"} <= {c.values[0].split()[0] for c in CASES}


def test_force_replaces_an_earlier_export_and_an_export_of_a_tampered_optimizer_runs_nothing(ckpt, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "hf"
    assert CliRunner().invoke(app, ["export", str(ckpt), str(out), "--no-progress"]).exit_code == 0
    record = json.loads((out / "hfpipe_export.json").read_text())
    files = sorted(p.name for p in out.iterdir() if p.name != "hfpipe_export.json")
    assert record == {"written_by": "hfpipe", "kind": "model", "checkpoint": str(ckpt), "step": 1, "files": files}
    (out / "notes.txt").write_text("put there since")  # not hfpipe's: --force must not delete it
    result = CliRunner().invoke(app, ["export", str(ckpt), str(out), "--force", "--no-progress"])
    assert result.exit_code == 2 and "holds 'notes.txt', which is not hfpipe's" in result.stderr
    assert (out / "notes.txt").read_text() == "put there since"
    (out / "notes.txt").unlink()
    result = CliRunner().invoke(app, ["export", str(ckpt), str(out), "--force", "--no-progress"])
    assert result.exit_code == 0, result.stderr
    assert (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no lock, temporary or old folder left
