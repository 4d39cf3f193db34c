"""Float8 training in a Trainer script: ``PipelineTrainer(fp8="rowwise" | "tensorwise")``, or accelerate's
``mixed_precision="fp8"`` (``accelerate launch --mixed_precision fp8``), as ``--fp8`` does for the CLI; TRL's faces
(``PipelineSFTTrainer``, ``PipelineDPOTrainer``) take the same keyword through the same code path.

The oracle is ``tests/quant/test_quant_fp8_training.py``'s: the same script in bf16-mixed, whose losses the float8
run's must stay within 2% of while differing from them (the matmuls really ran in float8); the folder
``save_model()`` writes holds the bf16-mixed run's keys and dtypes (fp32 masters, no float8 anywhere).
"""

from __future__ import annotations

import pytest
import torch

from _dist import folder_tensors, tiny_checkpoint
from test_hf_trainer import finish, losses, start_script

pytest.importorskip("torchao", reason="fp8 needs torchao (pip install 'hfpipe[qlora]')")

#: One process at pp 1, 3 steps logged each (the script's tiny Llama: every decoder-layer dim a multiple of 16).
SPEC = {"pp": 1, "bf16": True, "max_steps": 3}


def _runs(tmp_path, **runs: dict) -> dict:
    """Each named run of the script (PipelineTrainer, one process each, side by side): name -> output folder."""
    started = {name: start_script(tmp_path, name, 1, trainer="pipeline", **{**SPEC, **spec})
               for name, spec in runs.items()}
    return {name: finish(run) for name, run in started.items()}


def _dtypes(out) -> dict:
    return {k: v.dtype for k, v in folder_tensors(out / "final").items()}


def test_fp8_trains_within_2_percent_of_bf16_mixed_and_saves_an_ordinary_folder(tmp_path):
    out = _runs(tmp_path, bf16={}, fp8={"fp8": "rowwise"})
    want, got = ([v for _, v in losses(out[name])] for name in ("bf16", "fp8"))
    assert len(got) == len(want) == SPEC["max_steps"]
    assert got != want, "the decoder layers' matmuls ran in float8, not bf16"
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0.02, atol=0)
    assert _dtypes(out["fp8"]) == _dtypes(out["bf16"]), "the same keys and dtypes as a bf16-mixed run's"


@pytest.mark.slow
def test_accelerates_mixed_precision_fp8_is_the_rowwise_recipe_and_tensorwise_trains_too(tmp_path):
    """ACCELERATE_MIXED_PRECISION=fp8 (bf16 left off) trains as fp8="rowwise" does, step for step."""
    out = _runs(tmp_path, bf16={}, rowwise={"fp8": "rowwise"}, accelerate={"bf16": False, "accelerate_fp8": True},
                tensorwise={"fp8": "tensorwise"})
    runs = {name: [v for _, v in losses(folder)] for name, folder in out.items()}
    assert runs["accelerate"] == runs["rowwise"]
    torch.testing.assert_close(torch.tensor(runs["tensorwise"]), torch.tensor(runs["bf16"]), rtol=0.02, atol=0)
    assert runs["tensorwise"] != runs["bf16"] and runs["tensorwise"] != runs["rowwise"]


def test_accelerates_mixed_precision_fp8_reaches_load_pipeline_as_rowwise_in_bf16(tmp_path, monkeypatch):
    from transformers import TrainingArguments

    from hfpipe.api import load_pipeline
    from hfpipe.hf.options import load_kwargs
    from hfpipe.pipeline.options import PipelineLayout

    def keywords(fp8=None, **given):
        args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, **given)
        kw = load_kwargs(load_pipeline, PipelineLayout(pp=2), args, None, False, fp8)
        return kw["fp8"], kw["dtype"]

    assert keywords() == (None, "fp32")
    assert keywords("tensorwise", bf16=True) == ("tensorwise", "bf16-mixed")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")  # what accelerate launch --mixed_precision fp8 sets
    assert keywords() == ("rowwise", "bf16-mixed")
    assert keywords("tensorwise") == ("tensorwise", "bf16-mixed")


