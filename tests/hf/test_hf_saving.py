"""``PipelineTrainer.save_model`` into a folder that cannot take the model: one ``ConfigError`` on every rank
naming ``save_model(output_dir=...)``, nothing written or left behind, and the ranks go on together (a script
that catches the error on rank 0 and carries on leaves no rank waiting in a collective).

``save_model`` is :func:`hfpipe.hf.saving.export_model` over the trainer's pipeline; the trainer here is the
few attributes it reads, so the test needs no Trainer loop.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from _dist import caught, run_ranks, tiny_checkpoint


def save_worker(path: str, root: str) -> dict:
    import torch.distributed as dist

    from hfpipe.api import load_pipeline
    from hfpipe.hf.saving import export_model
    from hfpipe.parallel.mesh import init_distributed

    root, mesh = Path(root), init_distributed(2, 1)
    pm = load_pipeline(path, pp=2, microbatches=2, dist=mesh)
    trainer = SimpleNamespace(pipeline=pm, processing_class=None, args={"seed": 0},
                              state=SimpleNamespace(global_step=6))
    if mesh.rank == 0:
        (root / "a-file").write_text("x")
        (root / "taken" / "config.json").mkdir(parents=True)
    dist.barrier()
    out = {"a file": caught(lambda: export_model(trainer, root / "a-file")),
           "config.json a folder": caught(lambda: export_model(trainer, root / "taken"))}
    dist.barrier()  # every rank got here: none was left waiting after another raised
    export_model(trainer, root / "run")
    out["hidden"] = sorted(p.name for p in root.iterdir() if p.name.startswith("."))
    out["taken"] = sorted(p.name for p in (root / "taken").iterdir())
    out["run"] = sorted(p.name for p in (root / "run").iterdir())
    return out


def test_save_model_into_a_bad_target_is_one_error_on_every_rank_and_leaves_nothing(tmp_path):
    path = str(tiny_checkpoint("llama", num_hidden_layers=2))
    results = run_ranks(save_worker, 2, path, str(tmp_path))
    assert results[0] == results[1]  # the same error, and the same view of the folders, on both ranks
    got = results[0]
    assert got["a file"][0] == "ConfigError" and got["a file"][1].startswith(
        f"save_model(output_dir={str(tmp_path / 'a-file')!r}): ") and "is a file" in got["a file"][1]
    assert got["config.json a folder"][0] == "ConfigError"
    assert "config.json is a folder where the model's file config.json goes" in got["config.json a folder"][1]
    assert got["hidden"] == [] and got["taken"] == ["config.json"]
    assert (tmp_path / "a-file").read_text() == "x"
    assert {"config.json", "training_args.bin"} <= set(got["run"])
    assert any(name.endswith(".safetensors") for name in got["run"])


def test_resume_from_checkpoint_takes_a_checkpoint_n_folder_and_names_it_when_given_the_step_inside(tmp_path):
    """transformers reads ``trainer_state.json`` from the folder it is handed: hfpipe's ``step-N`` inside a
    ``checkpoint-N`` would pass hfpipe's look-up and fail in transformers' own read."""
    import pytest

    from hfpipe.errors import ConfigError
    from hfpipe.hf.saving import find_pipeline_checkpoint

    ckpt = tmp_path / "checkpoint-2"
    (ckpt / "step-00000002").mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text("{}")
    with pytest.raises(ConfigError) as e:
        find_pipeline_checkpoint(ckpt / "step-00000002")
    assert str(e.value) == (f"train(resume_from_checkpoint={str(ckpt / 'step-00000002')!r}): pass the Trainer's "
                            f"checkpoint folder {ckpt}, not hfpipe's step folder inside it")
    with pytest.raises(ConfigError, match="is not a checkpoint-N folder a PipelineTrainer saved"):
        find_pipeline_checkpoint(tmp_path)
