"""What a user runs after ``hfpipe finetune``: export, generate, resume, each as it works when printed."""

from __future__ import annotations

from pathlib import Path

from hfpipe.checkpoint.meta import EXPORT_RECORD

__all__ = ["next_commands"]


def next_commands(output_dir: str, checkpoint: str, *, exported: bool, best: str | None) -> list[str]:
    """What a user runs after training: export, generate, resume; each works as printed."""
    hf = Path(output_dir) / "hf"
    lines = []
    if not exported:
        hf, export = _export_command(checkpoint, hf)
        lines.append(export)
    if best:
        lines.append(_export_command(best, Path(output_dir) / "hf-best")[1] + "   # lowest eval loss")
    lines.append(f'hfpipe generate {hf} --prompt "..."')
    lines.append("train further: the same command with --resume auto and a larger --max-steps")
    return lines


def _export_command(checkpoint: str, out: Path) -> tuple[Path, str]:
    """Where to export ``checkpoint`` and the command: ``--force`` where an earlier export (a run
    resumed since) is in the way, another folder where anything else is (export refuses it)."""
    if out.exists() and (out / EXPORT_RECORD).is_file():
        return out, f"hfpipe export {checkpoint} {out} --force"
    if out.exists():
        out = out.with_name(f"{out.name}-{Path(checkpoint).name}")
    return out, f"hfpipe export {checkpoint} {out}"
