"""Spec of preference data (``--method dpo``): TRL's formats give the tokens TRL's DPOTrainer gives them.

The oracle is TRL 1.16's own ``DPOTrainer._prepare_dataset`` (run unbound: it reads only the tokenizer and
``max_length``/``truncation_mode``) and its ``DataCollatorForPreference``, on the same records.
"""

from types import SimpleNamespace

import datasets
import pytest

pytest.importorskip("trl")

from trl.trainer.dpo_trainer import DataCollatorForPreference, DPOTrainer  # noqa: E402

from hfpipe.data.config import DataConfig, DataError  # noqa: E402
from hfpipe.data.load import load_pairs  # noqa: E402
from hfpipe.data.preference import PAIR_COLUMNS, iterate_pairs, pairs_digest  # noqa: E402
from hfpipe.tiny import make_tiny_tokenizer  # noqa: E402
from test_data_pipeline import write_jsonl  # noqa: E402


def _turn(role, text):
    return {"role": role, "content": text}


# TRL's documented preference formats, one file each.
STANDARD = [
    {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
    {"prompt": "Pipelines split", "chosen": " a model into stages.<|eos|>", "rejected": " nothing at all."},
]
IMPLICIT_STANDARD = [
    {"chosen": "The sky is blue.", "rejected": "The sky is green."},
    {"chosen": "Two and two make four.", "rejected": "Two and two make five."},
]
CONVERSATIONAL = [
    {"prompt": [_turn("user", "What color is the sky?")],
     "chosen": [_turn("assistant", "It is blue.")], "rejected": [_turn("assistant", "It is green.")]},
    {"prompt": [_turn("system", "Be brief."), _turn("user", "Where is the sun?")],
     "chosen": [_turn("assistant", "In the sky.")], "rejected": [_turn("assistant", "In the sea, under water.")]},
]
IMPLICIT_CONVERSATIONAL = [
    {"chosen": [_turn("user", "Hello"), _turn("assistant", "Hi! How can I help?")],
     "rejected": [_turn("user", "Hello"), _turn("assistant", "Go away.")]},
    {"chosen": [_turn("user", "2+2?"), _turn("assistant", "4"), _turn("user", "and 3+3?"), _turn("assistant", "6")],
     "rejected": [_turn("user", "2+2?"), _turn("assistant", "4"), _turn("user", "and 3+3?"),
                  _turn("assistant", "7")]},
]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    datasets.disable_progress_bars()


tok = pytest.fixture(scope="module", name="tok")(make_tiny_tokenizer)


def trl_rows(records, tok, max_length):
    """TRL's tokenised pairs of ``records``, by its own code."""
    args = SimpleNamespace(dataset_num_proc=None, max_length=max_length, truncation_mode="keep_start")
    ds = DPOTrainer._prepare_dataset(SimpleNamespace(_tokenizer=tok), datasets.Dataset.from_list(records), tok,
                                     args, "train")
    return [{c: row[c] for c in PAIR_COLUMNS} for row in ds]


@pytest.mark.parametrize("records", [STANDARD, IMPLICIT_STANDARD, CONVERSATIONAL, IMPLICIT_CONVERSATIONAL],
                         ids=["standard", "implicit-standard", "conversational", "implicit-conversational"])
def test_each_format_tokenises_as_trl(tmp_path, tok, records):
    ours = load_pairs(DataConfig(dataset=str(write_jsonl(tmp_path / "p.jsonl", records)), seq_len=64), tok)
    theirs = trl_rows(records, tok, 64)
    assert [{c: row[c] for c in PAIR_COLUMNS} for row in ours] == theirs
    assert all(row["chosen_ids"] and row["rejected_ids"] for row in theirs)


def test_a_prompt_that_fills_seq_len_is_dropped_as_trl_drops_it(tmp_path, tok):
    records = CONVERSATIONAL + [{"prompt": [_turn("user", "word " * 60)], "chosen": [_turn("assistant", "a")],
                                 "rejected": [_turn("assistant", "b")]}]
    path = write_jsonl(tmp_path / "p.jsonl", records)
    ours = load_pairs(DataConfig(dataset=str(path), seq_len=24), tok)
    assert [{c: row[c] for c in PAIR_COLUMNS} for row in ours] == trl_rows(records, tok, 24)
    assert len(ours) == 2


def test_batches_are_trls_collated_batches(tmp_path, tok):
    """Rows [all chosen; all rejected], completion masks and truncation at seq_len: TRL's collator's."""
    records = CONVERSATIONAL * 2
    ours = load_pairs(DataConfig(dataset=str(write_jsonl(tmp_path / "p.jsonl", records)), seq_len=24), tok)
    batches = list(iterate_pairs(ours, batch_size=2, seed=0, epoch=0, pad_id=tok.pad_token_id, seq_len=24))
    assert len(batches) == 2
    theirs = trl_rows(records, tok, 24)
    order = [i for b in range(2) for i in _sampled(len(records), b)]
    collate = DataCollatorForPreference(pad_token_id=tok.pad_token_id, max_length=24)
    for b, batch in enumerate(batches):
        expected = collate([theirs[i] for i in order[2 * b:2 * b + 2]])
        assert batch.keys() == expected.keys() == {"input_ids", "attention_mask", "completion_mask"}
        for key in expected:
            assert batch[key].tolist() == expected[key].tolist()
        assert batch["input_ids"].shape[0] == 4 and batch["input_ids"].shape[1] <= 24


def _sampled(n, b):
    from hfpipe.data.batches import BatchSampler

    return list(BatchSampler(n, batch_size=2, seed=0, epoch=0))[b]


def test_the_digest_follows_the_token_ids(tmp_path, tok):
    a = load_pairs(DataConfig(dataset=str(write_jsonl(tmp_path / "a.jsonl", STANDARD)), seq_len=64), tok)
    b = load_pairs(DataConfig(dataset=str(write_jsonl(tmp_path / "b.jsonl", STANDARD[::-1])), seq_len=64), tok)
    assert pairs_digest(a) == pairs_digest(a.select(range(len(a))))
    assert pairs_digest(a) != pairs_digest(b)


@pytest.mark.parametrize("rows, line, says", [
    ([STANDARD[0], {"prompt": "Hi", "chosen": "there"}], 2, "needs 'rejected'"),
    ([CONVERSATIONAL[0], {"prompt": [_turn("user", "Hi")], "chosen": [_turn("wizard", "x")],
                          "rejected": [_turn("assistant", "y")]}], 2, "role 'wizard'"),
    ([{"prompt": "Hi", "chosen": [_turn("assistant", "x")], "rejected": [_turn("assistant", "y")]}], 1,
     "all be strings or all be message lists"),
    ([IMPLICIT_CONVERSATIONAL[0], {"chosen": [_turn("user", "a"), _turn("assistant", "x")],
                                   "rejected": [_turn("user", "b"), _turn("assistant", "y")]}],
     2, "share no beginning"),
], ids=["missing-rejected", "unknown-role", "strings-and-messages", "no-shared-prompt"])
def test_a_bad_record_is_refused_in_one_line_naming_file_and_line(tmp_path, tok, rows, line, says):
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    with pytest.raises(DataError) as e:
        load_pairs(DataConfig(dataset=str(path), seq_len=64), tok)
    assert f"{path} line {line}:" in str(e.value) and says in str(e.value)
    assert "\n" not in str(e.value)


def test_data_without_chosen_and_rejected_is_refused_naming_the_columns(tmp_path, tok):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "response": "b"}])
    with pytest.raises(DataError, match=r"has columns \[prompt, response\]; preference data needs 'chosen'"):
        load_pairs(DataConfig(dataset=str(path), seq_len=64), tok)


def test_the_builtin_preference_set_loads_offline_and_sft_names_the_method(tok):
    from hfpipe.data.load import load_examples

    pairs = load_pairs(DataConfig(dataset="builtin:tiny-preference", seq_len=512), tok)
    assert len(pairs) == 64 and all(row["chosen_ids"] != row["rejected_ids"] for row in pairs)
    with pytest.raises(DataError, match="'chosen' and 'rejected' are preference pairs: train them with --method dpo"):
        load_examples(DataConfig(dataset="builtin:tiny-preference", seq_len=128), tok)
