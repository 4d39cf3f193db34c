"""Model adapters: which HF architectures hfpipe can split, and what each needs.

Support is by structure: any causal LM with ``model.embed_tokens -> model.layers -> model.norm ->
lm_head`` is split the same way (:mod:`hfpipe.models.adapter`), and what a family's forward does
around its layers is declared in one small file per family (``plain``, ``gemma``, ``granite``,
``cohere``, ``deepseek``). Adding a family is a line in such a file plus a row of the test table.
The table is :mod:`hfpipe.models.registry`; :mod:`hfpipe.models.support` proves the rest. Another transformers causal LM is run with the plain
skeleton only once its forward is proven equal on a tiny replica of its config
(:mod:`hfpipe.models.proof`); families whose forward a stage-by-stage run cannot reproduce are
refused with the reason. Checkpoint keys map to in-memory names through transformers' own
conversion tables (:mod:`hfpipe.models.conversion`).
"""
