"""How many tokens one chunk of the last stage's loss holds (:mod:`hfpipe.loss.chunked`).

Apart from the loss itself and free of torch: the planner (:mod:`hfpipe.plan.report`) prices the same chunks
the pipeline runs, and ``hfpipe plan`` should not wait for torch's distributed tensors to import.
"""

import os

from hfpipe.errors import PlanError

__all__ = ["AUTO_CHUNK_BYTES", "chunk_tokens"]

#: Default budget of one chunk's fp32 logits (1046 tokens at a 128k vocabulary). Measured on an H200 at
#: Llama-3-8B's head (bench/head_cuda.py, 8192 tokens a microbatch, bf16): the head loss then takes 0.18x
#: the full logits' memory and 0.90-0.94x their time (the chunk's softmax gradient fused); 523 tokens
#: saved no memory and ran at 0.98x (the weight gradient's GEMM adds into its buffer once per chunk),
#: 2093 ran at 0.89x with 0.22x the memory, more of it on smaller microbatches.
AUTO_CHUNK_BYTES = 512 * 2**20


def chunk_tokens(vocab_size: int, setting: int | None = None) -> int:
    """Tokens per chunk: ``setting`` if given (0 turns chunking off), else fit the byte budget.

    ``HFPIPE_LOSS_CHUNK_TOKENS`` stands in for an unset ``setting`` (e.g. to run the exactness
    suite with tiny chunks on tiny models, where the budget would never chunk).
    """
    env = os.environ.get("HFPIPE_LOSS_CHUNK_TOKENS")
    if setting is None and env:
        if not env.strip().isdigit():
            raise PlanError(f"HFPIPE_LOSS_CHUNK_TOKENS={env!r} must be a whole number of tokens (0: off)")
        setting = int(env)
    if setting is not None:
        return max(0, int(setting))
    return max(1, AUTO_CHUNK_BYTES // (4 * vocab_size))
