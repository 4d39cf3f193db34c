"""A bf16-mixed checkpoint crosses between one replica (no FSDP2) and FSDP2 both ways, exactly.

At ``--dp 1`` bf16-mixed now holds plain fp32 masters where FSDP2 held one-rank DTensors; DCP stores both
as whole tensors. A checkpoint saved by the one-replica path resumes under FSDP2's one-rank path (the
oracle) and trains on bit for bit as the run that saved it; it loads at ``--dp 2`` (FSDP2 shards) with every
weight and AdamW moment equal; and what ``--dp 2`` saves loads back at ``--dp 1`` equal.
"""

from __future__ import annotations

import pytest
import torch

from _dist import run_ranks, tiny_checkpoint

MICRO = 2


def _batch(vocab: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (4, 10), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _whole(t) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _state(pm, opt) -> dict:
    """Every weight and AdamW moment under its full-model name, whole."""
    out = {f"w:{k}": _whole(v) for k, v in pm.model_state_dict().items()}
    for name, p in pm.named_parameters():
        for key, v in opt.state.get(p, {}).items():
            out[f"{key}:{name}"] = _whole(v)
    return out


def _loaded(path, dims, root, *, fsdp2: bool = False):
    """A fresh model of ``dims`` with ``root``'s checkpoint loaded, and its optimizer."""
    import hfpipe.parallel.fsdp as fsdp
    from hfpipe.api import load_pipeline
    from hfpipe.parallel.mesh import init_distributed

    fsdp._FSDP2_AT_ONE_REPLICA = fsdp2
    try:
        pm = load_pipeline(path, pp=dims.pp, dp=dims.dp, microbatches=MICRO, dtype="bf16-mixed",
                           dist=init_distributed(dims))
    finally:
        fsdp._FSDP2_AT_ONE_REPLICA = False
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    pm.load_checkpoint(root, optimizer=opt)
    return pm, opt


def resume_worker(path: str, root: str) -> dict:
    from hfpipe.api import load_pipeline
    from hfpipe.parallel.dims import ParallelDims
    from hfpipe.parallel.mesh import init_distributed

    one, two = ParallelDims(pp=2), ParallelDims(pp=1, dp=2)
    pm = load_pipeline(path, pp=2, microbatches=MICRO, dtype="bf16-mixed", dist=init_distributed(one))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    trainer, vocab = pm.trainer(opt), pm.source.config.vocab_size
    for seed in (1, 2):
        trainer.step(_batch(vocab, seed))
    pm.save_checkpoint(f"{root}/one", 2, opt)
    saved = _state(pm, opt)
    on = trainer.step(_batch(vocab, 3)).loss
    out = {"saved_one": saved, "straight": (on, _state(pm, opt))}

    old, old_opt = _loaded(path, one, f"{root}/one", fsdp2=True)  # FSDP2's one-rank path
    out["loaded_old"] = _state(old, old_opt)
    out["resumed_old"] = (old.trainer(old_opt).step(_batch(vocab, 3)).loss, _state(old, old_opt))

    dp2, dp2_opt = _loaded(path, two, f"{root}/one")
    out["loaded_dp2"] = _state(dp2, dp2_opt)
    dp2.trainer(dp2_opt).step(_batch(vocab, 10 + torch.distributed.get_rank()))  # each replica its own rows
    dp2.save_checkpoint(f"{root}/two", 3, dp2_opt)
    out["saved_two"] = _state(dp2, dp2_opt)

    back, back_opt = _loaded(path, one, f"{root}/two")
    out["loaded_back"] = _state(back, back_opt)
    return out


@pytest.mark.slow
def test_a_one_replica_checkpoint_resumes_under_fsdp2_and_at_dp2_and_back(tmp_path):
    path = tiny_checkpoint("llama", num_hidden_layers=2)
    ranks = run_ranks(resume_worker, 2, str(path), str(tmp_path))
    # the dp 2 states are whole on every rank; a pp 2 rank holds its stage's part
    whole_two = {**ranks[0]["saved_two"], **ranks[1]["saved_two"]}
    for rank, r in ranks.items():
        assert any(k.startswith("exp_avg:") for k in r["saved_one"]), "the optimizer's moments are compared"
        for what in ("loaded_old", "loaded_back"):
            expected = r["saved_one"] if what == "loaded_old" else {k: whole_two[k] for k in r["loaded_back"]}
            assert r[what].keys() == expected.keys(), what
            for k, v in expected.items():
                assert torch.equal(r[what][k], v), f"rank {rank}: {what}: {k} differs from what was saved"
        loss, state = r["resumed_old"]
        assert loss == r["straight"][0], "FSDP2 resumes the one-replica run bit for bit"
        for k, v in r["straight"][1].items():
            assert torch.equal(state[k], v), f"rank {rank}: {k} after the resumed step"
    saved = {**ranks[0]["saved_one"], **ranks[1]["saved_one"]}
    for rank, r in ranks.items():
        assert r["loaded_dp2"].keys() == saved.keys()
        for k, v in saved.items():
            assert torch.equal(r["loaded_dp2"][k], v), f"rank {rank}: dp 2 loaded {k} other than saved"
