"""Checkpoint keys to in-memory names: transformers' own conversion tables, on any subset of keys.

``from_pretrained`` renames hub keys and fuses per-expert tensors through
``get_model_conversion_mapping``; loading a stage, merging adapters and exporting all need the same
map, so it lives with the model families, below every one of them.
"""

from __future__ import annotations

from torch import nn

__all__ = ["model_key_mapper"]


def model_key_mapper(meta_model: nn.Module):
    """A function checkpoint key -> (in-memory key, converter or None, matched pattern).

    The tables are transformers' own (``get_model_conversion_mapping``), the ones
    ``from_pretrained`` applies, used here on any subset of keys.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    mapping = get_model_conversion_mapping(meta_model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    model_keys = set(meta_model.state_dict())

    def to_model_key(key: str):
        new, pattern = rename_source_key(key, renamings, converters)
        if new not in model_keys and key in model_keys:
            # As from_pretrained does: a renaming that overshoots (DeepSeek-V4's `.norm.` ->
            # `.kv_norm.` also matching `model.norm.weight`) yields to the key the model has.
            return key, None, None
        return new, (by_pattern[pattern] if pattern is not None else None), pattern

    return to_model_key
