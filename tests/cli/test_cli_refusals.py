"""Refusals in one line: dropped records, adapter exports checked like PEFT loads
them, merges onto a changed base, quantized scales against their block size, and adapter folders.

Each case is a refusal in one line with exit 2 that writes and loses nothing (``_refused``), or what
is allowed, said.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from _trust import tiny  # noqa: F401 - a fixture
from hfpipe.tiny import make_tiny_checkpoint
from test_lora_checkpoint import lora_checkpoint_from_peft
from test_export_force_and_damage import FT, _edit_meta, _refused

# --- 1. records dropped are counted, and most of the data dropped is refused ------------------------


def _chat(turns_with_reply: int, total: int) -> list[dict]:
    reply = [{"role": "assistant", "content": "an answer"}]
    return [{"messages": [{"role": "user", "content": f"question {i}"}] + (reply if i < turns_with_reply else [])}
            for i in range(total)]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


DROPPED = {
    "chat: 36 of 40 without an assistant turn": (_chat(4, 40), "36 of 40 records dropped (36 with no assistant turn)"),
    "chat: 3 of 4": (_chat(1, 4), "3 of 4 records dropped (3 with no assistant turn), more than half"),
    "text: 3 of 5 empty": ([{"text": "" if i < 3 else f"some words {i}"} for i in range(5)],
                           "3 of 5 records dropped (3 with empty text)"),
    "chat: every record": (_chat(0, 6), ("6 of 6 records dropped", "no document with a trainable token")),
}


@pytest.mark.parametrize("case", list(DROPPED))
def test_a_run_that_would_drop_most_records_is_refused_and_says_why(tiny, tmp_path, case):
    rows, message = DROPPED[case]
    data = _jsonl(tmp_path / "case" / "d.jsonl", rows)
    args = [a.replace("{tiny}", str(tiny)) for a in FT]
    _refused([*args, "--output-dir", tmp_path / "case" / "out", "--dataset", data], message, tmp_path)


def _load(tiny: Path, data: Path, **kw):
    from transformers import AutoTokenizer

    from hfpipe.data.config import DataConfig
    from hfpipe.data.load import load_examples

    return load_examples(DataConfig(dataset=str(data), seq_len=32, packing=False, **kw),
                         AutoTokenizer.from_pretrained(tiny))


@pytest.mark.parametrize("rows, allow, kept, said", [
    (_chat(4, 40), True, 4, "36 of 40 records dropped (36 with no assistant turn)"),
    (_chat(2, 4), False, 2, "2 of 4 records dropped (2 with no assistant turn)"),  # half is not most
    (_chat(3, 3), False, 3, None),
])
def test_dropped_records_are_said_and_allowed_when_the_user_says_so(tiny, tmp_path, caplog, rows, allow, kept, said):
    with caplog.at_level(logging.WARNING, logger="hfpipe.data.load"):
        rows_out = _load(tiny, _jsonl(tmp_path / "d.jsonl", rows), allow_dropped_records=allow)
    assert len(rows_out) == kept
    warned = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert warned == ([f"--dataset {tmp_path / 'd.jsonl'}: {said}"] if said else [])


def test_allow_dropped_records_is_free_to_change_on_resume():
    from hfpipe.train.resume_check import FREE, MUST_MATCH

    assert "allow_dropped_records" in FREE and "allow_dropped_records" not in MUST_MATCH


# --- 2. an adapter export is checked against its config and its base, as PEFT loads it -----------------


@pytest.fixture(scope="module")
def lora(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny base and a LoRA checkpoint on it (as the trainer writes it, with the base recorded)."""
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_checkpoint(root / "base", "llama", num_hidden_layers=2)
    return base, lora_checkpoint_from_peft(base, root / "run" / "step-00000003", ["q_proj", "v_proj"])


def _lora_case(lora, root: Path) -> tuple[Path, Path]:
    base, ckpt = lora
    base = Path(shutil.copytree(base, root / "base"))
    c = Path(shutil.copytree(ckpt, root / "run" / "step-00000003"))
    _edit_meta(c, lambda m: {**m, "source": str(base)})
    return base, c


