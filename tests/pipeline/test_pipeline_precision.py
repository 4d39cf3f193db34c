"""Precision modes: bf16-mixed keeps fp32 masters and computes in bf16; pure bf16 stores bf16.

Exactness is only promised in fp32 (tests/train/test_train_equivalence.py); here the bf16 runs must
track the fp32 run closely and keep their parameters in the promised dtypes.
"""

from __future__ import annotations

import torch

from _dist import run_ranks, tiny_checkpoint
from test_train_equivalence import HP, LAYERS, MICRO, _optimizer, make_batches


def precision_worker(path: str) -> dict:
    from hfpipe.api import load_pipeline
    from hfpipe.parallel.mesh import init_distributed

    dist = init_distributed(2)
    out = {}
    for dtype in ("fp32", "bf16-mixed", "bf16"):
        pm = load_pipeline(path, pp=2, schedule="1f1b", microbatches=MICRO, dtype=dtype, dist=dist)
        opt, sched = _optimizer(pm.named_parameters())
        trainer = pm.trainer(opt, scheduler=sched, max_grad_norm=HP["max_grad_norm"])
        losses = [trainer.step(s[0]).loss for s in make_batches(pm.source.config.vocab_size, steps=3)]
        param_dtypes = {str(getattr(p, "dtype")) for p in pm.parameters()}
        state_dtypes = {str(v.dtype) for st in opt.state.values() for k, v in st.items() if k != "step"}
        out[dtype] = {"loss": losses, "params": param_dtypes, "state": state_dtypes}
    return out


def test_bf16_modes_track_fp32_and_keep_their_dtypes():
    results = run_ranks(precision_worker, 2, str(tiny_checkpoint("llama", num_hidden_layers=LAYERS)))
    for rank, r in results.items():
        assert r["fp32"]["params"] == {"torch.float32"}
        assert r["bf16-mixed"]["params"] == {"torch.float32"}, "bf16-mixed keeps fp32 master weights"
        assert r["bf16-mixed"]["state"] == {"torch.float32"}, "and fp32 optimizer state"
        assert r["bf16"]["params"] == {"torch.bfloat16"}
        fp32 = torch.tensor(r["fp32"]["loss"])
        for mode in ("bf16-mixed", "bf16"):
            got = torch.tensor(r[mode]["loss"])
            assert not torch.equal(got, fp32), f"{mode} must really compute in bf16"
            torch.testing.assert_close(got, fp32, atol=5e-2, rtol=0)
