"""The data pipeline: a ``--dataset`` option becomes fixed-length rows, then per-rank batches.

Flow (one module each): :mod:`~hfpipe.data.sources` loads raw records (builtin, local file or
folder, hub id) -> ``--columns`` renames -> :mod:`~hfpipe.data.formats` detects the format and
turns each record into a text, prompt/response or conversation -> :mod:`~hfpipe.data.tokenise`
makes ``(ids, labels)`` -> :mod:`~hfpipe.data.packing` packs or pads them to ``seq_len`` ->
:mod:`~hfpipe.data.batches` shuffles rows by ``(seed, epoch)`` and shards each global batch over
ranks. :mod:`~hfpipe.data.load` strings the steps together.

Row contract (labels are *unshifted*, as transformers' ``labels=`` expects):

- ``input_ids``, ``labels``, ``position_ids``, ``attention_mask``, each ``seq_len`` long.
- A row is a run of *segments* (documents, or pieces of one cut at a row end) then padding.
  ``position_ids`` restart at 0 at each segment and keep counting through trailing padding.
- ``labels`` are -100 on padding, on tokens without loss (prompts, user/system turns) and on the
  first token of each segment, which nothing in its segment can predict: packed and unpacked rows
  train on the same tokens and a shifted loss never crosses a document boundary.
- ``attention_mask`` is 1 on real tokens, 0 on trailing padding. Feed packed rows with
  ``position_ids``, ``attention_mask=None`` and ``use_cache=False``: transformers then builds a
  block-diagonal causal mask from the position resets (with a cache it silently does not).
  Padding is trailing, so under a causal mask no real token attends to it.
- Every row has a labelled token: documents and rows without one are dropped, counted per reason
  in one log line; more than half of the records dropped is refused unless
  ``allow_dropped_records`` (:func:`hfpipe.data.load._drop_unusable`).
"""