@pytest.mark.parametrize("rank", [2, 8])
def test_an_adapter_whose_record_says_another_rank_than_its_tensors_is_refused(lora, tmp_path, rank):
    _, c = _lora_case(lora, tmp_path / "case")
    _edit_meta(c, lambda m: {**m, "lora": {**m["lora"], "r": rank}})
    _refused(["export", c, tmp_path / "case" / "out", "--no-progress"],
             ("has shape [4, ", f"(r={rank}, in hfpipe.json)", f"makes it [{rank}, "), tmp_path)


@pytest.mark.parametrize("merge", [False, True])
def test_an_adapter_exported_onto_a_base_of_another_shape_is_refused(lora, tmp_path, merge):
    _, c = _lora_case(lora, tmp_path / "case")
    other = make_tiny_checkpoint(tmp_path / "case" / "wider", "llama", num_hidden_layers=2, hidden_size=48,
                                 tokenizer=False)
    _refused(["export", c, tmp_path / "case" / "out", "--no-progress", "--source", other,
              *(["--merge"] if merge else [])], ("has shape", "--source"), tmp_path)


# --- 3. a merge refuses a base that changed after training ----------------------------------------


def _rewrite_first_tensor(base: Path) -> None:
    shard = sorted(base.glob("*.safetensors"))[0]
    tensors = load_file(shard)
    first = sorted(tensors)[0]
    tensors[first] = tensors[first] + 1
    save_file(tensors, shard, metadata={"format": "pt"})


CHANGES = {
    "weights rewritten, same shapes": (_rewrite_first_tensor, ("base file", ".safetensors changed since the run trained")),
    "config.json edited": (lambda b: _edit_json(b / "config.json", rms_norm_eps=1e-5),
                           "config.json changed since the run trained"),
    "a shard added": (lambda b: save_file({"x": torch.zeros(1)}, b / "extra.safetensors"),
                      "extra.safetensors was not there when the run trained"),
    "record without the base": (None, "hfpipe.json does not record the base"),
}


def _edit_json(path: Path, **changes) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_merge_onto_a_base_that_changed_after_training_is_refused(lora, tmp_path, change):
    base, c = _lora_case(lora, tmp_path / "case")
    edit, message = CHANGES[change]
    if edit is None:
        _edit_meta(c, lambda m: {k: v for k, v in m.items() if k != "base"})
    else:
        edit(base)
    _refused(["export", c, tmp_path / "case" / "out", "--no-progress", "--merge"], message, tmp_path)


def test_a_merge_onto_a_copy_of_the_same_base_elsewhere_is_allowed(lora, tmp_path):
    from typer.testing import CliRunner

    from hfpipe.cli.main import app

    base, c = _lora_case(lora, tmp_path / "case")
    moved = Path(shutil.move(str(base), tmp_path / "moved"))
    result = CliRunner().invoke(app, ["export", str(c), str(tmp_path / "out"), "--no-progress", "--merge",
                                      "--source", str(moved)])
    assert result.exit_code == 0, result.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "out").glob("*.safetensors")) == \
        sorted(p.name for p in moved.glob("*.safetensors"))


