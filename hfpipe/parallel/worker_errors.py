"""Errors found inside worker processes, told to the user as one line (as a preflight error is).

A worker that hits a user error (a bad shard, a missing tokenizer, a resume mismatch ...) writes
it to ``<control>/error-rank<r>.json`` and exits quietly; the launcher reads those files when the
elastic launcher reports the failure and raises :class:`WorkerError` (a ``ValueError``: exit 2)
with the message, instead of torch-elastic's multi-kilobyte report. Other failures become one
:class:`WorkerFailed` line; a rank that timed out waiting names the ranks that never answered.
With ``HFPIPE_DEBUG=1`` (``hfpipe --debug``) workers re-raise and torch's full report is kept.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

__all__ = ["WorkerError", "WorkerFailed", "record_failure", "raise_from_failures", "debug"]


class WorkerError(ValueError):
    """A user error found inside a worker (one line; the same as a preflight error)."""


class WorkerFailed(RuntimeError):
    """A worker crashed, was killed or timed out (one line naming the rank)."""


def debug() -> bool:
    return os.environ.get("HFPIPE_DEBUG") == "1"


def _is_user_error(e: BaseException) -> bool:
    return isinstance(e, ValueError) and type(e).__module__.split(".")[0] == "hfpipe"


def _is_timeout(e: BaseException) -> bool:
    text = str(e).lower()
    return "timed out" in text or "timeout" in text or type(e).__name__ == "DistBackendError" and "wait" in text


def record_failure(control: Path | None, e: BaseException, stopping: bool = False) -> int:
    """Write this rank's failure for the launcher; return the exit code to leave with."""
    rank = int(os.environ.get("RANK", "0"))
    kind = "user" if _is_user_error(e) else "timeout" if _is_timeout(e) else "stopped" if stopping else "crash"
    first = (str(e).strip().splitlines() or [""])[0][:400]
    if control is not None:
        record = {"rank": rank, "kind": kind, "type": type(e).__name__, "message": first}
        tmp = control / f".error-rank{rank}.json"
        tmp.write_text(json.dumps(record))
        os.replace(tmp, control / f"error-rank{rank}.json")
    return 2 if kind == "user" else 1


def _records(control: Path) -> list[dict]:
    out = []
    for path in sorted(control.glob("error-rank*.json")):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(out, key=lambda r: r["rank"])


def raise_from_failures(control: Path, failed: BaseException, world: int, timeout_s: float | None) -> None:
    """Turn the elastic launcher's ``ChildFailedError`` into one line; re-raise it with --debug."""
    records = _records(control)
    user = [r for r in records if r["kind"] == "user"]
    if user:
        raise WorkerError(user[0]["message"]) from None
    if debug():
        raise failed
    waited = [r["rank"] for r in records if r["kind"] == "timeout"]
    if waited:
        silent = [r for r in range(world) if r not in {x["rank"] for x in records}]
        who = f"rank {', '.join(map(str, silent))}" if silent else "a rank"
        limit = f"--timeout {timeout_s:g} s" if timeout_s else "the timeout"
        raise WorkerFailed(f"{who} did not answer within {limit} (hung, or stuck in I/O); rank "
                           f"{', '.join(map(str, waited))} waited for it") from None
    crash = [r for r in records if r["kind"] == "crash"]
    if crash:
        r = crash[0]
        raise WorkerFailed(f"rank {r['rank']} failed: {r['type']}: {r['message']}") from None
    raise WorkerFailed(_describe(failed)) from None


def _describe(failed: BaseException) -> str:
    failures = getattr(failed, "failures", None) or {}
    for rank, f in sorted(failures.items()):
        code = getattr(f, "exitcode", None)
        if code is not None and code < 0:
            return f"rank {rank} was killed by {signal.Signals(-code).name}"
        return f"rank {rank} exited with code {code}"
    return f"a worker failed ({type(failed).__name__})"
