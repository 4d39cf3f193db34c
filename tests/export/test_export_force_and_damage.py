"""Spec of what an export shares, what ``--force`` deletes, and damage
that must not switch a check off.

Every bad input is one command line run in-process: exit code 2, exactly one ``error:`` line holding
the asserted text, no traceback, and the test folder and the model folder byte for byte as before.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from _trust import ckpt, copy_checkpoint, error_lines, flip, tiny, tree  # noqa: F401 - ckpt and tiny are fixtures
from hfpipe.checkpoint.dcp import record_checksums
from hfpipe.cli.main import app

WEIGHT = "model.model.layers.1.self_attn.q_proj.weight"
FT = ["finetune", "{tiny}", "--pp", "2", "--seq-len", "32", "--batch-size", "2", "--max-steps", "1"]
GIB = 1 << 30
HUGE = (256 << 20) + 1  # one byte past the cap on every side file (hfpipe.files.MAX_SIDE_FILE)



def _edit_meta(ckpt: Path, edit) -> None:
    path = ckpt / "hfpipe.json"
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))


def _tree(root: Path) -> dict:
    """:func:`tree`, with sparse giants compared by size (reading them is what must not happen)."""
    return tree(root, giant=1 << 20)


def _refused(args: list[str], message: str | tuple[str, ...], *watched: Path) -> str:
    """Run ``hfpipe ARGS``: exit 2, one error line holding ``message`` (each part of it), nothing under
    ``watched`` changed."""
    before = [_tree(w) for w in watched]
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 2, (result.exit_code, result.stderr[-2000:])
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-2000:]
    assert all(part in lines[0] for part in ((message,) if isinstance(message, str) else message)), lines[0]
    assert "Traceback" not in result.stdout + result.stderr
    assert [_tree(w) for w in watched] == before  # nothing written, nothing lost
    return lines[0]


def _export(ckpt: Path, out: Path, *extra: str):
    return CliRunner().invoke(app, ["export", str(ckpt), str(out), "--no-progress", *extra])


# --- 1. export shares the files of a model folder, never a private file beside them --------------------

PRIVATE = ["token", ".huggingface_token", "credentials.json", "secrets.yaml", "id_rsa", ".env", "notes.txt",
           "wandb_api_key.txt", "aws_credentials", "run.log"]


@pytest.mark.parametrize("name", PRIVATE)
def test_export_leaves_out_a_private_file_of_the_source_and_names_it(tiny, ckpt, tmp_path, caplog, name):
    src = Path(shutil.copytree(tiny, tmp_path / "src"))
    (src / name).write_text("hf_SECRET")
    (src / name).chmod(0o600)
    with caplog.at_level("WARNING"):
        result = _export(ckpt, tmp_path / "out", "--source", str(src))
    assert result.exit_code == 0, result.stderr
    assert not (tmp_path / "out" / name).exists()
    assert all(b"hf_SECRET" not in p.read_bytes() for p in (tmp_path / "out").iterdir())
    if not name.startswith("."):  # hidden files were never candidates
        assert any(name in r.getMessage() and "left out" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("name, mode", [("tokenizer_config.json", 0o600), ("tokenizer.json", 0o640),
                                        ("README.md", 0o600), ("generation_config.json", 0o644)])
def test_a_copied_model_file_is_never_more_readable_than_in_the_source(tiny, ckpt, tmp_path, name, mode):
    src = Path(shutil.copytree(tiny, tmp_path / "src"))
    if not (src / name).exists():
        (src / name).write_text("{}")
    (src / name).chmod(mode)
    assert _export(ckpt, tmp_path / "out", "--source", str(src)).exit_code == 0
    got = (tmp_path / "out" / name).stat().st_mode & 0o777
    assert got & ~mode == 0, oct(got)  # no permission bit the source did not have


def test_the_weights_and_config_hfpipe_writes_are_readable_as_save_pretrained_makes_them(ckpt, tmp_path):
    assert _export(ckpt, tmp_path / "out").exit_code == 0
    umask = os.umask(0)
    os.umask(umask)
    for name in ("config.json", "model.safetensors.index.json"):
        assert (tmp_path / "out" / name).stat().st_mode & 0o777 == 0o666 & ~umask


# --- 2. --force deletes only the files its record lists ----------------------------------------------


def _foreign(out: Path, kind: str) -> str:
    if kind == "file":
        (out / "thesis.tex").write_text("years of work")
        return "thesis.tex"
    if kind == "hidden":
        (out / ".notes").write_text("mine")
        return ".notes"
    if kind == "folder":
        (out / "data").mkdir()
        (out / "data" / "x.csv").write_text("1,2")
        return "data"
    if kind == "link":
        (out / "link").symlink_to(out.parent / "keep.txt")
        return "link"
    (out / "model-extra.safetensors").write_bytes(b"someone else's shard")  # looks like ours, is not listed
    return "model-extra.safetensors"


@pytest.mark.parametrize("kind", ["file", "hidden", "folder", "link", "look-alike-shard"])
def test_force_refuses_an_export_that_holds_a_file_it_does_not_list(ckpt, tmp_path, kind):
    out = tmp_path / "out"
    assert _export(ckpt, out).exit_code == 0
    (tmp_path / "keep.txt").write_text("keep")
    name = _foreign(out, kind)
    _refused(["export", ckpt, out, "--force", "--no-progress"], f"holds {name!r}, which is not hfpipe's", tmp_path)


@pytest.mark.parametrize("record, message", [
    ({"written_by": "hfpipe"}, "lists no files"),
    ({"written_by": "hfpipe", "files": "config.json"}, "lists no files"),
    ({"written_by": "someone", "files": []}, "hfpipe did not write"),
    ([], "hfpipe did not write"),
])
def test_force_refuses_a_record_that_does_not_list_the_folder(ckpt, tmp_path, record, message):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "hfpipe_export.json").write_text(json.dumps(record))
    _refused(["export", ckpt, out, "--force", "--no-progress"], message, tmp_path)


def test_a_huge_export_record_is_refused_without_being_read(ckpt, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with open(out / "hfpipe_export.json", "wb") as f:
        f.truncate(HUGE)  # sparse: no disk used; reading it whole is what the cap prevents
    _refused(["export", ckpt, out, "--force", "--no-progress"], "holds an unreadable hfpipe_export.json", tmp_path)


def test_force_deletes_exactly_the_listed_files_and_keeps_a_folder_something_else_appeared_in(ckpt, tmp_path):
    from hfpipe.export.out_folder import _remove_export

    old = tmp_path / "old"
    assert _export(ckpt, old).exit_code == 0
    (old / "late.txt").write_text("written after the check")
    _remove_export(old)
    assert sorted(p.name for p in old.iterdir()) == ["late.txt"]


# --- 3. damage cannot switch the checksums off -------------------------------------------------------


def _linked_meta(c: Path, drop: bool) -> None:
    """hfpipe.json replaced by a link to a copy elsewhere (without its checksums entry if ``drop``)."""
    meta = json.loads((c / "hfpipe.json").read_text())
    if drop:
        meta.pop("checksums")
    elsewhere = c.parent / "elsewhere.json"
    elsewhere.write_text(json.dumps(meta))
    (c / "hfpipe.json").unlink()
    (c / "hfpipe.json").symlink_to(elsewhere)


def _linked_record(c: Path) -> None:
    elsewhere = c.parent / "record-elsewhere.json"
    shutil.copyfile(c / "checksums.json", elsewhere)
    (c / "checksums.json").unlink()
    (c / "checksums.json").symlink_to(elsewhere)


DAMAGE = {
    "meta-link-without-checksums": (lambda c: _linked_meta(c, True), ("hfpipe.json", "a symbolic link")),
    "meta-link-to-same-content": (lambda c: _linked_meta(c, False), ("hfpipe.json", "a symbolic link")),
    "checksums-entry-removed": (lambda c: _edit_meta(c, lambda m: {k: v for k, v in m.items() if k != "checksums"}),
                                "hfpipe.json records no checksums"),
    "checksums-entry-null": (lambda c: _edit_meta(c, lambda m: {**m, "checksums": None}),
                             "hfpipe.json records no checksums"),
    "entry-and-record-removed": (lambda c: (_edit_meta(c, lambda m: {k: v for k, v in m.items() if k != "checksums"}),
                                            (c / "checksums.json").unlink()), "hfpipe.json records no checksums"),
    "record-linked": (_linked_record, "checksums.json named by hfpipe.json cannot be read (a symbolic link"),
    "record-is-a-folder": (lambda c: ((c / "checksums.json").unlink(), (c / "checksums.json").mkdir()),
                           "checksums.json named by hfpipe.json cannot be read (not a regular file)"),
    "record-huge": (lambda c: open(c / "checksums.json", "r+b").truncate(HUGE),
                    "checksums.json named by hfpipe.json cannot be read (too large"),
}


def _damaged(ckpt: Path, root: Path, damage: str) -> Path:
    c = copy_checkpoint(ckpt, root / "run" / "checkpoints" / "step-00000001")
    flip(c, WEIGHT)  # the bit the checksums exist to find
    DAMAGE[damage][0](c)
    return c


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_export_of_a_flipped_bit_is_refused_whatever_else_is_damaged(ckpt, tmp_path, damage):
    c = _damaged(ckpt, tmp_path / "case", damage)
    _refused(["export", c, tmp_path / "case" / "out", "--no-progress"], DAMAGE[damage][1], tmp_path)


@pytest.mark.parametrize("damage", ["meta-link-without-checksums", "checksums-entry-removed", "record-linked"])
def test_generate_from_a_flipped_bit_is_refused_whatever_else_is_damaged(ckpt, tmp_path, damage):
    c = _damaged(ckpt, tmp_path / "case", damage)
    _refused(["generate", c, "--prompt", "hi"], DAMAGE[damage][1], tmp_path)


@pytest.mark.parametrize("damage", ["meta-link-without-checksums", "checksums-entry-removed", "record-huge"])
def test_resume_from_a_flipped_bit_is_refused_whatever_else_is_damaged(tiny, ckpt, tmp_path, damage):
    c = _damaged(ckpt, tmp_path / "case", damage)
    args = [a.replace("{tiny}", str(tiny)) for a in FT]
    _refused([*args, "--output-dir", tmp_path / "case" / "out", "--resume", c], DAMAGE[damage][1], tmp_path)


def test_a_checksum_record_that_is_not_json_is_one_line(ckpt, tmp_path):
    from hfpipe.checkpoint.checksums import _digest

    c = copy_checkpoint(ckpt, tmp_path / "case" / "step-00000001")
    (c / "checksums.json").write_text("{not json")
    _edit_meta(c, lambda m: {**m, "checksums": {**m["checksums"], "digest": _digest(b"{not json")}})
    _refused(["export", c, tmp_path / "case" / "out", "--no-progress"], "checksums.json is not a JSON object",
             tmp_path)


@pytest.mark.parametrize("size", [HUGE, 2 * GIB])
def test_a_huge_run_record_is_refused_without_being_read(ckpt, tmp_path, size):
    c = copy_checkpoint(ckpt, tmp_path / "case" / "step-00000001")
    with open(c / "hfpipe.json", "r+b") as f:
        f.truncate(size)
    _refused(["export", c, tmp_path / "case" / "out", "--no-progress"], "hfpipe.json: too large", tmp_path)


# --- 4. the resume contract cannot be switched off -----------------------------------------------------


def _run_checkpoint(tiny: Path, ckpt: Path, root: Path, out: Path, edit) -> Path:
    from hfpipe.config.run import FinetuneConfig

    c = copy_checkpoint(ckpt, root / "run" / "checkpoints" / "step-00000001")
    cfg = FinetuneConfig(model=str(tiny), output_dir=str(out), pp=2, seq_len=32, batch_size=2, max_steps=1)
    _edit_meta(c, lambda m: {**m, "config": edit(cfg.to_dict())})
    record_checksums(c)  # a record consistent with its checksums: only the config is short
    return c


@pytest.mark.parametrize("edit, message", [
    (lambda d: {k: v for k, v in d.items() if k != "seq_len"}, "does not record the run's --seq-len"),
    (lambda d: {k: v for k, v in d.items() if k != "seed"}, "does not record the run's --seed"),
    (lambda d: {k: v for k, v in d.items() if k != "dataset"}, "does not record the run's --dataset"),
    (lambda d: {k: v for k, v in d.items() if k not in ("seed", "seq_len", "batch_size")},
     "does not record the run's --seq-len, --batch-size, --seed"),
    (lambda d: {}, "does not record the run's --model, --seq-len, --batch-size, --grad-accum and 21 more"),
    (lambda d: {"model": d["model"], "pp": 2, "dp": 1, "ep": 1}, "saved by the Python API"),
])
def test_a_record_missing_a_setting_is_refused_not_matched(tiny, ckpt, tmp_path, edit, message):
    out = tmp_path / "case" / "out"
    c = _run_checkpoint(tiny, ckpt, tmp_path / "case", out, edit)
    args = [a.replace("{tiny}", str(tiny)) for a in FT]
    _refused([*args, "--seed", "7", "--output-dir", out, "--resume", c], message, tmp_path)


@pytest.mark.parametrize("field", ["model", "dataset", "chat_template"])
def test_the_same_file_by_a_relative_path_is_the_same_run(tmp_path, monkeypatch, field):
    from hfpipe.config.run import FinetuneConfig
    from hfpipe.train.resume_check import check_resume

    (tmp_path / "thing").mkdir()
    monkeypatch.chdir(tmp_path)
    base = {"model": "m", "seq_len": 32, "batch_size": 2}
    base.pop(field, None)
    saved = {"config": FinetuneConfig(**base, **{field: str(tmp_path / "thing")}).to_dict()}
    now = FinetuneConfig(**base, **{field: "./thing"})
    assert check_resume("ckpt", saved, now, tied=False) == []


def test_another_file_by_a_relative_path_is_still_another_run(tmp_path, monkeypatch):
    from hfpipe.config.run import FinetuneConfig
    from hfpipe.train.resume_check import ResumeMismatch, check_resume

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    monkeypatch.chdir(tmp_path)
    saved = {"config": FinetuneConfig(model=str(tmp_path / "a"), seq_len=32, batch_size=2).to_dict()}
    with pytest.raises(ResumeMismatch, match="--model"):
        check_resume("ckpt", saved, FinetuneConfig(model="./b", seq_len=32, batch_size=2), tied=False)


# --- 5/6/9/10. fields and files a model folder may hold broken ----------------------------------------


def test_a_lora_resume_onto_a_base_whose_weights_changed_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    from hfpipe.config.run import FinetuneConfig
    from hfpipe.tiny import make_tiny_checkpoint
    from test_lora_checkpoint import lora_checkpoint_from_peft

    base, out = make_tiny_checkpoint(tmp_path / "case" / "base", "llama", num_hidden_layers=2), tmp_path / "case" / "out"
    c = lora_checkpoint_from_peft(base, out / "checkpoints" / "step-00000003", ["q_proj", "v_proj"])
    lora = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "q_proj,v_proj"]
    cfg = FinetuneConfig(model=str(base), output_dir=str(out), pp=2, seq_len=32, batch_size=2, max_steps=4,
                         lora_rank=4, lora_alpha=8, lora_targets="q_proj,v_proj")
    _edit_meta(c, lambda m: {**m, "config": cfg.to_dict()})  # the record a run writes: only the base moves
    shard = sorted(base.glob("*.safetensors"))[0]
    save_file({k: t + 1 for k, t in load_file(shard).items()}, shard, metadata={"format": "pt"})
    _refused(["finetune", base, "--pp", "2", "--seq-len", "32", "--batch-size", "2", "--max-steps", "4", *lora,
              "--output-dir", out, "--resume", c], (f"base file {shard} changed since the run trained", "--resume"),
             tmp_path)


def _model(tiny: Path, root: Path, **config) -> Path:
    m = Path(shutil.copytree(tiny, root / "m"))
    cfg = json.loads((m / "config.json").read_text())
    (m / "config.json").write_text(json.dumps({**cfg, **config}))
    return m


BAD_CONFIG = [
    ({"quantization_config": ["fp8"]}, "quantization_config must be an object"),
    ({"quantization_config": "fp8"}, "quantization_config must be an object"),
    ({"quantization_config": 8}, "quantization_config must be an object"),
    ({"router_aux_loss_coef": -0.01}, "router_aux_loss_coef must be a finite number >= 0"),
    ({"router_aux_loss_coef": math.nan}, "router_aux_loss_coef must be a finite number >= 0"),
    ({"router_aux_loss_coef": math.inf}, "router_aux_loss_coef must be a finite number >= 0"),
    ({"router_aux_loss_coef": -math.inf}, "router_aux_loss_coef must be a finite number >= 0"),
    ({"router_aux_loss_coef": "0.01"}, "router_aux_loss_coef must be a finite number >= 0"),
    ({"router_aux_loss_coef": True}, "router_aux_loss_coef must be a finite number >= 0"),
]


@pytest.mark.parametrize("fields, message", BAD_CONFIG)
def test_plan_refuses_a_bad_field_of_config_json(tiny, tmp_path, fields, message):
    m = _model(tiny, tmp_path / "case", **fields)
    _refused(["plan", m, "--pp", "2"], message, tmp_path)


@pytest.mark.parametrize("fields, message", BAD_CONFIG[:4] + BAD_CONFIG[4:5])
def test_export_refuses_a_bad_field_of_the_sources_config_json(tiny, ckpt, tmp_path, fields, message):
    m = _model(tiny, tmp_path / "case", **fields)
    _refused(["export", ckpt, tmp_path / "case" / "out", "--source", m, "--no-progress"], message, tmp_path)


def test_a_huge_config_json_is_refused_without_being_read(tiny, tmp_path):
    m = Path(shutil.copytree(tiny, tmp_path / "case" / "m"))
    with open(m / "config.json", "r+b") as f:
        f.truncate(HUGE)
    _refused(["plan", m, "--pp", "2"], "config.json: too large", tmp_path)


@pytest.mark.parametrize("text", ['{"version": "1.0"}', '{"model": {}}', "[]"])
def test_a_garbage_tokenizer_json_is_one_line(tiny, tmp_path, text):
    m = Path(shutil.copytree(tiny, tmp_path / "case" / "m"))
    (m / "tokenizer.json").write_text(text)
    _refused(["generate", m, "--prompt", "hi"], "no usable tokenizer", tmp_path)


@pytest.mark.parametrize("data", [b"\xff\xfe\x00\x01binary", bytes(range(256))])
def test_a_binary_chat_template_is_one_line(tiny, tmp_path, data):
    (tmp_path / "case").mkdir()
    template = tmp_path / "case" / "t.jinja"
    template.write_bytes(data)
    args = [a.replace("{tiny}", str(tiny)) for a in FT]
    _refused([*args, "--output-dir", tmp_path / "case" / "out", "--chat-template", template], "t.jinja", tmp_path)


# --- 7. the ETA counts days --------------------------------------------------------------------------


@pytest.mark.parametrize("seconds, shown", [
    (0, "00:00:00"), (59.9, "00:00:59"), (3600, "01:00:00"), (86399, "23:59:59"), (86400, "1d 00:00:00"),
    (292 * 3600, "12d 04:00:00"), (292 * 3600 + 3 * 60 + 45, "12d 04:03:45"), (-5, "00:00:00"),
    (math.inf, "?"), (math.nan, "?"),
])
def test_the_eta_shows_days_instead_of_wrapping_at_24_hours(seconds, shown):
    from hfpipe.progress.logs import duration, format_line

    assert duration(seconds) == shown
    row = {"step": 1, "loss": 1.0, "grad_norm": 1.0, "lr": 1e-4, "tokens_per_s": 10.0}
    assert format_line(row, 10, seconds).endswith(f" eta {shown}")


@pytest.mark.parametrize("field, value, shown", [("lora", "r=4", "a string"), ("quantize_base", 4, "a number"),
                                                  ("train", ["position"], "a list"), ("config", None, "null")])
def test_a_record_field_of_the_wrong_json_type_is_one_line_at_resume_and_export(tmp_path, field, value, shown):
    """A string where the record holds an object once ended a resume in ``AttributeError: 'str' object has
    no attribute 'get'``: every object field is checked where the record is read, for resume and export."""
    from hfpipe.config.run import FinetuneConfig
    from hfpipe.tiny import make_tiny_checkpoint
    from test_lora_checkpoint import lora_checkpoint_from_peft

    base, out = make_tiny_checkpoint(tmp_path / "case" / "base", "llama", num_hidden_layers=2), tmp_path / "case" / "out"
    c = lora_checkpoint_from_peft(base, out / "checkpoints" / "step-00000003", ["q_proj", "v_proj"])
    lora = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "q_proj,v_proj"]
    cfg = FinetuneConfig(model=str(base), output_dir=str(out), pp=2, seq_len=32, batch_size=2, max_steps=4,
                         lora_rank=4, lora_alpha=8, lora_targets="q_proj,v_proj")
    _edit_meta(c, lambda m: {**m, "config": cfg.to_dict(), field: value})
    said = (f"{c / 'hfpipe.json'}: field {field!r} must be a JSON object, got {shown}",)
    _refused(["finetune", base, "--pp", "2", "--seq-len", "32", "--batch-size", "2", "--max-steps", "4", *lora,
              "--output-dir", out, "--resume", c], said, tmp_path)
    _refused(["export", c, tmp_path / "hf"], said, tmp_path)