# --- 4. FP8 scales agree with weight_block_size and their weight, or the checkpoint is refused ---------


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Path:
    """A tiny DeepSeek-V3 (routed experts, per-expert keys; moe_intermediate_size 32), with a tokenizer."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("moe") / "ds", "deepseek_v3", num_hidden_layers=3)


@pytest.fixture(scope="module")
def fp8(moe, tmp_path_factory) -> Path:
    """``moe`` as DeepSeek ships it: block-FP8 linears with 16 x 16 tiles, over two shards."""
    from hfpipe.tiny import make_fp8_checkpoint

    return make_fp8_checkpoint(moe, tmp_path_factory.mktemp("fp8") / "ds", block=16, num_shards=2)


def _edit_tensor(folder: Path, key: str, value=None, *, new_key: str | None = None) -> None:
    """Replace ``key`` by ``value`` (None: delete it), or add ``new_key`` beside it; the index follows."""
    index = folder / "model.safetensors.index.json"
    record = json.loads(index.read_text())
    shard = folder / record["weight_map"][key]
    tensors = load_file(shard)
    if new_key is not None:
        tensors[new_key], record["weight_map"][new_key] = value, shard.name
    elif value is None:
        del tensors[key], record["weight_map"][key]
    else:
        tensors[key] = value
    save_file(tensors, shard, metadata={"format": "pt"})
    index.write_text(json.dumps(record))


def _set_block(folder: Path, block) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = block
    (folder / "config.json").write_text(json.dumps(cfg))


O_PROJ = "model.layers.0.self_attn.o_proj.weight"  # 64 x 64: 4 x 4 tiles of 16
SCALES = {
    "block 32 over 16-tiles": (lambda f: _set_block(f, [32, 32]), ("weight_block_size [32, 32] tiles", "into [2, 4]")),
    "block 8 over 16-tiles": (lambda f: _set_block(f, [8, 8]), ("weight_block_size [8, 8] tiles", "into [8, 16]")),
    "non-square block": (lambda f: _set_block(f, [16, 32]), "weight_block_size [16, 32] tiles"),
    "a row of extra tiles": (lambda f: _edit_tensor(f, O_PROJ + "_scale_inv", torch.ones(5, 4)),
                             (f"'{O_PROJ}_scale_inv' has shape [5, 4]", "into [4, 4]")),
    "a column of extra tiles": (lambda f: _edit_tensor(f, O_PROJ + "_scale_inv", torch.ones(4, 5)),
                                f"'{O_PROJ}_scale_inv' has shape [4, 5]"),
    "a missing tile": (lambda f: _edit_tensor(f, O_PROJ + "_scale_inv", torch.ones(4, 3)), "has shape [4, 3]"),
    "block 0": (lambda f: _set_block(f, [0, 0]), "weight_block_size must be two positive integers"),
    "block of one number": (lambda f: _set_block(f, [16]), "weight_block_size must be two positive integers"),
    "block as text": (lambda f: _set_block(f, "16x16"), "weight_block_size must be two positive integers"),
    "block 1.5": (lambda f: _set_block(f, [1.5, 16]), "weight_block_size must be two positive integers"),
}


def _ft(model: Path, out: Path, *extra) -> list:
    return ["finetune", model, "--pp", "2", "--seq-len", "32", "--batch-size", "2", "--max-steps", "1",
            "--output-dir", out, *extra]


@pytest.mark.parametrize("case", list(SCALES))
def test_fp8_scales_that_disagree_with_the_block_size_are_refused_before_training(fp8, tmp_path, case):
    edit, message = SCALES[case]
    model = Path(shutil.copytree(fp8, tmp_path / "case" / "fp8"))
    edit(model)
    _refused(_ft(model, tmp_path / "case" / "out"), message, tmp_path)


def test_extra_tiles_are_refused_alike_under_quantize_base_fp8(fp8, tmp_path):
    model = Path(shutil.copytree(fp8, tmp_path / "case" / "fp8"))
    _edit_tensor(model, O_PROJ + "_scale_inv", torch.ones(5, 4))
    _refused(_ft(model, tmp_path / "case" / "out", "--lora-rank", "4", "--quantize-base", "fp8"),
             f"'{O_PROJ}_scale_inv' has shape [5, 4]", tmp_path)


# --- 5. plan refuses what finetune refuses of a quantized base: one check, both commands ---------------


def _plan(model: Path, out: Path, *extra) -> list:
    return ["plan", model, "--pp", "2", "--seq-len", "32", "--batch-size", "2", *extra]


@pytest.fixture(scope="module")
def wide48(tmp_path_factory) -> Path:
    """A tiny Llama of hidden size 48: NF4's default 64-value blocks do not divide its rows."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("w48") / "llama", "llama", num_hidden_layers=2, hidden_size=48)


QUANT = {
    "nf4 default block over 48 rows": ("wide48", ["--quantize-base", "nf4"],
                                       ("--quantize-block-size 64 does not divide the rows of", "(48, 48)")),
    "nf4 block 32 over 48 rows": ("wide48", ["--quantize-base", "nf4", "--quantize-block-size", "32"],
                                  "--quantize-block-size 32 does not divide the rows"),
    "fp8 default tile over the gate/up seam": ("moe", ["--quantize-base", "fp8"],
                                               ("--quantize-block-size 128 must divide the routed experts' "
                                                "intermediate size 32", "stacks gate and up")),
    "fp8 tile 24 over the gate/up seam": ("moe", ["--quantize-base", "fp8", "--quantize-block-size", "24"],
                                          "--quantize-block-size 24 must divide the routed experts'"),
}


