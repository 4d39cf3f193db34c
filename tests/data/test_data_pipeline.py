"""Spec of hfpipe.data: what each format trains on, how rows are packed, how batches are dealt."""

import json

import datasets
import pytest
import torch

from hfpipe.data.batches import batches_per_epoch, iterate_batches
from hfpipe.data.config import BUILTIN_DATASETS, COLUMNS, DataConfig, DataError, check_seq_len
from hfpipe.data.load import load_examples
from hfpipe.loss.tokens import IGNORE_INDEX
from hfpipe.tiny import make_tiny_tokenizer, tiny_config

BOS, EOS, PAD = 1, 2, 0  # the tiny tokenizer's specials
TEXTS = ["Hello world!", "The quick brown fox jumps over the lazy dog.", "Numbers: 1 2 3."]
CHATS = [
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "It is 4."}],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": "Rome, of course."},
    ],
    [{"role": "user", "content": "A turn nobody answers."}],  # nothing to learn: dropped
]
# Chat templates, and the labelled text of CHATS[0] and CHATS[1] under each.
TEMPLATES = {
    "tiny": (None, ["It is 4.<|eos|>", "Paris.<|eos|>Rome, of course.<|eos|>"]),
    "bos-and-newlines": (  # ChatML-like: BOS from the template, "\n" closes each turn
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|eos|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}",
        ["It is 4.<|eos|>\n", "Paris.<|eos|>\nRome, of course.<|eos|>\n"],
    ),
    "rewrites-history": (  # only the last reply gets a marker: with 2 replies prefixes are unstable
        "{% for m in messages %}<|{{ m['role'] }}|>{% if loop.last and m['role'] == 'assistant' %}"
        "[final]{% endif %}{{ m['content'] }}<|eos|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}",
        ["[final]It is 4.<|eos|>", "Paris.<|eos|>Rome, of course.<|eos|>"],
    ),
}


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    datasets.disable_progress_bars()


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer()


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def load(path, tok, **kw):
    return load_examples(DataConfig(dataset=str(path), **kw), tok)


def labelled(tok, row) -> str:
    return tok.decode([t for t, y in zip(row["input_ids"], row["labels"]) if y != IGNORE_INDEX])


def real(row) -> list[int]:
    return [t for t, m in zip(row["input_ids"], row["attention_mask"]) if m]


def encode(tok, text) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


# ----------------------------------------------------------------------------- formats


def test_text_trains_on_every_token_after_bos(tmp_path, tok):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in TEXTS])
    ds = load(path, tok, seq_len=64, packing=False)
    assert len(ds) == len(TEXTS)
    for text, row in zip(TEXTS, ds):
        assert real(row) == [BOS] + encode(tok, text) + [EOS]
        assert labelled(tok, row) == text + "<|eos|>"
        n = len(real(row))
        assert row["labels"][0] == IGNORE_INDEX and row["labels"][1:n] == row["input_ids"][1:n]


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_chat_trains_on_assistant_turns_only(template, tmp_path):
    tok = make_tiny_tokenizer()
    source, expected = TEMPLATES[template]
    tok.chat_template = source or tok.chat_template
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": m} for m in CHATS])
    ds = load(path, tok, seq_len=128, packing=False)
    assert [labelled(tok, row) for row in ds] == expected  # CHATS[2] has no reply: dropped
    for msgs, row in zip(CHATS, ds):
        assert real(row) == encode(tok, tok.apply_chat_template(msgs, tokenize=False))
        assert real(row).count(BOS) == (template == "bos-and-newlines")


def test_instruction_trains_on_response_and_eos(tmp_path, tok):
    rows = [{"prompt": "French 'chat': ", "response": "cat"}, {"prompt": "2+2=", "response": "4"}]
    ds = load(write_jsonl(tmp_path / "i.jsonl", rows), tok, seq_len=64, packing=False)
    for r, row in zip(rows, ds):
        assert real(row) == [BOS] + encode(tok, r["prompt"]) + encode(tok, r["response"]) + [EOS]
        assert labelled(tok, row) == r["response"] + "<|eos|>"


def test_format_auto_prefers_instruction_and_columns_rename_a_text_column(tmp_path, tok):
    rows = [{"body": t, "prompt": "Q", "response": t} for t in TEXTS]
    path = write_jsonl(tmp_path / "x.jsonl", rows)
    by_auto = load(path, tok, seq_len=64, packing=False)
    by_text = load(path, tok, seq_len=64, packing=False, format="text", columns="body=text")
    assert labelled(tok, by_auto[0]) == TEXTS[0] + "<|eos|>"
    assert real(by_text[0]) == [BOS] + encode(tok, TEXTS[0]) + [EOS]


