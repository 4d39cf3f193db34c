"""Preference pairs (``--method dpo``): records in TRL's preference formats -> token ids -> TRL's batches.

A record is one of TRL's preference formats (``trl.data_utils``):

- **standard**: ``prompt``, ``chosen``, ``rejected`` strings;
- **conversational**: ``prompt``, ``chosen``, ``rejected`` message lists (``[{role, content}]``);
- **implicit prompt**: only ``chosen`` and ``rejected``, full strings or conversations sharing their
  beginning, which is the prompt (TRL's ``extract_prompt``).

Each record is tokenised as TRL 1.16's ``DPOTrainer._prepare_dataset`` does: the EOS token appended to a
standard completion that lacks it; the prompt, prompt + chosen and prompt + rejected tokenised (strings with
the tokenizer's special tokens, conversations rendered by the chat template, the prompt with the generation
prompt); the completion starts where the prompt's ids and each prompt + completion's ids part
(``common_prefix_length``). A record whose prompt alone fills ``seq_len`` is dropped, as TRL drops it under
``max_length`` (keep_start truncation). Batches are TRL's own ``DataCollatorForPreference``'s: rows
``[all chosen; all rejected]``, ``input_ids``, ``attention_mask``, ``completion_mask``, each sequence cut to
``seq_len``, and ``ref_chosen_logps``/``ref_rejected_logps`` once the reference pass has added them.

TRL is the optional extra ``trl``; it is imported where a function needs it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from hfpipe.data.batches import epoch_sampler
from hfpipe.data.config import DataError
from hfpipe.data.formats import DEFAULT_ROLES, parse_turns
from hfpipe.data.template import render_chat, template_file

__all__ = ["PAIR_COLUMNS", "REFERENCE_FILE", "REF_COLUMNS", "TokenisePairs", "collate_pairs", "iterate_pairs", "pair_record",
           "pairs_digest", "require_trl"]

#: The columns of a tokenised pair (TRL's names).
PAIR_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")
#: The reference log-probs the reference pass adds to each pair (TRL's names).
REF_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")
#: The run folder's file of those log-probs, one per pair in the pairs' order (:mod:`hfpipe.train.preference`).
REFERENCE_FILE = "reference_logps.safetensors"


def require_trl(flag: str = "--method dpo") -> None:
    """Refuse in one line when TRL (the ``trl`` extra) is missing."""
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        raise DataError(f"{flag} needs TRL: pip install 'hfpipe[trl]'")


def pair_record(record: dict, roles: dict[str, str]) -> dict:
    """One record as TRL's explicit-prompt form ``{prompt, chosen, rejected}``: strings, or message lists.

    Message lists are checked and their roles mapped (``--roles``) as the chat formats' are; Arrow's missing
    keys (``None``) are dropped, so the template sees the messages as written.

    Raises:
        DataError: a missing or mistyped field, strings mixed with messages, or a pair with nothing to compare
            (the caller adds the file and line).
    """
    from trl.data_utils import extract_prompt

    names = [k for k in ("prompt", "chosen", "rejected") if record.get(k) is not None]
    for key in ("chosen", "rejected"):
        if key not in names:
            raise DataError(f"a preference record needs {key!r} (a string or a list of messages)")
    kinds = {k: _kind(record[k], k) for k in names}
    if len(set(kinds.values())) > 1:
        raise DataError("prompt, chosen and rejected must all be strings or all be message lists; got "
                        + ", ".join(f"{k} as {v}" for k, v in kinds.items()))
    roles = {**DEFAULT_ROLES, **roles}
    pair = {k: parse_turns(record[k], k, roles) if kinds[k] == "messages" else record[k] for k in names}
    if "prompt" not in pair:  # implicit: the shared beginning is the prompt
        pair = extract_prompt({"chosen": pair["chosen"], "rejected": pair["rejected"]})
        if not pair["prompt"]:
            raise DataError("chosen and rejected share no beginning, so the record has no prompt; add a "
                            "'prompt' field")
    for key in ("chosen", "rejected"):
        if not pair[key]:
            raise DataError(f"{key} is empty after the prompt; give each completion some text")
    return pair


def _kind(value, key: str) -> str:
    if isinstance(value, str):
        return "string"
    if isinstance(value, list) and value:
        return "messages"
    raise DataError(f"{key} must be a string or a non-empty list of messages, got {type(value).__name__}")


def _prefix(a: list[int], b: list[int]) -> int:
    from trl.data_utils import common_prefix_length

    return common_prefix_length(a, b)


@dataclass
class TokenisePairs:
    """``datasets.map`` body: raw preference records -> :data:`PAIR_COLUMNS`, and why a pair is dropped.

    Attributes:
        tok: The tokenizer.
        roles: ``--roles``.
        template: ``--chat-template``'s text, or None for the tokenizer's own.
        seq_len: TRL's ``max_length``: a pair whose prompt fills it is dropped.
        locate: Record index -> ``FILE line N`` (picklable), for error messages.
        template_file: ``--chat-template``'s path, to name it in errors.
    """

    tok: object
    roles: dict
    template: str | None
    seq_len: int
    locate: object
    template_file: str | None = None

    def __call__(self, batch, indices):
        out = {c: [] for c in PAIR_COLUMNS} | {"dropped": []}
        for k, index in enumerate(indices):
            record = {c: v[k] for c, v in batch.items()}
            try:
                ids = self.one(record)
            except DataError as e:  # only now find the line: locating reads the file
                raise DataError(f"{self.locate(index)}: {e}") from None
            long = len(ids[0]) >= self.seq_len  # TRL drops it: keep_start truncation leaves no completion
            for column, value in zip(PAIR_COLUMNS, ids):
                out[column].append([] if long else value)
            out["dropped"].append("a prompt of --seq-len tokens or more" if long else "")
        return out

    def one(self, record: dict) -> tuple[list[int], list[int], list[int]]:
        """One record's ``(prompt_ids, chosen_ids, rejected_ids)``, as TRL's ``tokenize_fn`` makes them."""
        pair = pair_record(record, self.roles)
        if isinstance(pair["prompt"], str):
            prompt, chosen, rejected = self._standard(pair)
        else:
            prompt, chosen, rejected = self._conversational(pair)
        start = min(_prefix(prompt, chosen), _prefix(prompt, rejected))
        return prompt[:start], chosen[start:], rejected[start:]

    def _standard(self, pair: dict):
        eos = getattr(self.tok, "eos_token", None)
        if eos is None:
            raise DataError("standard (string) preference data needs the tokenizer's EOS token to end each "
                            "completion, and this tokenizer has none")
        # TRL appends EOS as text to a completion that does not end with it, then tokenises with specials
        ends = {k: pair[k] if pair[k].endswith(eos) else pair[k] + eos for k in ("chosen", "rejected")}
        enc = [self.tok(text=t)["input_ids"] for t in
               (pair["prompt"], pair["prompt"] + ends["chosen"], pair["prompt"] + ends["rejected"])]
        return tuple(enc)

    def _conversational(self, pair: dict):
        if not (self.template or getattr(self.tok, "chat_template", None)):
            raise DataError("conversational preference data needs a chat template; pass --chat-template FILE, "
                            "or use a tokenizer that has one")
        where = template_file(self.tok, self.template_file)

        def ids(messages, generation: bool) -> list[int]:
            # apply_chat_template(tokenize=True), which TRL calls, is this rendering tokenised without specials;
            # rendered here so a failing or sandbox-escaping template is named in one line
            text = render_chat(self.tok, messages, self.template, where, add_generation_prompt=generation)
            return self.tok(text, add_special_tokens=False)["input_ids"]

        prompt = pair["prompt"]
        return ids(prompt, True), ids(prompt + pair["chosen"], False), ids(prompt + pair["rejected"], False)


def collate_pairs(rows: list[dict], *, pad_id: int, seq_len: int, multiple: int | None = None) -> dict:
    """TRL's ``DataCollatorForPreference`` batch of ``rows`` (each :data:`PAIR_COLUMNS`, maybe
    :data:`REF_COLUMNS`): rows ``[all chosen; all rejected]``, each cut to ``seq_len`` (``max_length``, keep_start)
    and padded to the longest, rounded up to ``multiple`` (a cp or tp split needs it)."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    collate = DataCollatorForPreference(pad_token_id=pad_id, max_length=seq_len, pad_to_multiple_of=multiple)
    return collate(rows)