@pytest.mark.parametrize("command", [_plan, _ft])
@pytest.mark.parametrize("case", list(QUANT))
def test_plan_and_finetune_refuse_the_same_quantized_layout(request, tmp_path, case, command):
    if "nf4" in case and command is _ft:
        pytest.importorskip("torchao", reason="--quantize-base nf4 needs torchao")
    fixture, extra, message = QUANT[case]
    model = request.getfixturevalue(fixture)
    _refused(command(model, tmp_path / "out", "--lora-rank", "4", *extra), message, tmp_path)


def test_plan_answers_the_quantized_layout_finetune_accepts(moe):
    from typer.testing import CliRunner

    from hfpipe.cli.main import app

    result = CliRunner().invoke(app, [str(a) for a in _plan(moe, Path("."), "--lora-rank", "4", "--quantize-base",
                                                            "fp8", "--quantize-block-size", "16")])
    assert result.exit_code == 0, result.stderr[-2000:]
    assert "fp8" in result.stdout


# --- 6. expert checkpoints: keys, shapes and layouts checked when the index and headers are read --------

EXPERT = "model.layers.2.mlp.experts.1.down_proj.weight"  # [64, 32]; layer 2 is the MoE layer
EXPERTS = {
    "an expert of the wrong shape": (lambda f: _edit_tensor(f, EXPERT, torch.zeros(64, 33)),
                                     (f"tensor '{EXPERT}' has shape [64, 33]", "are [64, 32]")),
    "an expert transposed": (lambda f: _edit_tensor(f, EXPERT, torch.zeros(32, 64)), f"tensor '{EXPERT}' has shape [32, 64]"),
    "a missing expert key": (lambda f: _edit_tensor(f, EXPERT), (f"tensor '{EXPERT}' is missing", "1 of 8 experts")),
    "a fused key among per-expert keys": (
        lambda f: _edit_tensor(f, EXPERT, torch.zeros(8, 64, 64), new_key="model.layers.2.mlp.experts.gate_up_proj"),
        ("'model.layers.2.mlp.experts.gate_up_proj' is a fused expert tensor", "also has per-expert tensors")),
    "an expert beyond the config's count": (
        lambda f: _edit_tensor(f, EXPERT, torch.zeros(64, 32), new_key="model.layers.2.mlp.experts.8.down_proj.weight"),
        "'model.layers.2.mlp.experts.8.down_proj.weight' is an expert beyond the 8 routed experts"),
}


@pytest.mark.parametrize("command", ["finetune", "verify"])
@pytest.mark.parametrize("case", list(EXPERTS))
def test_a_damaged_expert_checkpoint_is_refused_naming_the_key_before_any_worker(moe, tmp_path, case, command):
    edit, message = EXPERTS[case]
    model = Path(shutil.copytree(moe, tmp_path / "case" / "ds"))
    edit(model)
    args = _ft(model, tmp_path / "case" / "out") if command == "finetune" else ["verify", model, "--pp", "2"]
    _refused(args, message, tmp_path)


# --- 6. adapter folders given to hfpipe: checked from adapter_config.json and the headers, before PEFT ---


@pytest.fixture(scope="module")
def adapter(lora, tmp_path_factory) -> Path:
    """``lora``'s checkpoint exported as a PEFT adapter folder (rank 4 on q_proj and v_proj)."""
    from hfpipe.export.hf_folder import export_checkpoint

    return export_checkpoint(lora[1], tmp_path_factory.mktemp("adapter") / "adapter", progress=False)


def _config_edit(**changes):
    return lambda a: _edit_json(a / "adapter_config.json", **changes)


def _bin_payload(a: Path) -> None:
    from _trust import RunsCode

    (a / "adapter_model.safetensors").unlink()
    torch.save({"x": RunsCode(f"touch {a.parent / 'pwned'}")}, a / "adapter_model.bin")


