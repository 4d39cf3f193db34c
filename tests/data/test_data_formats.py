"""Spec of the record formats: Alpaca, ShareGPT, chat, instruction, text, and the mapping options.

Each test writes a small file shaped as the real datasets are (Stanford Alpaca's JSON array,
ShareGPT's JSON lines) and checks which tokens carry loss.
"""

import json
import re

import datasets
import pytest

from hfpipe.data.config import DataConfig, DataError
from hfpipe.loss.tokens import IGNORE_INDEX
from hfpipe.data.load import load_examples, load_splits
from hfpipe.data.formats import FIELDS, detect_format
from hfpipe.tiny import make_tiny_tokenizer

BOS, EOS = 1, 2

# As in tatsu-lab/alpaca's alpaca_data.json: a JSON array, "input" often empty.
ALPACA = [
    {"instruction": "Give three tips for staying healthy.", "input": "",
     "output": "1. Eat well. 2. Exercise. 3. Sleep."},
    {"instruction": "Translate the sentence into French.", "input": "The cat sleeps.",
     "output": "Le chat dort."},
]
# As in ShareGPT dumps: an id, a conversations list of {from, value}, several turns.
SHAREGPT = [
    {"id": "QWJhYvA_0", "conversations": [
        {"from": "human", "value": "What is pipeline parallelism?"},
        {"from": "gpt", "value": "Splitting a model into stages on different devices."},
        {"from": "human", "value": "Why?"},
        {"from": "gpt", "value": "To fit and train bigger models."}]},
    {"id": "x9Kd2_1", "system": "Be brief.", "conversations": [
        {"from": "human", "value": "Hello"}, {"from": "gpt", "value": "Hi!"}]},
]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    datasets.disable_progress_bars()


@pytest.fixture()
def tok():
    return make_tiny_tokenizer()


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def load(path, tok, seq_len=128, **kw):
    return load_examples(DataConfig(dataset=str(path), seq_len=seq_len, packing=False, **kw), tok)


def real(row):
    return [t for t, m in zip(row["input_ids"], row["attention_mask"]) if m]


def labelled(tok, row) -> str:
    return tok.decode([t for t, y in zip(row["input_ids"], row["labels"]) if y != IGNORE_INDEX])


def chat_text(tok, messages) -> str:
    return tok.apply_chat_template(messages, tokenize=False)