# ----------------------------------------------------------------------------- rows


def test_unpacked_rows_are_right_padded_or_truncated(tmp_path, tok):
    long = "word " * 40
    ds = load(write_jsonl(tmp_path / "t.jsonl", [{"text": "Hi"}, {"text": long}]), tok,
              seq_len=16, packing=False)
    short, cut = ds[0], ds[1]
    n, pad = 1 + len(encode(tok, "Hi")) + 1, 16 - (1 + len(encode(tok, "Hi")) + 1)
    assert short["attention_mask"] == [1] * n + [0] * pad
    assert short["input_ids"][n:] == [PAD] * pad and short["labels"][n:] == [IGNORE_INDEX] * pad
    assert short["position_ids"] == list(range(16))  # padding keeps counting
    assert cut["input_ids"] == ([BOS] + encode(tok, long))[:16] and sum(cut["attention_mask"]) == 16


def test_packing_restarts_positions_at_each_document(tmp_path, tok):
    texts = [f"Document {i}: " + "abc " * (i % 7) for i in range(40)]
    ds = load(write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in texts]), tok, seq_len=32)
    stream = []
    for k, row in enumerate(ds):
        ids, pos, labels, n = row["input_ids"], row["position_ids"], row["labels"], len(real(row))
        assert row["attention_mask"] == [1] * n + [0] * (32 - n)
        assert n == 32 or k == len(ds) - 1  # only the final row is padded
        for i in range(n):
            # a segment starts at each BOS, and at the row start (a document cut at a row end)
            starts = ids[i] == BOS or i == 0
            assert pos[i] == (0 if starts else pos[i - 1] + 1)
            assert labels[i] == (IGNORE_INDEX if starts else ids[i])
        assert labels[n:] == [IGNORE_INDEX] * (32 - n)
        stream += ids[:n]
    # each document appears whole and once in the concatenated rows (in --seed order)
    at = [i for i, t in enumerate(stream) if t == BOS] + [len(stream)]
    docs = [stream[a:b] for a, b in zip(at, at[1:])]
    assert at[0] == 0 and sorted(docs) == sorted([BOS] + encode(tok, t) + [EOS] for t in texts)


def test_packed_rows_attend_within_documents_in_transformers(tmp_path, tok):
    from transformers import LlamaForCausalLM

    texts = ["One two three.", "Four five six seven.", "Eight nine ten eleven twelve."] * 3
    ds = load(write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in texts]), tok, seq_len=48)
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config("llama")).eval()
    row = ds.with_format("torch")[0]
    ids, pos = row["input_ids"][None].long(), row["position_ids"][None].long()
    bounds = (pos[0] == 0).nonzero().flatten().tolist() + [48]
    assert len(bounds) >= 3  # at least two documents share the row
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=pos, attention_mask=None, use_cache=False)
        for a, b in zip(bounds, bounds[1:]):
            alone = model(input_ids=ids[:, a:b], use_cache=False)
            torch.testing.assert_close(packed.logits[:, a:b], alone.logits)


# ----------------------------------------------------------------------------- batches


def fake_rows(n, seq_len=4):
    """Row i is all i, so a batch shows which rows it holds."""
    return datasets.Dataset.from_dict({c: [[i] * seq_len for i in range(n)] for c in COLUMNS})


def epoch(ds, **kw) -> list[list[int]]:
    return [b["input_ids"][:, 0].tolist() for b in iterate_batches(ds, **kw)]


def test_batches_are_int64_and_shuffled_by_seed_and_epoch():
    ds = fake_rows(50)
    batch = next(iterate_batches(ds, batch_size=5, seed=1, epoch=0))
    assert all(batch[c].dtype == torch.int64 and batch[c].shape == (5, 4) for c in COLUMNS)
    one = epoch(ds, batch_size=5, seed=1, epoch=0)
    assert one == epoch(ds, batch_size=5, seed=1, epoch=0)
    assert one != epoch(ds, batch_size=5, seed=2, epoch=0)
    assert one != epoch(ds, batch_size=5, seed=1, epoch=1)
    assert sorted(sum(one, [])) == list(range(50))


