"""``hfpipe plan --method dpo``'s price of the reference pass is what the pass holds.

The pass (:func:`hfpipe.train.reference.reference_logps`) runs forward only on real gloo processes at pp 2; a
dispatch mode counts every tensor a rank creates during it, storage by storage, until it is freed: the peak of
those bytes (weights and the batch made before it are not counted) is what the plan prices as the pass's
activations (:mod:`hfpipe.plan.preference`). The plan must not under-price it, nor over-price it by more than 2x.
"""

from __future__ import annotations

import weakref
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from _dist import run_ranks, tiny_checkpoint

pytestmark = pytest.mark.slow
pytest.importorskip("trl")

SEQ, PAIRS, MICRO = 64, 4, 2


class LiveBytes(TorchDispatchMode):
    """The most bytes the tensors created under it held at once (a storage counts once, until freed)."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, int] = {}
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        ptr, size = storage.data_ptr(), storage.nbytes()
        if not ptr:
            return
        if ptr not in self.refs:
            self.refs[ptr] = 0
            self.now += size
            self.peak = max(self.peak, self.now)
        self.refs[ptr] += 1
        weakref.finalize(t, self._drop, ptr, size)

    def _drop(self, ptr: int, size: int) -> None:
        self.refs[ptr] -= 1
        if not self.refs[ptr]:
            del self.refs[ptr]
            self.now -= size


def _batch(vocab: int) -> dict:
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    gen = torch.Generator().manual_seed(0)
    half = SEQ // 2
    rows = [{k: torch.randint(3, vocab, (half,), generator=gen).tolist() for k in ("prompt_ids", "chosen_ids",
                                                                                 "rejected_ids")}
            for _ in range(PAIRS)]
    return DataCollatorForPreference(pad_token_id=0)(rows)


def _held(path: str) -> tuple[int, int]:
    """(this rank's pipeline rank, the peak bytes its reference pass held)."""
    from hfpipe.api import load_pipeline
    from hfpipe.loss.preference import Preference, PreferenceConfig
    from hfpipe.parallel.dims import ParallelDims
    from hfpipe.parallel.mesh import init_distributed
    from hfpipe.train.reference import reference_logps

    info = init_distributed(ParallelDims(pp=2))
    pm = load_pipeline(path, pp=2, microbatches=MICRO, dist=info)
    pm.pipe.use_objective(Preference(PreferenceConfig()))
    batch = _batch(pm.source.config.vocab_size)
    reference_logps(pm, [batch])  # builds the schedule: not counted
    with LiveBytes() as counter:
        reference_logps(pm, [batch])
    return info.pp_rank, counter.peak


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_the_reference_pass_holds_what_the_plan_prices(kind):
    from hfpipe.plan.report import plan_report
    from hfpipe.source.config import load_config

    path = tiny_checkpoint(kind, num_hidden_layers=4)
    measured = dict(run_ranks(_held, 2, str(path)).values())
    planned = plan_report(load_config(Path(path)), 2, microbatches=MICRO, seq_len=SEQ, batch_size=PAIRS,
                          dtype="fp32", train_method="dpo").reference.activation_bytes
    print(kind, "planned", list(planned), "measured", [measured[r] for r in (0, 1)])
    for rank in (0, 1):
        assert measured[rank] <= planned[rank] <= 2 * measured[rank], (rank, planned, measured)