def encode(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


# ----------------------------------------------------------------------------- detection


@pytest.mark.parametrize("columns, fmt", [
    (["messages"], "chat"),
    (["id", "conversations"], "sharegpt"),
    (["instruction", "input", "output"], "alpaca"),
    (["prompt", "completion"], "instruction"),
    (["prompt", "response"], "instruction"),
    (["text", "meta"], "text"),
])
def test_auto_detects_the_common_shapes(columns, fmt):
    assert detect_format("auto", columns, "d.jsonl") == fmt


def test_every_format_is_detectable_and_named_in_the_options():
    from hfpipe.data.config import FORMATS

    assert set(FORMATS) == {"auto", *FIELDS}


# ----------------------------------------------------------------------------- formats


def test_alpaca_file_becomes_a_conversation_with_loss_on_the_output(tmp_path, tok):
    (tmp_path / "alpaca_data.json").write_text(json.dumps(ALPACA, indent=4))
    ds = load(tmp_path / "alpaca_data.json", tok)
    users = [ALPACA[0]["instruction"], ALPACA[1]["instruction"] + "\n\n" + ALPACA[1]["input"]]
    for record, user, row in zip(ALPACA, users, ds):
        msgs = [{"role": "user", "content": user}, {"role": "assistant", "content": record["output"]}]
        assert real(row) == encode(tok, chat_text(tok, msgs))
        assert labelled(tok, row) == record["output"] + "<|eos|>"


def test_alpaca_without_a_chat_template_uses_the_alpaca_prompt(tmp_path, tok):
    tok.chat_template = None
    (tmp_path / "a.json").write_text(json.dumps(ALPACA))
    ds = load(tmp_path / "a.json", tok, seq_len=256)  # the tiny tokenizer spends many tokens
    prompt = ("Below is an instruction that describes a task, paired with an input that provides "
              "further context. Write a response that appropriately completes the request.\n\n"
              "### Instruction:\nTranslate the sentence into French.\n\n### Input:\nThe cat sleeps."
              "\n\n### Response:\n")
    assert real(ds[1]) == [BOS] + encode(tok, prompt) + encode(tok, "Le chat dort.") + [EOS]
    assert labelled(tok, ds[1]) == "Le chat dort.<|eos|>"
    assert tok.decode(real(ds[0])).count("### Input") == 0  # empty input: the short prompt


def test_sharegpt_file_maps_human_and_gpt_and_trains_on_gpt_turns(tmp_path, tok):
    ds = load(write_jsonl(tmp_path / "sharegpt.jsonl", SHAREGPT), tok)
    first = [{"role": {"human": "user", "gpt": "assistant"}[t["from"]], "content": t["value"]}
             for t in SHAREGPT[0]["conversations"]]
    assert real(ds[0]) == encode(tok, chat_text(tok, first))
    assert labelled(tok, ds[0]) == ("Splitting a model into stages on different devices.<|eos|>"
                                    "To fit and train bigger models.<|eos|>")
    second = tok.decode(real(ds[1]))
    assert second.startswith("<|system|>Be brief.<|eos|><|user|>Hello")  # the system column
    assert labelled(tok, ds[1]) == "Hi!<|eos|>"


def test_openai_messages_and_sharegpt_keys_render_the_same(tmp_path, tok):
    msgs = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    as_chat = load(write_jsonl(tmp_path / "c.jsonl", [{"messages": msgs}]), tok)
    turns = [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]
    as_sharegpt = load(write_jsonl(tmp_path / "s.jsonl", [{"conversations": turns}]), tok)
    assert as_chat[0] == as_sharegpt[0]


def test_prompt_completion_is_the_instruction_format(tmp_path, tok):
    rows = [{"prompt": "Capital of France? ", "completion": "Paris"}]
    ds = load(write_jsonl(tmp_path / "pc.jsonl", rows), tok)
    assert real(ds[0]) == [BOS] + encode(tok, "Capital of France? ") + encode(tok, "Paris") + [EOS]
    assert labelled(tok, ds[0]) == "Paris<|eos|>"


def test_train_on_prompt_puts_loss_on_every_token(tmp_path, tok):
    rows = [{"prompt": "Capital of France? ", "completion": "Paris"}]
    ds = load(write_jsonl(tmp_path / "pc.jsonl", rows), tok, train_on_prompt=True)
    n = len(real(ds[0]))
    assert ds[0]["labels"][1:n] == ds[0]["input_ids"][1:n]  # all but the segment's first token
    chats = load(write_jsonl(tmp_path / "s.jsonl", SHAREGPT), tok, train_on_prompt=True)
    assert labelled(tok, chats[0]) == tok.decode(real(chats[0])[1:])


# ----------------------------------------------------------------------------- mappings


def test_columns_rename_a_file_onto_a_format(tmp_path, tok):
    rows = [{"question": "Capital of Italy?", "answer": "Rome", "source": "quiz"}]
    path = write_jsonl(tmp_path / "qa.jsonl", rows)
    ds = load(path, tok, columns="question=instruction,answer=output")
    assert labelled(tok, ds[0]) == "Rome<|eos|>"
    as_prompt = load(path, tok, columns={"question": "prompt", "answer": "response"})
    assert real(as_prompt[0]) == [BOS] + encode(tok, "Capital of Italy?") + encode(tok, "Rome") + [EOS]
    with pytest.raises(DataError, match=r"--columns query=prompt: .* has no column 'query'; it has "
                                        r"\[question, answer, source\]"):
        load(path, tok, columns="query=prompt")
    with pytest.raises(DataError, match="--columns answer=reply: 'reply' is not a field any format"):
        load(path, tok, columns="answer=reply")


def test_roles_map_custom_roles_and_unknown_roles_are_errors(tmp_path, tok):
    turns = [{"from": "human", "value": "Hi"}, {"from": "wizard", "value": "Greetings."}]
    path = write_jsonl(tmp_path / "w.jsonl", [{"conversations": turns}] * 2)
    with pytest.raises(DataError) as e:
        load(path, tok)
    assert str(e.value) == (f"{path} line 1: conversations[1] has role 'wizard', which is not one "
                            "of system, user, assistant, tool; map it with --roles "
                            "wizard=assistant (or user, system, tool)")
    ds = load(path, tok, roles="wizard=assistant")
    assert labelled(tok, ds[0]) == "Greetings.<|eos|>"


def test_chat_template_file_replaces_the_tokenizers(tmp_path, tok):
    template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}<|eos|>\n{% endfor %}"
                "{% if add_generation_prompt %}[assistant] {% endif %}")
    (tmp_path / "t.jinja").write_text(template)
    ds = load(write_jsonl(tmp_path / "s.jsonl", SHAREGPT[1:]), tok,
              chat_template=str(tmp_path / "t.jinja"))
    assert tok.decode(real(ds[0])) == ("[system] Be brief.<|eos|>\n[user] Hello<|eos|>\n"
                                       "[assistant] Hi!<|eos|>\n")
    assert labelled(tok, ds[0]) == "Hi!<|eos|>\n"
    tok.chat_template = None  # a file is enough for chat data
    assert len(load(write_jsonl(tmp_path / "s.jsonl", SHAREGPT), tok,
                    chat_template=str(tmp_path / "t.jinja"))) == 2


