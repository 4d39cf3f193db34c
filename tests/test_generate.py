"""Spec of ``hfpipe generate`` / ``hfpipe chat``: transformers' own greedy output, from an HF folder
or straight from a training checkpoint (step folder or run folder), with nothing exported.

The checkpoint holds *other* weights than its source folder (a second random model, as training
would leave them), so a generator that silently read the source's weights would fail.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from hfpipe.checkpoint.dcp import CheckpointError, record_checksums
from hfpipe.cli.main import app
from hfpipe.errors import NoSuchPathError
from hfpipe.generate import GenerateError, load_generator
from hfpipe.tiny import make_tiny_checkpoint

PROMPT = "What colour is the sky?"
runner = CliRunner()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(source folder, trained folder, run folder): the run's checkpoint holds the trained weights."""
    root = tmp_path_factory.mktemp("gen")
    src = make_tiny_checkpoint(root / "src", "llama_tied", seed=0)
    trained = make_tiny_checkpoint(root / "trained", "llama_tied", seed=1)
    model = AutoModelForCausalLM.from_pretrained(trained, dtype=torch.float32)
    state = {"model." + k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    for step in (5, 10):
        ckpt = root / "run" / "checkpoints" / f"step-{step:08d}"
        dcp.save(state, checkpoint_id=ckpt, no_dist=True)
        meta = {"format": 1, "step": step, "source": str(src), "source_dtype": "float32", "tied": True,
                "config": {}}
        (ckpt / "hfpipe.json").write_text(json.dumps(meta))
        record_checksums(ckpt)  # as every checkpoint hfpipe saves
    return src, trained, root / "run"


@functools.cache
def hf_model(folder: Path):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@functools.cache
def loaded(model: Path):
    """hfpipe's generator for ``model``, loaded once per test session."""
    return load_generator(model)


def reference(folder: Path, ids: torch.Tensor, n: int) -> torch.Tensor:
    """What a transformers script gives: from_pretrained + greedy generate."""
    model = hf_model(folder)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return out[0, ids.shape[1]:]


def chat_ids(folder: Path) -> torch.Tensor:
    tok = AutoTokenizer.from_pretrained(folder)
    msgs = [{"role": "user", "content": PROMPT}]
    return tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt",
                                   return_dict=True)["input_ids"]


@pytest.mark.parametrize("where", ["hf_folder", "run_folder", "step_folder"])
def test_greedy_output_equals_transformers_generate(folders, where):
    src, trained, run = folders
    model = {"hf_folder": trained, "run_folder": run,
             "step_folder": run / "checkpoints" / "step-00000010"}[where]
    gen = load_generator(model)
    ids = gen.encode(PROMPT)
    torch.testing.assert_close(ids, chat_ids(src), rtol=0, atol=0)  # the chat template was applied
    got = gen.generate_ids(ids, max_new_tokens=16)
    assert got.tolist() == reference(trained, ids, 16).tolist()
    assert got.tolist() != reference(src, ids, 16).tolist()  # the checkpoint's weights, not the source's


def test_streamed_text_is_the_answer(folders):
    gen = loaded(folders[1])
    pieces: list[str] = []
    answer = gen.generate(gen.encode(PROMPT, chat_template=False), max_new_tokens=16, stream=pieces.append)
    assert answer and "".join(pieces) == answer


def test_sampling_is_seeded_and_differs_from_greedy(folders):
    gen = loaded(folders[1])
    ids = gen.encode(PROMPT)
    a, b = (gen.generate_ids(ids, max_new_tokens=16, temperature=1.5, seed=3) for _ in range(2))
    assert a.tolist() == b.tolist()
    assert a.tolist() != gen.generate_ids(ids, max_new_tokens=16).tolist()


def test_cli_generate_prints_the_answer(folders):
    src, trained, run = folders
    result = runner.invoke(app, ["generate", str(run), "--prompt", PROMPT, "--max-new-tokens", "12"])
    assert result.exit_code == 0, result.stderr
    tok = AutoTokenizer.from_pretrained(src)
    expected = tok.decode(reference(trained, chat_ids(src), 12), skip_special_tokens=True)
    assert result.stdout == expected + "\n"


