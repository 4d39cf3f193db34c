"""Errors found inside worker processes, told to the user as one line (as a preflight error is).

A worker that hits a user error (a bad shard, a missing tokenizer, a resume mismatch ...) writes
it to ``<control>/error-rank<r>.json`` and exits quietly; the launcher reads those files when the
elastic launcher reports the failure and raises :class:`WorkerError` (a ``ValueError``: exit 2)
with the message, instead of torch-elastic's multi-kilobyte report. Other failures become one
:class:`WorkerFailed` line; a rank that timed out waiting names the ranks that never answered.

One failure brings the others down: their peers' sockets close under them ("Connection closed by
peer"). The line names the root cause: the rank that failed *first* with an error of its own, its
peers' echoes of it come last (each record carries the time it was written and whether it is an echo).
With ``HFPIPE_DEBUG=1`` (``hfpipe --debug``) workers re-raise and torch's full report is kept.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

from hfpipe.errors import HfpipeError
from hfpipe.parallel.signals import Interrupted, read_stop

__all__ = ["WorkerError", "WorkerFailed", "record_failure", "record_interrupt", "raise_from_failures", "debug"]


class WorkerError(HfpipeError):
    """A user error found inside a worker (one line; the same as a preflight error)."""


class WorkerFailed(RuntimeError):
    """A worker crashed, was killed or timed out (one line naming the rank)."""


def debug() -> bool:
    return os.environ.get("HFPIPE_DEBUG") == "1"


def _is_user_error(e: BaseException) -> bool:
    return isinstance(e, HfpipeError)


def _is_timeout(e: BaseException) -> bool:
    text = str(e).lower()
    return "timed out" in text or "timeout" in text or type(e).__name__ == "DistBackendError" and "wait" in text


#: What a rank sees when a *peer* died: the transport closing under it (gloo, NCCL, the TCP store).
_ECHO = re.compile(r"connection (closed|reset) by peer|broken pipe|remote (worker|process|peer)|"
                   r"socket (closed|timeout)|connection refused|ncclRemoteError|peer .*(exited|closed)",
                   re.IGNORECASE)


def is_echo(message: str) -> bool:
    """Whether a failure message is a peer's death seen from this rank, not an error of its own."""
    return bool(_ECHO.search(message))


def record_failure(control: Path | None, e: BaseException, stopping: bool = False) -> int:
    """Write this rank's failure for the launcher; return the exit code to leave with."""
    rank = int(os.environ.get("RANK", "0"))
    kind = "user" if _is_user_error(e) else "timeout" if _is_timeout(e) else "stopped" if stopping else "crash"
    first = (str(e).strip().splitlines() or [""])[0][:400]
    if control is not None:
        _write(control, rank, {"rank": rank, "kind": kind, "type": type(e).__name__, "message": first,
                               "time": time.time(), "echo": kind == "crash" and is_echo(first)})
    return 2 if kind == "user" else 1


def record_interrupt(control: Path | None, signum: int) -> int:
    """A worker stopped by a signal before training: say so to the launcher; return the exit code."""
    rank = int(os.environ.get("RANK", "0"))
    if control is not None:
        trained = (control / f"training-rank{rank}").exists()  # then it stopped in the final export
        _write(control, rank, {"rank": rank, "kind": "interrupted", "signum": int(signum), "time": time.time(),
                               "trained": trained})
    return 128 + int(signum)


def _write(control: Path, rank: int, record: dict) -> None:
    tmp = control / f".error-rank{rank}.json"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, control / f"error-rank{rank}.json")


def _records(control: Path) -> list[dict]:
    out = []
    for path in sorted(control.glob("error-rank*.json")):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    # Root causes first, in the order they happened; echoes of a peer's death after them.
    return sorted(out, key=lambda r: (bool(r.get("echo")), r.get("time", 0.0), r["rank"]))


def raise_from_failures(control: Path, failed: BaseException, world: int, timeout_s: float | None) -> None:
    """Turn the elastic launcher's ``ChildFailedError`` into one line; re-raise it with --debug."""
    records = _records(control)
    stopped = [r for r in records if r["kind"] == "interrupted"]
    signum = stopped[0]["signum"] if stopped else read_stop(control / "stop")
    if signum and all(r["kind"] in ("interrupted", "stopped") or r.get("echo") for r in records):
        late = any(r.get("trained") for r in stopped)  # in the final export: its checkpoints stay
        raise Interrupted(signum, None, None, late=late) from None  # the user stopped it, not its echoes
    user = [r for r in records if r["kind"] == "user"]
    if user:
        raise WorkerError(user[0]["message"]) from None
    if debug():
        raise failed
    waited = [r["rank"] for r in records if r["kind"] == "timeout"]
    crash = [r for r in records if r["kind"] == "crash"]
    if crash and not crash[0].get("echo"):  # an error of its own beats the timeouts it caused
        r = crash[0]
        raise WorkerFailed(f"rank {r['rank']} failed: {r['type']}: {r['message']}") from None
    if waited:
        silent = [r for r in range(world) if r not in {x["rank"] for x in records}]
        who = f"rank {', '.join(map(str, silent))}" if silent else "a rank"
        limit = f"--timeout {timeout_s:g} s" if timeout_s else "the timeout"
        raise WorkerFailed(f"{who} did not answer within {limit} (hung, or stuck in I/O); rank "
                           f"{', '.join(map(str, waited))} waited for it") from None
    own = _describe(failed)
    if crash and own is not None:  # only echoes were recorded: the first rank to die said nothing
        raise WorkerFailed(f"{own} (rank {crash[0]['rank']} then lost its peer)") from None
    if crash:
        r = crash[0]
        raise WorkerFailed(f"rank {r['rank']} failed: {r['type']}: {r['message']}") from None
    raise WorkerFailed(own or f"a worker failed ({type(failed).__name__})") from None


def _describe(failed: BaseException) -> str | None:
    """The first rank the elastic launcher saw die without a record (killed, or exited), or None."""
    failures = getattr(failed, "failures", None) or {}
    dead = [(getattr(f, "timestamp", 0), rank, getattr(f, "exitcode", None)) for rank, f in failures.items()]
    for _, rank, code in sorted(dead):
        if code is not None and code < 0:
            return f"rank {rank} was killed by {signal.Signals(-code).name}"
        if code not in (1, 2):  # 1 and 2 are the codes record_failure leaves with
            return f"rank {rank} exited with code {code}"
    return None
