"""The pipeline's settings are declared once (hfpipe/pipeline/options.py): ``load_pipeline``'s keywords are the
fields of PipelineLayout and StageOptions, documented from them; another keyword is refused naming the closest
field; the objects refuse a bad value with the one-line error ``load_pipeline`` always raised; a run's config
and the Trainer faces become the same objects."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
from peft import LoraConfig
import torch

from hfpipe.api import load_pipeline
from hfpipe.config.run import FinetuneConfig
from hfpipe.errors import HfpipeError
from hfpipe.pipeline.options import PipelineLayout, StageOptions, from_config, from_keywords

FIELDS = [f.name for cls in (PipelineLayout, StageOptions) for f in dataclasses.fields(cls)]
#: The face's own keywords beside the fields: where the model comes from and an existing process group.
OWN = ["trust_remote_code", "dist"]


def test_the_faces_keywords_are_the_options_fields_and_each_is_documented():
    params = inspect.signature(load_pipeline).parameters
    assert list(params) == ["model", *OWN, *FIELDS]
    assert all(p.kind is p.KEYWORD_ONLY for name, p in params.items() if name != "model")
    defaults = {f.name: f.default for cls in (PipelineLayout, StageOptions) for f in dataclasses.fields(cls)}
    assert {name: params[name].default for name in FIELDS} == defaults
    for name in ["model", *OWN, *FIELDS]:
        assert f"\n        {name}: " in load_pipeline.__doc__, name


def test_an_unknown_keyword_is_refused_in_one_line_naming_the_closest_field():
    with pytest.raises(TypeError, match=r"^load_pipeline\(\) got an unexpected keyword argument 'micro_batches' "
                                        r"\(did you mean microbatches\?\)$"):
        load_pipeline("any/model", pp=1, micro_batches=2)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'model_class'"):  # the builder's, not the face's
        from_keywords("load_pipeline", {"model_class": object})


@pytest.mark.parametrize("kwargs, message", [
    (dict(vpp=0), "load_pipeline(vpp=0): vpp must be an integer >= 1 (or None for the default)"),
    (dict(pp=0), "load_pipeline(pp=0): pp must be an integer >= 1, got 0"),
    (dict(ep=2, dp=3), "load_pipeline(ep=2): ep must divide dp (3)"),
    (dict(loss_chunk_tokens=-1), "load_pipeline(loss_chunk_tokens=-1): loss_chunk_tokens must be an integer >= 0"),
    (dict(activation_checkpointing="some"), "load_pipeline(activation_checkpointing='some'): choose one of none, "
                                            "full, selective"),
    (dict(dtype="fp16"), "load_pipeline(model='any/model'): dtype 'fp16' is unknown; choose one of fp32, "
                         "bf16-mixed, bf16, fp64"),
    (dict(quantize_base="nf4"), "load_pipeline(model='any/model'): quantize_base trains LoRA adapters on a frozen "
                                "base; add lora=LoraConfig(r=R) (e.g. 16)"),
    (dict(quantize_block_size=64), "load_pipeline(model='any/model'): quantize_block_size applies with "
                                   "quantize_base nf4|fp8 only"),
    # a string switch would read as True; PEFT would refuse r=0 only once it builds adapters, in its words
    (dict(tp=2, sequence_parallel="no"), "load_pipeline(sequence_parallel='no'): sequence_parallel must be True "
                                         "or False"),
    (dict(lora=LoraConfig(r=0)), "load_pipeline(model='any/model'): lora (LoraConfig.r) must be an integer >= 1, "
                                 "got 0"),
    (dict(lora="r=8"), "load_pipeline(model='any/model'): lora= takes a peft.LoraConfig, got str"),
])
def test_a_bad_value_is_refused_before_anything_loads_naming_the_argument(kwargs, message):
    with pytest.raises(HfpipeError) as info:
        load_pipeline("any/model", **kwargs)
    assert str(info.value).startswith(message), str(info.value)


def test_the_checks_run_in_the_order_load_pipeline_ran_them():
    """The degrees, then the counts, the checkpointing, the quantized base and the dtype."""
    with pytest.raises(HfpipeError, match=r"^load_pipeline\(dp=0\)"):
        from_keywords("load_pipeline", dict(dp=0, vpp=0, dtype="fp16"))
    with pytest.raises(HfpipeError, match=r"^load_pipeline\(seed=-1\)"):
        from_keywords("load_pipeline", dict(seed=-1, activation_checkpointing="x", dtype="fp16"))
    with pytest.raises(HfpipeError, match="add --lora-rank"):
        StageOptions(quantize_base="nf4", dtype="fp16")


def test_stage_options_resolve_the_precision_and_the_quantized_base():
    stages = StageOptions(dtype="bf16-mixed", lora=LoraConfig(r=4), quantize_base="fp8", reshard_per_microbatch=1)
    assert (stages.param_dtype, stages.compute_dtype) == (torch.float32, torch.bfloat16)
    assert stages.quantize.to_dict() == {"kind": "fp8", "block": None, "dtype": "float32"}
    assert stages.reshard_per_microbatch is True
    assert StageOptions().quantize is None


def test_a_runs_config_becomes_the_options_field_by_field():
    cfg = FinetuneConfig(model="any/model", pp=2, dp=2, schedule="interleaved-1f1b", plan_method="even",
                         dtype="bf16", activation_checkpointing="full", seed=3, lora_rank=4, quantize_base="nf4",
                         quantize_block_size=32, reshard_per_microbatch=True, sequence_parallel=False)
    layout, stages = from_config(cfg)
    assert layout == PipelineLayout(pp=2, dp=2, vpp=cfg.vpp, schedule="interleaved-1f1b",
                                    microbatches=cfg.num_microbatches, method="even")
    assert stages.lora.r == 4 and stages.lora.lora_alpha == 8
    assert dataclasses.replace(stages, lora=None, quantize_base=None, quantize_block_size=None) == StageOptions(
        dtype="bf16", activation_checkpointing="full", sequence_parallel=False, reshard_per_microbatch=True, seed=3)
    assert (stages.quantize_base, stages.quantize_block_size) == ("nf4", 32)


def test_the_trainer_faces_take_layout_fields_with_the_layouts_defaults():
    pytest.importorskip("trl")
    from hfpipe.hf.sft import PipelineSFTTrainer
    from hfpipe.hf.trainer import PipelineTrainer

    defaults = {f.name: f.default for f in dataclasses.fields(PipelineLayout)}
    for face in (PipelineTrainer, PipelineSFTTrainer):
        params = inspect.signature(face.__init__).parameters
        taken = {name: p.default for name, p in params.items() if name in defaults}
        assert list(taken) == ["pp", "dp", "ep", "tp", "cp", "schedule", "microbatches", "layout"], face
        assert taken == {name: defaults[name] for name in taken}, face