def test_no_chat_template_continues_the_raw_text(folders):
    gen = loaded(folders[1])
    raw = gen.encode("The sky is", chat_template=False)
    assert raw.tolist() == AutoTokenizer.from_pretrained(folders[1])("The sky is", return_tensors="pt")[
        "input_ids"].tolist()


def test_chat_keeps_the_history_and_resets(folders):
    gen = loaded(folders[1])
    turns = iter(["hi", "", "and then?", "/reset", "hi"])
    out: list[str] = []

    def read(prompt: str) -> str:
        out.append(prompt)
        return next(turns)  # StopIteration ends like EOF would not: raise EOFError instead

    def reader(prompt: str) -> str:
        try:
            return read(prompt)
        except StopIteration:
            raise EOFError from None

    messages = gen.chat(reader, out.append, max_new_tokens=8)
    assert [m["role"] for m in messages] == ["user", "assistant"]  # history after /reset
    first = gen.generate(gen.encode([{"role": "user", "content": "hi"}]), max_new_tokens=8)
    assert messages[1]["content"] == first
    assert "(history cleared)\n" in out and out.count("you> ") == 6


def test_chat_with_piped_turns_shows_each_turn_on_its_own_line(folders):
    result = runner.invoke(app, ["chat", str(folders[1]), "--max-new-tokens", "4"], input="hi\nhow?\n")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == "you> hi" and lines[1].startswith("model> ")
    assert lines[2] == "you> how?" and lines[3].startswith("model> ")


def test_a_missing_step_lists_the_existing_ones(folders):
    run = folders[2]
    with pytest.raises(CheckpointError, match="existing steps: step-00000005, step-00000010"):
        load_generator(run / "checkpoints" / "step-00000007")


@pytest.mark.parametrize("name", ["step-5", "step_5", "step5"])
def test_a_step_typed_without_its_padding_is_named_with_the_steps_that_exist(folders, name):
    checkpoints = folders[2] / "checkpoints"
    with pytest.raises(CheckpointError, match=rf"did you mean {checkpoints / 'step-00000005'}\? "
                                              "existing steps: step-00000005, step-00000010"):
        load_generator(checkpoints / name)


def test_a_mistyped_folder_is_no_such_folder_not_a_hub_error(folders, monkeypatch):
    monkeypatch.chdir(folders[0].parent)  # beside trained/, as after `hfpipe export ... trained`
    with pytest.raises(NoSuchPathError, match=r"MODEL trained/hff: no such folder; pass a model folder"):
        load_generator("trained/hff")  # org/repo in form, but trained/ is a folder here
    with pytest.raises(NoSuchPathError, match=r"MODEL ./traned: no such folder \(did you mean trained\?\)"):
        load_generator("./traned")
    with pytest.raises(NoSuchPathError, match=r"MODEL run/checkpoints/stepp-5/x: no such folder"):
        load_generator("run/checkpoints/stepp-5/x")


def test_a_moved_source_needs_source_option(folders, tmp_path):
    src, _, run = folders
    ckpt = run / "checkpoints" / "step-00000005"
    meta = json.loads((ckpt / "hfpipe.json").read_text())
    moved = tmp_path / "ckpt"
    import shutil

    shutil.copytree(ckpt, moved)
    (moved / "hfpipe.json").write_text(json.dumps({**meta, "source": str(tmp_path / "gone")}))
    with pytest.raises(GenerateError, match="--source"):
        load_generator(moved)
    assert load_generator(moved, source=src).model.config.vocab_size > 0


def test_cli_errors_are_one_line(tmp_path):
    result = runner.invoke(app, ["generate", str(tmp_path / "nope"), "--prompt", "x"])
    assert result.exit_code == 2 and result.stderr.startswith("error: MODEL")
    assert len(result.stderr.splitlines()) == 1
