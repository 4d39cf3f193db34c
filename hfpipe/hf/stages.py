"""The module a Trainer holds as its ``model``: this rank's stage modules, and nothing it may call.

transformers' Trainer reads its model for the optimizer (``named_parameters``, which names decay),
the dataset columns to keep (``forward``'s signature), ``config`` and the loss convention
(``accepts_loss_kwargs``); it calls ``train()``/``eval()``/``zero_grad()``. The forward itself runs
through the pipeline's schedule (:mod:`hfpipe.hf.loop`), so ``forward`` here refuses.
"""

from __future__ import annotations

from torch import nn

from hfpipe.errors import ConfigError

__all__ = ["PipelineStages"]


class PipelineStages(nn.Module):
    """This rank's stages of a :class:`hfpipe.api.PipelineModel` as one ``nn.Module``.

    Parameter names are ``stages.<i>.`` + the full model's name, so the Trainer's decay rule (no decay
    for biases and norms, found by name) picks the same parameters as on the whole model.
    """

    # transformers' causal LMs take num_items_in_batch: the loss of a step is divided by its token count
    accepts_loss_kwargs = True
    loss_type = "ForCausalLM"
    # the Trainer's own model-parallel switch: it must not place, wrap or DataParallel the stages
    is_parallelizable = True
    model_parallel = True

    def __init__(self, pm) -> None:
        super().__init__()
        self.stages = nn.ModuleList(pm.modules)
        object.__setattr__(self, "pipeline", pm)  # not a submodule: its modules are the stages above
        self.config = pm.source.config
        self.name_or_path = str(pm.source.name)
        from transformers import GenerationConfig

        self.generation_config = GenerationConfig.from_model_config(self.config)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, **kwargs):
        raise ConfigError("a PipelineTrainer's model runs only through trainer.train() and trainer.evaluate() "
                          "(the pipeline schedule); export it with trainer.save_model() to call it")

    def activation_checkpointing_enable(self, **_) -> None:
        """Already on: ``gradient_checkpointing=True`` reached ``load_pipeline`` as ``activation_checkpointing``."""

    gradient_checkpointing_enable = activation_checkpointing_enable

    def add_model_tags(self, tags) -> None:
        """TRL tags the model card; an exported folder carries no card."""

    def get_input_embeddings(self):
        for m in self.stages:
            if getattr(m, "is_first", False):
                return m.model.embed_tokens
        return None