@pytest.mark.parametrize("given, words", [
    ({"fp8": "rowwise"}, r"^PipelineTrainer\(fp8='rowwise'\) multiplies bf16 activations in float8; set "
                         r"TrainingArguments\(bf16=True\)$"),
    ({"fp8": "mxfp8", "bf16": True}, r"^PipelineTrainer\(fp8='mxfp8'\): choose one of 'rowwise', 'tensorwise'$"),
])
def test_an_fp8_the_pipeline_cannot_run_is_refused_in_one_line_before_loading(tmp_path, given, words):
    from transformers import TrainingArguments

    from hfpipe.errors import ConfigError
    from hfpipe.hf import PipelineTrainer

    fp8 = given.pop("fp8")
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, **given)
    with pytest.raises(ConfigError, match=words):
        PipelineTrainer("unused", args=args, pp=2, fp8=fp8)  # refused before the folder is read


# ---- TRL's faces: the same keyword, the same path (hfpipe.hf.loop._start_pipeline) ------------------------
def _sft(path, args):
    from datasets import Dataset

    from hfpipe.hf import PipelineSFTTrainer

    rows = [{"text": f"Question {i}: what is {i} plus {i % 3}? It is {i + i % 3}."} for i in range(4)]
    return PipelineSFTTrainer(path, args=args, pp=1, fp8="rowwise", train_dataset=Dataset.from_list(rows))


def _dpo(path, args):
    from datasets import Dataset

    from hfpipe.hf import PipelineDPOTrainer

    rows = [{"prompt": f"Question {i}: what is {i} plus 1?", "chosen": f" It is {i + 1}.",
             "rejected": f" Maybe {i * 3 % 7}."} for i in range(4)]
    return PipelineDPOTrainer(path, args=args, pp=1, fp8="rowwise", train_dataset=Dataset.from_list(rows))


#: face -> (its class, its TRL config class, how it is built on a folder)
FACES = {"sft": ("PipelineSFTTrainer", "SFTConfig", _sft), "dpo": ("PipelineDPOTrainer", "DPOConfig", _dpo)}


def _config(face: str, tmp_path, **given):
    import trl

    return getattr(trl, FACES[face][1])(output_dir=str(tmp_path), report_to=[], use_cpu=True, max_steps=1,
                                        per_device_train_batch_size=2, max_length=32, save_strategy="no",
                                        disable_tqdm=True, **given)


@pytest.mark.parametrize("face", list(FACES))
def test_trls_faces_take_fp8_convert_the_decoder_linears_and_train_a_finite_step(face, tmp_path):
    pytest.importorskip("trl")
    import math

    from torchao.float8.float8_linear import Float8Linear

    trainer = FACES[face][2](str(tiny_checkpoint("llama", num_hidden_layers=2)), _config(face, tmp_path, bf16=True))
    linears = {n for stage in trainer.pipeline.modules for n, m in stage.named_modules() if isinstance(m, Float8Linear)}
    assert len(linears) == 2 * 7 and not any(n.startswith("lm_head") for n in linears), sorted(linears)
    loss = trainer.train().training_loss
    assert math.isfinite(loss) and loss > 0, loss


@pytest.mark.parametrize("face", list(FACES))
def test_trls_faces_refuse_fp8_without_bf16_in_one_line_before_loading(face, tmp_path):
    pytest.importorskip("trl")
    from hfpipe.errors import ConfigError

    cls, config, build = FACES[face]
    with pytest.raises(ConfigError, match=rf"^{cls}\(fp8='rowwise'\) multiplies bf16 activations in float8; "
                                          rf"set {config}\(bf16=True\)$"):
        build("unused", _config(face, tmp_path, bf16=False))  # refused before the folder is read


def test_every_face_takes_fp8_as_a_keyword_off_by_default():
    pytest.importorskip("trl")
    import inspect

    from hfpipe.hf import PipelineDPOTrainer, PipelineSFTTrainer, PipelineTrainer

    for face in (PipelineTrainer, PipelineSFTTrainer, PipelineDPOTrainer):
        fp8 = inspect.signature(face.__init__).parameters["fp8"]
        assert (fp8.kind, fp8.default) == (inspect.Parameter.KEYWORD_ONLY, None), face
