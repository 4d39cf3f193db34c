"""A new user's first hour, timed: the quickstart, then finetune -> export -> generate -> verify -> plan ->
export on CPU.

Each command runs as a user types it; every line it prints is shown with the seconds since the
command started. The summary gives, per command, its wall time, the longest stretch without a line
(from the start to the first line, between lines, and from the last line to the exit), and the
lines that mention a warning; then how long each command takes to refuse a wrong path (exit 2).

    python bench/first_run.py [--steps 40] [--out /tmp/hfpipe-first-run]

The bar: no stretch over 5 s, zero warnings, a wrong path refused in under 2 s.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}
ENV.pop("PYTHONWARNINGS", None)
HFPIPE = [sys.executable, "-m", "hfpipe.cli.main"]
#: A warning in any of the shapes libraries print one: Python's, logging's, torch's glog ("W1126 ...").
WARNING = re.compile(r"(?i)warn|^\[rank\d+\]:W\d{4}|Failed to load")


def timed(args: list[str], cwd: Path) -> dict:
    """Run ``hfpipe ARGS``; print each line with its time; return the lines, gaps and exit code."""
    print(f"\n$ hfpipe {shlex.join(args)}", flush=True)
    t0 = time.monotonic()
    proc = subprocess.Popen([*HFPIPE, *args], cwd=cwd, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)
    lines, last, gap = [], 0.0, (0.0, "(start)")
    for line in proc.stdout:
        now = time.monotonic() - t0
        line = line.rstrip("\n")
        if now - last > gap[0]:
            gap = (now - last, line)
        last = now
        lines.append(line)
        print(f"{now:7.1f}s | {line}", flush=True)
    code = proc.wait()
    wall = time.monotonic() - t0
    if wall - last > gap[0]:
        gap = (wall - last, "(exit)")
    return {"args": args, "code": code, "wall": wall, "gap": gap, "lines": lines,
            "warnings": [x for x in lines if WARNING.search(x)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40, help="steps of the quickstart and the fine-tune")
    ap.add_argument("--out", type=Path, default=Path("/tmp/hfpipe-first-run"))
    a = ap.parse_args()
    shutil.rmtree(a.out, ignore_errors=True)
    a.out.mkdir(parents=True)
    runs = [timed(["quickstart", "--out", "qs", "--steps", str(a.steps)], a.out)]
    model = "qs/base"
    runs.append(timed(["finetune", model, "--dataset", "builtin:tiny-chat", "--pp", "2", "--max-steps",
                       str(a.steps), "--seq-len", "128", "--batch-size", "8", "--microbatches", "4",
                       "--output-dir", "run"], a.out))
    nexts = [shlex.split(x, comments=True)[1:] for x in runs[-1]["lines"]
             if x.strip().startswith("hfpipe ")]  # the `next:` commands, as printed
    for args in nexts:
        if args[0] == "generate":
            args = [*args[:-1], "How does a cat sound?", "--max-new-tokens", "16"]
        runs.append(timed(args, a.out))
    runs.append(timed(["verify", "run/hf", "--pp", "2"], a.out))
    runs.append(timed(["plan", model, "--pp", "2", "--seq-len", "128", "--batch-size", "8", "--gpu-memory", "1GB"],
                      a.out))
    runs.append(timed(["export", "run", "hf-again"], a.out))  # the run folder: its newest checkpoint
    wrong = [timed(args, a.out) for args in (
        ["finetune", "qs/bsae", "--dataset", "builtin:tiny-chat", "--pp", "2"],
        ["finetune", model, "--dataset", "qs/nope.jsonl", "--pp", "2"],
        ["export", "run/checkpoints/step-99", "hf2"],
        ["generate", "run/hg", "--prompt", "hi"],
        ["verify", "run/hg"],
    )]
    print("\n== summary: command | exit | wall s | longest silence s (before which line) | warnings")
    for r in runs:
        print(f"hfpipe {r['args'][0]:<10} | {r['code']} | {r['wall']:6.1f} | {r['gap'][0]:5.1f} "
              f"({r['gap'][1][:60]!r}) | {len(r['warnings'])}")
    print(f"largest silence over all: {max(r['gap'][0] for r in runs):.1f} s; "
          f"warnings: {sum(len(r['warnings']) for r in runs)}")
    print("== a wrong path: command | exit | s to refuse | the line")
    for r in wrong:
        print(f"hfpipe {shlex.join(r['args'][:2]):<32} | {r['code']} | {r['wall']:4.1f} | {(r['lines'] or [''])[-1][:90]}")


if __name__ == "__main__":
    main()