def test_dp_ranks_take_contiguous_slices_of_each_global_batch():
    ds, bs, dp = fake_rows(103), 4, 3
    assert batches_per_epoch(ds, bs, dp) == 103 // 12 == 8
    ranks = [epoch(ds, batch_size=bs, seed=0, epoch=2, dp_rank=r, dp_size=dp) for r in range(dp)]
    whole = epoch(ds, batch_size=bs * dp, seed=0, epoch=2)
    assert [ranks[0][i] + ranks[1][i] + ranks[2][i] for i in range(8)] == whole
    seen = sum((sum(r, []) for r in ranks), [])
    assert len(seen) == len(set(seen)) == 96  # each row at most once; the last 7 rows wait


def test_start_resumes_with_exactly_the_remaining_batches():
    ds, kw = fake_rows(40), dict(batch_size=3, seed=7, epoch=1, dp_size=2)
    full = epoch(ds, dp_rank=1, **kw)
    assert len(full) == 6 and epoch(ds, dp_rank=1, start=4, **kw) == full[4:]
    assert epoch(ds, start=6, **kw) == []
    with pytest.raises(ValueError, match="start=7"):
        epoch(ds, start=7, **kw)


def test_fewer_rows_than_a_global_batch_is_an_error():
    with pytest.raises(DataError, match="fewer than one global batch of 8"):
        epoch(fake_rows(7), batch_size=4, seed=0, epoch=0, dp_size=2)


# ----------------------------------------------------------------------------- sources


def write_source(kind, tmp_path):
    """TEXTS as a ``kind`` source; returns its path."""
    if kind == "txt":
        (tmp_path / "d.txt").write_text("\n".join(TEXTS) + "\n\n")  # blank lines are skipped
    elif kind == "jsonl":
        write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in TEXTS])
    elif kind == "json":
        (tmp_path / "d.json").write_text(json.dumps([{"text": t} for t in TEXTS]))
    elif kind == "parquet":
        datasets.Dataset.from_dict({"text": TEXTS}).to_parquet(tmp_path / "d.parquet")
    elif kind == "csv":
        datasets.Dataset.from_dict({"text": TEXTS}).to_csv(tmp_path / "d.csv")
    else:
        datasets.Dataset.from_dict({"text": TEXTS}).save_to_disk(tmp_path / "saved")
        arrow = next((tmp_path / "saved").glob("*.arrow"))
        return tmp_path / "saved" if kind == "folder" else arrow
    return tmp_path / f"d.{kind}"


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "txt", "arrow", "csv", "folder"])
def test_local_sources(kind, tmp_path, tok):
    ds = load(write_source(kind, tmp_path), tok, seq_len=64, packing=False)
    assert sorted(tok.decode(real(r)[1:-1]) for r in ds) == sorted(TEXTS)


def test_saved_dataset_dict_gives_the_split(tmp_path, tok):
    splits = {"train": TEXTS, "test": ["held out"]}
    datasets.DatasetDict({k: datasets.Dataset.from_dict({"text": v}) for k, v in splits.items()}
                         ).save_to_disk(tmp_path / "dd")
    ds = load(tmp_path / "dd", tok, seq_len=32, packing=False, split="test")
    assert [tok.decode(real(r)[1:-1]) for r in ds] == ["held out"]
    with pytest.raises(DataError, match="--split valid is not in"):
        load(tmp_path / "dd", tok, split="valid")


def test_hub_ids_go_to_load_dataset(monkeypatch, tok):
    calls = []

    def fake(*args, **kwargs):
        calls.append((args, kwargs))
        if args[0] == "org/missing":
            raise ConnectionError("Couldn't reach 'org/missing' on the Hub (OfflineModeIsEnabled)")
        return datasets.Dataset.from_dict({"text": TEXTS})

    monkeypatch.setattr(datasets, "load_dataset", fake)
    cfg = DataConfig(dataset="org/name", dataset_config="cfg", split="train[:2]", seq_len=32)
    assert len(load_examples(cfg, tok)) > 0
    assert calls == [(("org/name", "cfg"), {"split": "train[:2]"})]
    with pytest.raises(DataError, match=r"^--dataset org/missing could not be loaded \(Conn"):
        load_examples(DataConfig(dataset="org/missing"), tok)


@pytest.mark.parametrize("name", sorted(set(BUILTIN_DATASETS) - {"tiny-preference"}))  # pairs: test_data_preference
def test_builtin_datasets_load_offline(name, tok):
    ds = load_examples(DataConfig(dataset=f"builtin:{name}", seq_len=128), tok)
    assert len(ds) > 100 and all(any(y != IGNORE_INDEX for y in r) for r in ds["labels"][:20])
    assert sum(p.stat().st_size for p in BUILTIN_DATASETS.values()) < 500_000


