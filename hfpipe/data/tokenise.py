"""Documents as token ids and labels: which tokens carry loss in each kind of document.

- text: BOS (if any) + text + EOS, loss on every token.
- instruction: BOS + prompt + response + EOS, loss on the response and EOS.
- chat: the chat template's rendering, tokenised once as at inference, loss on the characters
  of assistant turns (:func:`assistant_spans`).

``train_on_prompt`` puts loss on every token of instruction and chat documents.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

from hfpipe.data.config import DataError
from hfpipe.data.formats import alpaca_prompt, document
from hfpipe.data.template import render_chat, template_file
from hfpipe.loss.tokens import IGNORE_INDEX

__all__ = ["Tokenise", "assistant_spans"]


def _encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _bos(tok) -> list[int]:
    return [tok.bos_token_id] if tok.bos_token_id is not None else []


def _eos(tok) -> list[int]:
    return [tok.eos_token_id] if tok.eos_token_id is not None else []


def _text_doc(tok, text: str) -> tuple[list[int], list[int]]:
    ids = _bos(tok) + _encode(tok, text) + _eos(tok)
    return ids, list(ids)


def _instruction_doc(tok, prompt: str, response: str, train_on_prompt: bool):
    head, tail = _bos(tok) + _encode(tok, prompt), _encode(tok, response) + _eos(tok)
    return head + tail, (head if train_on_prompt else [IGNORE_INDEX] * len(head)) + tail


def _chat_doc(tok, messages: list[dict], template: str | None, train_on_prompt: bool, where: str | None = None):
    """The rendering tokenised once (the template adds its own BOS, if any); loss by character.

    A token carries loss when its first character lies in a span from :func:`assistant_spans`.
    """
    text, spans = assistant_spans(tok, messages, template, where)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    if train_on_prompt:
        return enc["input_ids"], list(enc["input_ids"])
    starts, labels = [s for s, _ in spans], []
    for token, (a, b) in zip(enc["input_ids"], enc["offset_mapping"], strict=True):
        k = bisect_right(starts, a) - 1
        labels.append(token if k >= 0 and a < spans[k][1] and b > a else IGNORE_INDEX)
    return enc["input_ids"], labels


def assistant_spans(tok, messages: list[dict], template: str | None = None, where: str | None = None):
    """The rendered conversation and the ``[start, end)`` character spans that carry loss.

    Incremental prefixes first: assistant turn ``i`` is what rendering ``messages[:i+1]`` adds to
    ``messages[:i]`` rendered with the generation prompt, i.e. the reply and the template's
    end-of-turn text, without the role header. That needs prefix renderings to be prefixes of the
    whole. Templates that rewrite history (e.g. drop reasoning from earlier turns) are not; then
    each message's content is found in order in the full rendering, and an assistant span is its
    content plus a special token (the end-of-turn marker) directly after it. ``where`` names the
    template's file in errors (:mod:`hfpipe.data.template`: a template that fails, leaves the
    sandbox or drops a message's text is refused).
    """
    where = where or template_file(tok)

    def render(msgs, gen, check=False):
        # transformers renders in its sandboxed Jinja environment: a template runs no code
        return render_chat(tok, msgs, template, where, add_generation_prompt=gen, check=check)

    full = render(messages, False, check=True)
    try:
        spans = _prefix_spans(render, messages, full)
    except Exception:  # noqa: BLE001 - a template may reject a prefix (e.g. no user turn yet)
        spans = None
    return full, _search_spans(tok, messages, full) if spans is None else spans


def _prefix_spans(render, messages: list[dict], full: str) -> list[tuple[int, int]] | None:
    """Spans from incremental renderings, or None if a rendering is not a prefix of the next."""
    spans = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            head = render(messages[:i], True) if i else ""
            done = render(messages[: i + 1], False)
            if not (done.startswith(head) and full.startswith(done)):
                return None
            spans.append((len(head), len(done)))
    return spans


def _search_spans(tok, messages: list[dict], full: str) -> list[tuple[int, int]]:
    """Spans found by searching each message's content, in order, in the full rendering."""
    specials = [t.content for t in tok.added_tokens_decoder.values() if t.special]
    specials.sort(key=len, reverse=True)
    spans, cursor = [], 0
    for i, m in enumerate(messages):
        content = m["content"].strip()
        at = full.find(content, cursor)
        if at < 0:
            raise DataError(f"the chat template does not render message {i} ({m['role']}) "
                            "verbatim, so its loss mask cannot be placed; fix the template")
        cursor = at + len(content)
        if m["role"] == "assistant":
            cursor += next((len(s) for s in specials if full.startswith(s, cursor)), 0)
            spans.append((at, cursor))
    return spans


@dataclass
class Tokenise:
    """``datasets.map`` body: raw columns -> ``ids``/``labels``, and why a record has no loss.

    Attributes:
        tok: The tokenizer.
        fmt: The detected format.
        roles: ``--roles``.
        template: ``--chat-template``'s text, or None for the tokenizer's own.
        train_on_prompt: Loss on prompts and user turns too.
        locate: Record index -> ``FILE line N`` (picklable), for error messages.
        template_file: ``--chat-template``'s path, to name it in errors.
    """

    tok: object
    fmt: str
    roles: dict
    template: str | None
    train_on_prompt: bool
    locate: object
    template_file: str | None = None

    def __call__(self, batch, indices):
        """Every record's ``ids``/``labels``, and ``dropped``: why it has no loss ("" when it has).

        A record without loss is kept as an empty row with its reason, so that the caller can say
        how many were dropped and why (and refuse when most were) before it filters them out.
        """
        out = {"ids": [], "labels": [], "dropped": []}
        for k, index in enumerate(indices):
            record = {c: v[k] for c, v in batch.items()}
            try:
                ids, labels = self.one(record)
            except DataError as e:  # only now find the line: locating reads the file
                raise DataError(f"{self.locate(index)}: {e}") from None
            why = "" if any(y != IGNORE_INDEX for y in labels[1:]) else self.why_dropped(record, ids)
            out["ids"].append([] if why else ids)
            out["labels"].append([] if why else labels)
            out["dropped"].append(why)
        return out

    def why_dropped(self, record: dict, ids: list[int]) -> str:
        """Why a record carries no loss, in a few words (the reasons the load reports)."""
        if not ids:
            return "empty text"
        doc = document(self.fmt, record, self.roles)
        if doc[0] == "chat" and not self.train_on_prompt and all(m["role"] != "assistant" for m in doc[1]):
            return "no assistant turn"
        return "no token to train on"

    def one(self, record: dict) -> tuple[list[int], list[int]]:
        """One record's ``(ids, labels)``; ``([], [])`` for an empty text."""
        doc = document(self.fmt, record, self.roles)
        if doc[0] == "chat" and self.fmt == "alpaca" and not self.has_template:
            doc = ("instruction", *alpaca_prompt(doc[1]))
        if doc[0] == "text":
            return _text_doc(self.tok, doc[1]) if doc[1].strip() else ([], [])
        if doc[0] == "instruction":
            return _instruction_doc(self.tok, doc[1], doc[2], self.train_on_prompt)
        return _chat_doc(self.tok, doc[1], self.template, self.train_on_prompt,
                         template_file(self.tok, self.template_file))

    @property
    def has_template(self) -> bool:
        return bool(self.template or getattr(self.tok, "chat_template", None))
