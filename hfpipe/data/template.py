"""Chat messages through a chat template: a failing template is one line, and no message is lost.

transformers renders templates in jinja2's sandbox, which raises ``SecurityError`` when a template
reaches for Python internals (``''.__class__.__mro__``, ``cycler.__init__.__globals__``): the
sandbox working, but it reached the user as an "unexpected SecurityError" dump. Here that, and
every other template error (syntax, ``raise_exception``, an unknown filter), is one line naming
the template's file. A template that renders without some message's text (``{{ m.role }}``
alone, a branch that skips user turns) would train on, or answer, another conversation than the
one given; so every message's text must appear in the rendering, in order.
"""

from __future__ import annotations

from pathlib import Path

from hfpipe.data.config import DataError

__all__ = ["ChatTemplateError", "check_content", "render_chat", "template_file"]

_THINK_END = "</think>"  # Qwen3 / DeepSeek-R1 templates drop earlier turns' reasoning, by design


class ChatTemplateError(DataError):
    """A chat template fails to render, escapes jinja's sandbox, or drops a message's text."""


def template_file(tok, given: str | Path | None = None) -> str:
    """The file a template comes from, for messages: ``--chat-template``'s, or the tokenizer folder's."""
    if given:
        return str(given)
    folder = Path(str(getattr(tok, "name_or_path", "") or "."))
    for name in ("chat_template.jinja", "tokenizer_config.json"):
        if (folder / name).is_file():
            return str(folder / name)
    return f"the chat template of {folder}"


def render_chat(tok, messages: list[dict], template: str | None, where: str, *,
                add_generation_prompt: bool, check: bool = True) -> str:
    """``messages`` rendered as text by ``template`` (None: the tokenizer's own).

    Args:
        where: The template's file (:func:`template_file`), for messages.
        check: Also refuse a rendering that lacks a message's text (:func:`check_content`).

    Raises:
        ChatTemplateError: the template fails, escapes the sandbox or drops a message's text.
    """
    from jinja2.exceptions import SecurityError, TemplateError

    try:
        text = tok.apply_chat_template(messages, chat_template=template, tokenize=False,
                                       add_generation_prompt=add_generation_prompt)
    except SecurityError as e:
        raise ChatTemplateError(f"{where}: the chat template tries to leave jinja's sandbox ({e}); "
                                "hfpipe never runs code from a template: use another template") from None
    except TemplateError as e:
        raise ChatTemplateError(f"{where}: the chat template fails ({type(e).__name__}: {e}); "
                                "fix the template or pass another with --chat-template") from None
    if check:
        check_content(messages, text, where)
    return text


def check_content(messages: list[dict], text: str, where: str) -> None:
    """Refuse ``text`` unless every message's text appears in it, in order.

    A message's text is compared stripped (templates trim); of an assistant turn holding reasoning,
    only what follows its last ``</think>`` (templates drop earlier turns' reasoning on purpose).
    """
    cursor = 0
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, str):
            continue  # parts (images, tool calls) are the template's to place
        if message.get("role") == "assistant" and _THINK_END in content:
            content = content.rsplit(_THINK_END, 1)[1]
        content = content.strip()
        at = text.find(content, cursor)
        if at < 0:
            raise ChatTemplateError(
                f"{where}: the chat template drops the text of message {i} ({message.get('role')}): its "
                "rendering would not be the conversation given; fix the template")
        cursor = at + len(content)
