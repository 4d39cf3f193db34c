"""The Python API as a script meets it: a DataLoader's partial last batch trains exactly as
transformers does, ``pm.load_checkpoint`` resumes weights, optimizer, scheduler and data position,
and an error from ``load_pipeline``, ``save_pretrained``, ``save_checkpoint`` or ``load_checkpoint``
names the argument and is raised on every rank alike (none is left to die in a collective).

The multi-process cases share one spawn of two ranks (:func:`api_worker`).
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch

from _dist import caught, run_ranks, tiny_checkpoint
from test_train_equivalence import HP, _full, _optimizer, check_equal, first_gradients, train_reference

ROWS = (4, 4, 3)  # the last batch is partial: 3 rows over 2 microbatches
SEQ, MICRO, SAVED_AT = 12, 2, 2


def batches(vocab: int) -> list[dict]:
    """Batches of ``ROWS`` rows with right padding and prompt masking."""
    g = torch.Generator().manual_seed(7)
    out = []
    for rows in ROWS:
        ids = torch.randint(3, vocab, (rows, SEQ), generator=g)
        mask, labels = torch.ones_like(ids), ids.clone()
        mask[-1, -3:], labels[-1, -3:] = 0, -100
        labels[:, :2] = -100
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def _fail_on_rank_1(rank: int) -> None:
    from hfpipe.errors import ConfigError

    if rank == 1:
        raise ConfigError("only rank 1 saw this")


def api_worker(path: str, root: str) -> dict:
    import os
    from pathlib import Path

    from hfpipe.api import load_pipeline
    from hfpipe.parallel.agree import agree
    from hfpipe.parallel.mesh import init_distributed

    root, dist = Path(root), init_distributed(2, 1)
    out = {"log_level": os.environ.get("HFPIPE_LOG_LEVEL")}
    pm = load_pipeline(path, pp=2, schedule="1f1b", microbatches=MICRO, dist=dist)
    opt, sched = _optimizer(pm.named_parameters(), lr_total_steps=len(ROWS))
    grads = first_gradients(opt, pm.named_parameters())
    trainer = pm.trainer(opt, scheduler=sched, max_grad_norm=HP["max_grad_norm"])
    losses, norms = [], []
    for i, batch in enumerate(batches(pm.vocab_size)):
        result = trainer.step(batch)
        losses.append(result.loss)
        norms.append(result.grad_norm)
        if i + 1 == SAVED_AT:
            pm.save_checkpoint(root / "checkpoints", SAVED_AT, opt, scheduler=sched)
            lr_at_save = sched.get_last_lr()
    weights = {k: _full(v) for k, v in pm.model_state_dict().items()}
    out["straight"] = {"loss": losses, "norm": norms, "grads": grads, "weights": weights, "lr_at_save": lr_at_save}

    again = load_pipeline(path, pp=2, schedule="1f1b", microbatches=MICRO, dist=dist)  # a new process's model
    opt2, sched2 = _optimizer(again.named_parameters(), lr_total_steps=len(ROWS))
    fresh_lr = sched2.get_last_lr()
    start = again.load_checkpoint(root / "checkpoints", optimizer=opt2, scheduler=sched2)
    lr_at_start = sched2.get_last_lr()
    trainer2 = again.trainer(opt2, scheduler=sched2, max_grad_norm=HP["max_grad_norm"])
    resumed = [trainer2.step(b).loss for b in batches(pm.vocab_size)[start.batch_in_epoch:]]
    out["resumed"] = {"start": (start.step, start.epoch, start.batch_in_epoch), "loss": resumed,
                      "lr_at_start": lr_at_start, "fresh_lr": fresh_lr, "weights": {k: _full(v) for k, v in again.model_state_dict().items()}}

    pm.save_pretrained(root / "hf")
    pm.save_checkpoint(root / "plain", 1)  # no scheduler state
    (root / "a-file").write_text("x")
    out["errors"] = {
        "save_pretrained into an earlier export": caught(lambda: pm.save_pretrained(root / "hf")),
        "save_pretrained with overwrite=True": caught(lambda: pm.save_pretrained(root / "hf", overwrite=True)),
        "load_checkpoint of no such folder": caught(lambda: again.load_checkpoint(root / "nope")),
        "load_checkpoint without scheduler state": caught(
            lambda: again.load_checkpoint(root / "plain", optimizer=opt2, scheduler=sched2)),
        "save_checkpoint into a file": caught(lambda: pm.save_checkpoint(root / "a-file", 3)),
        "an error on rank 1 only": caught(lambda: agree(lambda: _fail_on_rank_1(dist.rank))),
    }
    # All or nothing: a scheduler over other parameter groups, or an optimizer given by name, is refused
    # before the weights, the optimizer's state or the schedule move.
    before = {k: _full(v).clone() for k, v in again.model_state_dict().items()}
    groups = [{"params": [p]} for p in again.parameters()]  # one group a parameter: not the saved run's count
    other = torch.optim.lr_scheduler.LambdaLR(torch.optim.AdamW(groups, lr=1e-3), [lambda s: 1.0] * len(groups))
    opt_state = repr(opt2.state_dict()["state"])[:2000]
    out["groups"] = (len(opt2.param_groups), len(groups))
    out["errors"]["load_checkpoint with a scheduler over other groups"] = caught(
        lambda: again.load_checkpoint(root / "checkpoints", optimizer=opt2, scheduler=other))
    out["errors"]["load_checkpoint with optimizer='adamw'"] = caught(
        lambda: again.load_checkpoint(root / "checkpoints", optimizer="adamw"))
    after = {k: _full(v) for k, v in again.model_state_dict().items()}
    out["untouched"] = all(torch.equal(before[k], after[k]) for k in before) and (
        repr(opt2.state_dict()["state"])[:2000] == opt_state) and other.last_epoch == 0
    return out


@functools.lru_cache(maxsize=None)
def _spawned(tmp: str) -> tuple[str, dict]:
    path = str(tiny_checkpoint("llama_tied", num_hidden_layers=4))
    hfpipe_logger = logging.getLogger("hfpipe")
    level = hfpipe_logger.level
    hfpipe_logger.setLevel(logging.DEBUG)  # as `hfpipe --log-level debug` sets it: the workers must get it
    try:
        return path, run_ranks(api_worker, 2, path, tmp)
    finally:
        hfpipe_logger.setLevel(level)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return _spawned(str(tmp_path_factory.mktemp("api")))


@pytest.mark.slow
def test_a_partial_last_batch_trains_exactly_as_transformers(ranks):
    from transformers import AutoModelForCausalLM

    path, results = ranks
    model = AutoModelForCausalLM.from_pretrained(path)
    ref = train_reference(model, batches(model.config.vocab_size),
                          *_optimizer(list(model.named_parameters()), lr_total_steps=len(ROWS)))
    check_equal(ref, {r: {"1f1b": res["straight"]} for r, res in results.items()}, ("1f1b",))


@pytest.mark.slow
def test_load_checkpoint_resumes_weights_optimizer_scheduler_and_data_position(ranks):
    for res in ranks[1].values():
        straight, resumed = res["straight"], res["resumed"]
        assert resumed["start"] == (SAVED_AT, 0, SAVED_AT)
        assert resumed["loss"] == straight["loss"][SAVED_AT:]  # to the bit: the same state, the same step
        for name, w in resumed["weights"].items():
            assert torch.equal(w, straight["weights"][name]), name
        assert resumed["lr_at_start"] == straight["lr_at_save"] != resumed["fresh_lr"]  # the scheduler's state came back


@pytest.mark.slow
def test_api_errors_name_arguments_and_are_the_same_on_every_rank(ranks):
    errors = [res["errors"] for res in ranks[1].values()]
    assert errors[0] == errors[1]  # the same error, class and words, on both ranks
    got = errors[0]
    assert got["save_pretrained with overwrite=True"] is None
    kind, text = got["save_pretrained into an earlier export"]
    assert kind == "ExportError" and "save_pretrained(out=" in text and "overwrite=True" in text
    assert "--" not in text
    assert got["load_checkpoint of no such folder"][0] == "CheckpointError"
    assert "load_checkpoint(path=" in got["load_checkpoint of no such folder"][1]
    assert "load_checkpoint(scheduler=...)" in got["load_checkpoint without scheduler state"][1]
    assert "save_checkpoint(root=" in got["save_checkpoint into a file"][1]
    assert got["an error on rank 1 only"] == ("ConfigError", "only rank 1 saw this")
    saved, mine = ranks[1][0]["groups"]
    assert saved != mine
    kind, text = got["load_checkpoint with a scheduler over other groups"]
    assert kind == "CheckpointError" and text.startswith(
        f"load_checkpoint(scheduler=...): the checkpoint's scheduler ran over {saved} parameter groups")
    kind, text = got["load_checkpoint with optimizer='adamw'"]
    assert kind == "CheckpointError" and text.startswith("load_checkpoint(optimizer='adamw'): pass the torch optimizer")
    assert all(res["untouched"] for res in ranks[1].values())


@pytest.mark.slow
def test_the_launcher_hands_its_log_level_to_the_workers(ranks):
    assert {res["log_level"] for res in ranks[1].values()} == {"DEBUG"}


def test_load_pipeline_refuses_in_argument_names():
    from hfpipe.api import load_pipeline
    from hfpipe.errors import HfpipeError, ParallelError

    path = str(tiny_checkpoint("llama_tied", num_hidden_layers=4))
    with pytest.raises(ParallelError) as e:
        load_pipeline(path, pp=1, schedule="nope")
    assert str(e.value).startswith("load_pipeline(model=") and "schedule 'nope' is unknown" in str(e.value)
    assert "--" not in str(e.value)
    with pytest.raises(HfpipeError) as e:  # the checks below the face speak flags; the face its arguments
        load_pipeline(path, pp=1, quantize_base="nf4")
    assert "quantize_base trains LoRA adapters" in str(e.value) and "lora=LoraConfig(r=R)" in str(e.value)
    assert "--" not in str(e.value)


def test_each_rank_level_says_each_thing_once(monkeypatch):
    from hfpipe.progress.logs import rank_level

    monkeypatch.setenv("HFPIPE_LOG_LEVEL", "info")
    assert (rank_level(0), rank_level(1)) == ("INFO", "WARNING")
    monkeypatch.setenv("HFPIPE_LOG_LEVEL", "DEBUG")
    assert (rank_level(0), rank_level(1)) == ("DEBUG", "DEBUG")
    monkeypatch.setenv("HFPIPE_LOG_LEVEL", "ERROR")
    assert rank_level(1) == "ERROR"


def test_a_failed_save_pretrained_removes_the_parents_it_made(tmp_path, monkeypatch):
    """save_pretrained makes the parents of ``out`` before the export; an export stopped midway removes them."""
    from hfpipe.api import load_pipeline
    from hfpipe.export import hf_folder

    pm = load_pipeline(str(tiny_checkpoint("llama", num_hidden_layers=2)), pp=1)

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(hf_folder, "build_folder", stopped)
    with pytest.raises(KeyboardInterrupt):
        pm.save_pretrained(str(tmp_path / "new" / "out"))
    assert not (tmp_path / "new").exists()
