"""Training checkpoints: torch DCP folders plus ``hfpipe.json``, and their export to HF folders."""

from hfpipe.checkpoint.export import ExportError, export_checkpoint, read_checkpoint_meta

__all__ = ["ExportError", "export_checkpoint", "read_checkpoint_meta"]
