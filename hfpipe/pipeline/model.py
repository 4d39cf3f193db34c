"""This rank's part of a pipelined model: :class:`RankPipeline` runs and saves it
(:func:`hfpipe.pipeline.build.load_pipeline` builds it).

The run loop (:mod:`hfpipe.train.loop`) and ``verify`` stand on this module; the public face,
:mod:`hfpipe.api`, adds ``trainer`` (:mod:`hfpipe.train.step`, a floor above) and ``save_pretrained``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from hfpipe.parallel.mesh import Dist
from hfpipe.pipeline.inputs import check_batches
from hfpipe.pipeline.params import by_mesh, unique_parameters
from hfpipe.pipeline.schedule import Pipeline
from hfpipe.plan.split import Plan
from hfpipe.source.folder import ModelSource

__all__ = ["RankPipeline"]

log = logging.getLogger(__name__)


@dataclass
class RankPipeline:
    """This rank's part of a pipelined model.

    Attributes:
        source: The checkpoint it was loaded from.
        plan: Every stage's layout.
        dist: This rank's place in the (dp, pp) mesh.
        modules: This rank's stage modules (parameter names are the full model's).
        pipe: The schedule driver.
        tied_group: Group summing the tied embedding's gradient halves, or ``None``.
        lora: The ``LoraConfig`` whose adapters are the only trainable parameters, or ``None``.
    """

    source: ModelSource
    plan: Plan
    dist: Dist
    modules: list
    pipe: Pipeline
    tied_group: object = None
    lora: object = None  # the resolved peft.LoraConfig of a LoRA run (base frozen), or None
    quantize: object = None  # the hfpipe.quant.linear.QuantSpec of a quantized base, or None
    ep: int = 1  # ranks each MoE layer's routed experts are sharded over
    load_stats: object = None  # what this rank read: a hfpipe.pipeline.load.LoadStats (bench/tp.py)

    @property
    def loss_rank(self) -> int:
        """The pipeline rank holding the last stage (rank 0 for V schedules)."""
        return self.plan.rank_of_stage(len(self.plan.stages) - 1)

    def parameters(self):
        """This rank's trainable parameters, each shared tensor once (for your optimizer).

        On a rank whose stages are all empty (a layout such as ``E||t*30|L``) this is one empty
        parameter *group*, ``[{"params": []}]``: any torch optimizer accepts it (an empty list it
        refuses), so the same optimizer line runs on every rank and its steps do nothing there.
        """
        params = [p for _, p in unique_parameters(self.modules)]
        runs = by_mesh(params)
        if len(runs) > 1:  # DTensors beside plain tensors (--tp): a group each, so foreach optimizers run
            return [{"params": run} for run in runs]
        return params or [{"params": []}]

    def named_parameters(self):
        return unique_parameters(self.modules)

    @property
    def vocab_size(self) -> int | None:
        """Token ids a batch may hold: 0 .. vocab_size - 1."""
        config = self.source.config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        return getattr(text, "vocab_size", None)

    def forward(self, batch: dict) -> torch.Tensor | None:
        """Logits on the loss rank, ``None`` elsewhere (no gradients)."""
        check_batches([batch], self.vocab_size, "forward", labels=False)
        return self.pipe.forward(batch)

    @property
    def tied(self) -> bool:
        return bool(getattr(self.source.config, "tie_word_embeddings", False))
