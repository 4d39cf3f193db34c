"""Record formats: which columns each one needs, and each record as one of three documents.

=============  ==================================================  ===========================
format         columns (after ``--columns`` renames)               document
=============  ==================================================  ===========================
chat           ``messages``: ``[{role, content}]`` (+ ``system``)  conversation
sharegpt       ``conversations``: ``[{from, value}]`` (+ system)   conversation
alpaca         ``instruction``, ``output`` (+ ``input``, system)   conversation (user, assistant)
instruction    ``prompt``, ``response`` or ``completion``          prompt + response
text           ``text``                                            text
=============  ==================================================  ===========================

``auto`` takes the first format of this table whose columns are all present. Turns may spell
their keys ``role``/``content`` or ``from``/``value`` in both chat formats; roles are mapped by
:data:`DEFAULT_ROLES` and ``--roles`` onto :data:`~hfpipe.data.config.ROLES`, and any other role is
an error (a template would render it silently, e.g. as ``<|wizard|>``).
"""

from __future__ import annotations

from hfpipe.data.config import ROLES, DataError

__all__ = ["DEFAULT_ROLES", "FIELDS", "alpaca_prompt", "detect_format", "document", "parse_turns"]

#: Required columns per format (a tuple inside means "one of"), in auto-detection order.
FIELDS = {
    "chat": ["messages"],
    "sharegpt": ["conversations"],
    "alpaca": ["instruction", "output"],
    "instruction": ["prompt", ("response", "completion")],
    "text": ["text"],
}
#: Optional columns a format reads when they are present.
OPTIONAL = {"chat": ["system"], "sharegpt": ["system"], "alpaca": ["input", "system"]}
#: ShareGPT's role names, and the standard ones as themselves.
DEFAULT_ROLES = {"human": "user", "gpt": "assistant", **{r: r for r in ROLES}}

# Stanford Alpaca's prompt, for tokenizers without a chat template (base models).
_ALPACA_HEAD = "Below is an instruction that describes a task{}. Write a response that " \
               "appropriately completes the request.\n\n### Instruction:\n{}\n\n"
_ALPACA_INPUT = ", paired with an input that provides further context"


def _has(columns, need) -> bool:
    return any(n in columns for n in need) if isinstance(need, tuple) else need in columns


def _spell(need) -> str:
    return " or ".join(map(repr, need)) if isinstance(need, tuple) else repr(need)


def detect_format(fmt: str, columns: list[str], where: str) -> str:
    """The format ``--format`` names, or the first that fits ``columns``; error if none fits."""
    fits = [f for f, needs in FIELDS.items() if all(_has(columns, n) for n in needs)]
    if fmt in fits or (fmt == "auto" and fits):
        return fmt if fmt in fits else fits[0]
    asked = FIELDS if fmt == "auto" else {fmt: FIELDS[fmt]}
    wants = "; ".join(f"{f} needs " + " and ".join(map(_spell, n)) for f, n in asked.items())
    if {"chosen", "rejected"} <= set(columns):  # preference pairs given to SFT
        wants += ". Its 'chosen' and 'rejected' are preference pairs: train them with --method dpo"
    raise DataError(f"{where} has columns [{', '.join(columns)}]; {wants}. Rename columns with "
                    "--columns COLUMN=FIELD (e.g. --columns question=prompt,answer=response)")


def document(fmt: str, record: dict, roles: dict[str, str]):
    """One record as ``("chat", messages)``, ``("instruction", prompt, response)`` or ``("text", text)``.

    Args:
        fmt: A detected format (not ``auto``).
        record: The record's columns.
        roles: ``--roles`` on top of :data:`DEFAULT_ROLES`.

    Raises:
        DataError: a missing or mistyped field, or an unknown role (the caller adds the line).
    """
    if fmt == "text":
        return "text", _string(record, "text")
    if fmt == "instruction":
        key = "response" if "response" in record else "completion"
        return "instruction", _string(record, "prompt"), _string(record, key)
    if fmt == "alpaca":
        user, extra = _string(record, "instruction"), record.get("input")
        if extra is not None and not isinstance(extra, str):
            raise DataError(f"input must be a string, got {type(extra).__name__}")
        turns = [{"role": "user", "content": f"{user}\n\n{extra}" if extra else user},
                 {"role": "assistant", "content": _string(record, "output")}]
    else:
        column = FIELDS[fmt][0]
        turns = parse_turns(record.get(column), column, {**DEFAULT_ROLES, **roles})
    system = record.get("system")
    if isinstance(system, str) and system.strip() and turns[0]["role"] != "system":
        turns = [{"role": "system", "content": system}] + turns
    return "chat", turns


def alpaca_prompt(messages: list[dict]) -> tuple[str, str]:
    """An Alpaca conversation as Stanford Alpaca's (prompt, response), for models without a template."""
    system = [m["content"] for m in messages if m["role"] == "system"]
    user = next(m["content"] for m in messages if m["role"] == "user")
    instruction, _, extra = user.partition("\n\n")
    head = _ALPACA_HEAD.format(_ALPACA_INPUT if extra else "", instruction)
    head += f"### Input:\n{extra}\n\n" if extra else ""
    prompt = "".join(s + "\n\n" for s in system) + head + "### Response:\n"
    return prompt, messages[-1]["content"]


def _string(record: dict, key: str) -> str:
    value = record.get(key)
    if not isinstance(value, str):
        raise DataError(f"{key} must be a string, got {type(value).__name__}")
    return value


def parse_turns(value, column: str, roles: dict[str, str]) -> list[dict]:
    """Turns as ``{role, content}`` dicts with mapped roles, without Arrow's ``None`` keys."""
    if not isinstance(value, list) or not value:
        raise DataError(f"{column} must be a non-empty list of turns")
    out = []
    for j, turn in enumerate(value):
        turn = turn if isinstance(turn, dict) else {}
        role = turn.get("role") if turn.get("role") is not None else turn.get("from")
        content = turn.get("content") if turn.get("content") is not None else turn.get("value")
        if not (isinstance(role, str) and isinstance(content, str)):
            raise DataError(f"{column}[{j}] needs a string role and content (or from "
                            f"and value), got {value[j]!r:.80}")
        if roles.get(role) not in ROLES:
            raise DataError(f"{column}[{j}] has role {role!r}, which is not one of "
                            f"{', '.join(ROLES)}; map it with --roles {role}=assistant (or user, "
                            "system, tool)")
        extra = {k: v for k, v in turn.items() if v is not None and k not in ("role", "from", "content", "value")}
        out.append({**extra, "role": roles[role], "content": content})
    return out