def test_tokenisation_is_cached_by_datasets(tmp_path, tok):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in TEXTS])
    first, again = load(path, tok, seq_len=32), load(path, tok, seq_len=32)
    assert first.cache_files and first.cache_files == again.cache_files
    assert load(path, tok, seq_len=16).cache_files != first.cache_files


# ----------------------------------------------------------------------------- errors


def test_missing_fields_name_the_columns_found_and_needed(tmp_path, tok):
    path = write_jsonl(tmp_path / "x.jsonl", [{"a": 1, "b": 2}])
    with pytest.raises(DataError) as e:
        load(path, tok)
    assert str(e.value) == (
        f"--dataset {path} has columns [a, b]; chat needs 'messages'; sharegpt needs "
        "'conversations'; alpaca needs 'instruction' and 'output'; instruction needs 'prompt' and "
        "'response' or 'completion'; text needs 'text'. Rename columns with --columns "
        "COLUMN=FIELD (e.g. --columns question=prompt,answer=response)")
    with pytest.raises(DataError, match=r"has columns \[a, b\]; chat needs 'messages'\. Rename"):
        load(path, tok, format="chat")


def test_bad_rows_are_named(tmp_path, tok):
    rows = [{"messages": CHATS[0]}, {"messages": [{"role": "user"}]}]
    with pytest.raises(DataError, match=r"c.jsonl line 2: messages\[0\] needs a string role"):
        load(write_jsonl(tmp_path / "c.jsonl", rows), tok)
    rows = [{"prompt": "a", "response": "b"}, {"prompt": "a", "response": None}]
    with pytest.raises(DataError, match="i.jsonl line 2: response must be a string, got NoneType"):
        load(write_jsonl(tmp_path / "i.jsonl", rows), tok)


def test_bad_paths(tmp_path, tok):
    with pytest.raises(DataError, match="missing.jsonl does not exist"):
        load(tmp_path / "missing.jsonl", tok)
    with pytest.raises(DataError, match="^--dataset data/train/x does not exist"):
        load_examples(DataConfig(dataset="data/train/x"), tok)
    (tmp_path / "d.xml").write_text("<a/>")
    with pytest.raises(DataError, match="unknown file type '.xml'"):
        load(tmp_path / "d.xml", tok)
    with pytest.raises(DataError, match="--split"):
        load(write_source("jsonl", tmp_path), tok, split="validation")


def test_chat_needs_a_chat_template(tmp_path):
    tok = make_tiny_tokenizer()
    tok.chat_template = None
    with pytest.raises(DataError, match="has no chat template; pass --chat-template FILE"):
        load(write_jsonl(tmp_path / "c.jsonl", [{"messages": CHATS[0]}]), tok)


def test_seq_len_above_the_model_limit():
    from transformers import LlamaConfig

    with pytest.raises(DataError) as e:
        check_seq_len(9000, LlamaConfig(max_position_embeddings=8192))
    assert str(e.value) == (
        "--seq-len 9000 exceeds the model's max_position_embeddings 8192; lower --seq-len"
    )
    check_seq_len(8192, LlamaConfig(max_position_embeddings=8192))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(format="markdown"), "--format 'markdown' is unknown"),
        (dict(seq_len=1), "--seq-len 1 must"),
        (dict(seq_len="512"), "--seq-len '512' must"),
        (dict(dataset="builtin:nope"), "--dataset builtin:nope is not a builtin"),
        (dict(dataset=" "), "--dataset is empty"),
        (dict(split=""), "--split is empty"),
        (dict(seed=-1), "--seed -1 must"),
        (dict(packing="yes"), "--packing 'yes' must"),
        (dict(dataset_config=""), "--dataset-config is empty"),
        (dict(columns="a"), "--columns 'a': write NAME=NEW pairs"),
        (dict(roles="wizard=wizard"), "--roles wizard=wizard: 'wizard' is not a chat role"),
        (dict(chat_template="missing.jinja"), "--chat-template missing.jinja is not a file"),
        (dict(train_on_prompt="yes"), "--train-on-prompt 'yes' must"),
    ],
)
def test_config_errors_name_the_flag(kwargs, message):
    with pytest.raises(DataError, match="^" + message):
        DataConfig(**kwargs)