# ----------------------------------------------------------------------------- errors


def test_a_broken_json_line_is_named_by_its_line_number(tmp_path, tok):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"text": "one"}\n\n{"text": "two"}\n{"text": "three",}\n')
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))} line 4: not valid JSON"):
        load(path, tok)
    (tmp_path / "arr.json").write_text('[\n  {"text": "a"},\n  {"text": "b"\n]\n')
    with pytest.raises(DataError, match=r"arr.json line 4: not valid JSON"):
        load(tmp_path / "arr.json", tok)


def test_a_bad_record_is_named_by_its_line(tmp_path, tok):
    rows = [ALPACA[0], ALPACA[1], {"instruction": "Say hi", "output": 5}]
    path = tmp_path / "a.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n" + json.dumps(rows[2]) + "\n")
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))} line 4: 'output' is number but "
                                        "string on line 1; give each field one type"):
        load(path, tok)  # Arrow cannot even load it: the types are checked line by line
    path.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n" + '{"instruction": "Hi"}\n')
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))} line 4: output must be a "
                                        "string, got NoneType"):
        load(path, tok)


def test_errors_suggest_only_options_that_exist():
    """Every ``--flag`` the data, config and training modules can print is a finetune option."""
    from pathlib import Path

    from typer.main import get_command

    import hfpipe
    from hfpipe.cli.main import app

    command = get_command(app).commands["finetune"]
    flags = {f for p in command.params for f in p.opts + p.secondary_opts}
    root = Path(hfpipe.__file__).parent
    config = [p for p in (root / "config").glob("*.py") if p.name != "options.py"]  # options: other commands'
    files = [*(root / "data").glob("*.py"), *(root / "train").glob("*.py"), *config]
    named = set(re.findall(r"(--[a-z][a-z0-9-]+)", "".join(p.read_text() for p in files)))
    assert "--text-field" not in named and "--columns" in named
    # generate's and export's, in the next: commands after a run; --log-level is hfpipe's own, before the command
    other = {"--help", "--prompt", "--force", "--log-level"}
    assert named - other <= flags, named - other - flags


# ----------------------------------------------------------------------------- eval sets


def test_eval_fraction_holds_out_whole_records(tmp_path, tok):
    texts = [f"record number {i} " + "x" * (i % 5) for i in range(40)]
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in texts])
    cfg = DataConfig(dataset=str(path), seq_len=64, packing=False)
    train, held = load_splits(cfg, tok, eval_fraction=0.25)
    seen = [{tok.decode(real(r)[1:-1]) for r in part} for part in (train, held)]
    assert len(seen[1]) == 10 and len(seen[0]) == 30
    assert seen[0] | seen[1] == set(texts) and not seen[0] & seen[1]
    assert load_splits(cfg, tok, eval_fraction=0.25)[1]["input_ids"] == held["input_ids"]


def test_eval_dataset_uses_the_same_format_options(tmp_path, tok):
    rows = [{"question": "Capital of Italy?", "answer": "Rome"}]
    cfg = DataConfig(dataset=str(write_jsonl(tmp_path / "a.jsonl", rows * 3)), seq_len=64,
                     columns="question=prompt,answer=response")
    other = DataConfig(dataset=str(write_jsonl(tmp_path / "b.jsonl", rows)), seq_len=64,
                       columns="question=prompt,answer=response")
    train, held = load_splits(cfg, tok, eval_cfg=other)
    assert len(held) == 1 and labelled(tok, held[0]) == "Rome<|eos|>"


def test_columns_and_roles_come_from_flags_or_recipe_mappings(tmp_path):
    from hfpipe.config.run import ConfigError, FinetuneConfig

    flags = FinetuneConfig(model="m", columns="question=prompt, answer=response", roles="bot=assistant")
    (tmp_path / "r.yaml").write_text("model: m\ncolumns: {question: prompt, answer: response}\n"
                                     "roles:\n  bot: assistant\n")
    recipe = FinetuneConfig.from_yaml(tmp_path / "r.yaml")
    assert flags.columns == recipe.columns == {"question": "prompt", "answer": "response"}
    assert flags.roles == recipe.roles == {"bot": "assistant"}
    assert FinetuneConfig.from_dict(recipe.to_dict()) == recipe
    with pytest.raises(ConfigError, match="--columns 'question': write NAME=NEW pairs"):
        FinetuneConfig(model="m", columns="question")
