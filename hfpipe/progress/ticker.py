"""The one way a stretch that prints nothing on its own (loading stages, starting workers, verifying,
exporting) says what it does: a line every few seconds with the time so far.

A floor of its own, below training: the CLI, ``verify``, ``generate`` and the quickstart tick too.
"""

from __future__ import annotations

import logging
import os
import threading
import time

__all__ = ["FIRST_S", "Ticker", "TICK_S"]

log = logging.getLogger(__name__)


#: Seconds between a silent stretch's lines, and before its first: a stretch over in a second says
#: nothing (a user error stays the one line printed), and one stretch after another leaves at most
#: FIRST_S + TICK_S = 4.5 s between lines, under the 5 s a new user waits without a word.
TICK_S = 3.5
FIRST_S = 1.0


class Ticker:
    """Says ``<what>... (N s)`` every :data:`TICK_S` seconds while a silent stretch lasts.

    A context manager; a no-op on ranks other than 0 (``RANK`` of torchrun or the launcher), so
    each line is said once.

    Args:
        what: What is going on, or a function returning it now (``None`` while something else
            shows progress; a new text counts its seconds afresh).
        echo: Where the lines go (default: this module's logger at INFO).
        every: Seconds between lines (default :data:`TICK_S`).
        first: Also say ``<what>...`` after :data:`FIRST_S` (or ``every`` if shorter), so that
            stretches that follow each other leave no long gap (a ticker alone starts after ``every``).
    """

    def __init__(self, what, *, echo=None, every: float | None = None, first: bool = True) -> None:
        self.what = what if callable(what) else (lambda: what)
        self.echo = echo or (lambda text: log.info("%s", text))
        self.every, self.first = every or TICK_S, first
        self.enabled = int(os.environ.get("RANK", "0") or 0) == 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="hfpipe-ticker", daemon=True)

    def __enter__(self) -> Ticker:
        self.start = time.monotonic()
        if self.enabled:
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        if self.enabled:
            self.thread.join()

    def _run(self) -> None:
        shown = self.what()
        if self.first and not self.stop.wait(min(FIRST_S, self.every)) and shown is not None:
            self.echo(f"{shown}...")
        while not self.stop.wait(self.every):
            what = self.what()
            if what != shown:  # a new stretch: count from its start
                shown, self.start = what, time.monotonic() - self.every
            if what is not None:
                self.echo(f"{what}... ({time.monotonic() - self.start:.0f} s)")