def iterate_pairs(ds, *, batch_size: int, seed: int, epoch: int, dp_rank: int = 0, dp_size: int = 1,
                  start: int = 0, pad_id: int, seq_len: int, multiple: int | None = None) -> Iterator[dict]:
    """This rank's preference batches of one epoch: ``batch_size`` pairs each (``2 * batch_size`` rows), in the
    order :class:`hfpipe.data.batches.BatchSampler` gives SFT rows."""
    sampler = epoch_sampler(len(ds), what="preference pairs", fix="lower --batch-size or add data",
                            batch_size=batch_size, seed=seed, epoch=epoch, dp_rank=dp_rank, dp_size=dp_size,
                            start=start)
    columns = [c for c in (*PAIR_COLUMNS, *REF_COLUMNS) if c in ds.column_names]
    for indices in sampler:
        part = ds.select_columns(columns)[indices]
        rows = [dict(zip(columns, values)) for values in zip(*(part[c] for c in columns))]
        yield collate_pairs(rows, pad_id=pad_id, seq_len=seq_len, multiple=multiple)


def pairs_digest(ds) -> str:
    """A digest of the pairs' token ids, in order: what a stored reference pass was computed on."""
    import numpy as np
    import xxhash  # a dependency of datasets, declared by hfpipe too

    h = xxhash.xxh3_64()
    for batch in ds.select_columns(list(PAIR_COLUMNS)).iter(batch_size=1024):
        for column in PAIR_COLUMNS:
            for ids in batch[column]:
                h.update(np.asarray([len(ids), *ids], dtype=np.int64).tobytes())
    return h.hexdigest()
