"""Training checkpoints: torch DCP folders plus ``hfpipe.json``, and their export to HF folders."""
