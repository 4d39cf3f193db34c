"""The loss room: what the last stage computes and how a step normalises it (the objective), label shifting,
token counting, ``IGNORE_INDEX``, and the chunked and the vocab-parallel forms of the token loss."""