def _retensor(a: Path, edit) -> None:
    tensors = load_file(a / "adapter_model.safetensors")
    edit(tensors)
    save_file(tensors, a / "adapter_model.safetensors", metadata={"format": "pt"})


Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
ADAPTERS = {
    "rank 8 over rank-4 tensors": (_config_edit(r=8), (f"{Q_A} has shape [4, 64]", "(r=8)", "makes it [8, 64]")),
    "a huge rank": (_config_edit(r=1 << 40), (f"{Q_A} has shape [4, 64]", f"(r={1 << 40})")),
    "rank 0": (_config_edit(r=0), "r must be a positive integer (the LoRA rank), got 0"),
    "rank as text": (_config_edit(r="4"), "r must be a positive integer (the LoRA rank), got '4'"),
    "DoRA": (_config_edit(use_dora=True), "a DoRA adapter (use_dora: true)"),
    "modules_to_save": (_config_edit(modules_to_save=["lm_head"]), "modules_to_save ['lm_head']"),
    "another PEFT method": (_config_edit(peft_type="PREFIX_TUNING"), "a PREFIX_TUNING adapter"),
    "a .bin payload": (_bin_payload, ("adapter_model.bin: a pickle payload", "never loads")),
    "no payload": (lambda a: (a / "adapter_model.safetensors").unlink(), "no adapter_model.safetensors"),
    "config not JSON": (lambda a: (a / "adapter_config.json").write_text("{r: 4"), "adapter_config.json"),
    "config a list": (lambda a: (a / "adapter_config.json").write_text("[4]"), "must hold a JSON object, got a list"),
    "a tensor missing": (lambda a: _retensor(a, lambda t: t.pop(Q_A)), f"{Q_A} is missing"),
    "a DoRA magnitude beside the tensors": (
        lambda a: _retensor(a, lambda t: t.update({Q_A.replace("lora_A.weight", "lora_magnitude_vector"): torch.ones(64)})),
        "lora_magnitude_vector is not an adapter PEFT puts on the base"),
    "a base of another width": (
        lambda a: _edit_json(a / "adapter_config.json", base_model_name_or_path=str(make_tiny_checkpoint(
            a.parent / "wide", "llama", num_hidden_layers=2, hidden_size=48))),
        (f"{Q_A} has shape [4, 64]", "makes it [4, 48]")),
}


@pytest.mark.parametrize("case", list(ADAPTERS))
def test_verify_refuses_an_adapter_folder_it_cannot_run_before_building_peft(adapter, tmp_path, case):
    edit, message = ADAPTERS[case]
    a = Path(shutil.copytree(adapter, tmp_path / "case" / "adapter"))
    edit(a)
    _refused(["verify", a, "--pp", "2"], message, tmp_path)
    assert not (tmp_path / "case" / "pwned").exists()


@pytest.mark.parametrize("case", ["rank 8 over rank-4 tensors", "a huge rank", "DoRA", "a .bin payload"])
def test_generate_refuses_the_same_adapter_folders(adapter, tmp_path, case):
    edit, message = ADAPTERS[case]
    a = Path(shutil.copytree(adapter, tmp_path / "case" / "adapter"))
    edit(a)
    _refused(["generate", a, "--prompt", "hi"], message, tmp_path)
    assert not (tmp_path / "case" / "pwned").exists()


# --- elsewhere: generate with nothing to continue ---------------------------------------------------


def _without_template(tiny: Path, root: Path) -> Path:
    m = Path(shutil.copytree(tiny, root / "m"))
    cfg = json.loads((m / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (m / "tokenizer_config.json").write_text(json.dumps(cfg))
    (m / "chat_template.jinja").unlink(missing_ok=True)
    return m


@pytest.mark.parametrize("no_template", [True, False])
def test_generate_with_an_empty_prompt_and_no_template_is_one_line(tiny, tmp_path, no_template):
    m = _without_template(tiny, tmp_path / "case") if no_template else tiny
    extra = [] if no_template else ["--no-chat-template"]
    _refused(["generate", m, "--prompt", "", *extra], "--prompt is empty and this tokenizer adds no BOS", tmp_path)
