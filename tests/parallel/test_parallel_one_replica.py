"""bf16-mixed at one replica without FSDP2 trains bit for bit as FSDP2's one-rank path did.

The oracle is the real FSDP2 (``hfpipe.parallel.fsdp._FSDP2_AT_ONE_REPLICA``, the path every bf16-mixed run
at ``--dp 1`` took before): the same losses, grad norms and weights after several optimizer steps, compared
with ``torch.equal``, where both paths sum in the same order (bf16 within a microbatch, fp32 across
microbatches and across the accumulation batches of one optimizer step). The registered parameters stay
fp32 masters under the full model's names, now plain tensors (FSDP2's were one-rank DTensors).
The default suite runs two cheap spawns and a unit test; ``pytest -m slow`` runs the matrix.
"""

from __future__ import annotations

import pytest
import torch

from _dist import run_ranks, tiny_checkpoint

STEPS, ACCUM, MICRO = 2, 2, 4
LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])


def _batches(vocab: int) -> list[list[dict]]:
    """``STEPS`` optimizer steps of ``ACCUM`` accumulation batches each; lengths change between batches."""
    g = torch.Generator().manual_seed(7)
    steps = []
    for step in range(STEPS):
        batches = []
        for a in range(ACCUM):
            seq = 12 - 4 * ((step + a) % 2)
            ids = torch.randint(3, vocab, (MICRO, seq), generator=g)
            labels = ids.clone()
            labels[:, : 1 + a] = -100
            batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
        steps.append(batches)
    return steps


def run_both(path: str, pp: int, kw: dict) -> dict:
    """Train the same run through FSDP2's one-rank path and through the new one; what each ended with."""
    import hfpipe.parallel.fsdp as fsdp
    from hfpipe.api import load_pipeline
    from hfpipe.parallel.dims import ParallelDims
    from hfpipe.parallel.mesh import init_distributed

    if kw.pop("lora", False):
        from peft import LoraConfig
        kw["lora"] = LoraConfig(**LORA)
    dist = init_distributed(ParallelDims(pp=pp, tp=kw.get("tp", 1)))
    out = {}
    for old in (True, False):
        fsdp._FSDP2_AT_ONE_REPLICA = old
        pm = load_pipeline(path, pp=pp, microbatches=MICRO, dtype="bf16-mixed", dist=dist, **kw)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, foreach=True)  # (groups by kind under tp)
        trainer = pm.trainer(opt, max_grad_norm=0.5)
        steps = _batches(pm.source.config.vocab_size)
        results = [trainer.step(steps[0])]  # both lengths: every graph a compiled layer needs
        # an evaluation between steps (its head loss runs after the last stage's forward, on the copies)
        evaluated = (trainer.eval_loss(steps[0][0]), _whole_or_none(pm.forward(steps[0][1])))
        recompiles = _recompiles()
        results += [trainer.step(b) for b in steps[1:]]
        named = dict(pm.named_parameters())
        out["old" if old else "new"] = {
            "loss": [r.loss for r in results], "norm": [r.grad_norm for r in results],
            "weights": {n: _whole(p) for n, p in named.items()},
            "kinds": {type(p.data).__name__ for p in named.values()},
            "dtypes": {str(p.dtype) for p in named.values() if p.requires_grad},
            "state": {str(v.dtype) for st in opt.state.values() for k, v in st.items() if k != "step"},
            "recompiles": _recompiles() - recompiles,
            "eval": evaluated,
            "masters": {id(p) for p in named.values() if p.requires_grad} == {id(p) for g in opt.param_groups
                                                                     for p in g["params"]},
        }
    fsdp._FSDP2_AT_ONE_REPLICA = False
    return out


def _recompiles() -> int:
    from hfpipe.models.compile import watch_recompiles

    return watch_recompiles().count


def _whole_or_none(t):
    return None if t is None else _whole(t)


def _whole(p) -> torch.Tensor:
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()


def assert_same_run(path, pp: int, **kw):
    for rank, r in run_ranks(run_both, pp * kw.get("tp", 1), str(path), pp, kw).items():
        old, new = r["old"], r["new"]
        assert old["loss"] == new["loss"], f"rank {rank}: losses {new['loss']} != FSDP2's {old['loss']}"
        assert old["norm"] == new["norm"], f"rank {rank}: grad norms {new['norm']} != FSDP2's {old['norm']}"
        assert old["weights"].keys() == new["weights"].keys(), "the same parameters under the same names"
        for name, w in old["weights"].items():
            assert torch.equal(w, new["weights"][name]), f"rank {rank}: {name} differs from FSDP2's after {STEPS} steps"
        assert new["dtypes"] == {"torch.float32"} and new["state"] == {"torch.float32"}, "fp32 masters and state"
        assert new["masters"], "outside a step the registered parameters are the optimizer's masters"
        assert old["eval"][0] == new["eval"][0], "the same evaluation loss"
        assert (old["eval"][1] is None) == (new["eval"][1] is None)
        assert new["eval"][1] is None or torch.equal(old["eval"][1], new["eval"][1]), "the same logits"
        assert "DTensor" in old["kinds"], "the oracle ran FSDP2"
        assert "DTensor" not in new["kinds"] or kw.get("tp", 1) > 1, "one replica holds plain tensors"
        assert new["recompiles"] == 0, "a step after the first compiles nothing anew"
        assert len(set(new["loss"])) == STEPS and new["loss"] != [0.0] * STEPS, "the run trained"


@pytest.fixture(scope="module")
def llama():
    return tiny_checkpoint("llama", num_hidden_layers=4)


def test_one_replica_matches_fsdp2_pp2_split_backward_full_ac(llama):
    # a split-backward schedule (the weights' gradients found by their nodes) and checkpointing's recompute
    assert_same_run(llama, 2, schedule="zbv", activation_checkpointing="full")


def test_one_replica_matches_fsdp2_compiled(llama):
    # layers compiled in place (aot_eager here, inductor in the matrix) with the copies swapped in under them
    assert_same_run(llama, 1, compile=True, compile_backend="aot_eager", activation_checkpointing="full")

SLOW_CASES = {  # name: (checkpoint kind, pp, load_pipeline keywords)
    "pp1": ("llama", 1, dict()),
    "pp2-full-ac": ("llama", 2, dict(activation_checkpointing="full")),
    "lora": ("llama", 1, dict(lora=True)),
    "compiled-pp2": ("llama", 2, dict(compile=True, compile_backend="aot_eager")),
    "gpipe": ("llama", 2, dict(schedule="gpipe")),
    "interleaved-1f1b": ("llama", 2, dict(schedule="interleaved-1f1b")),
    "looped-bfs": ("llama", 2, dict(schedule="looped-bfs")),
    "interleaved-zb": ("llama", 2, dict(schedule="interleaved-zb")),
    "dualpipev": ("llama", 2, dict(schedule="dualpipev")),
    "selective-ac": ("llama", 2, dict(activation_checkpointing="selective")),
    "chunked-head-zbv": ("llama", 2, dict(schedule="zbv", loss_chunk_tokens=4)),
    "chunked-head-1f1b": ("llama", 1, dict(loss_chunk_tokens=4, activation_checkpointing="full")),
    "tied-pp1": ("gemma", 1, dict()),
    "tied-pp2": ("gemma", 2, dict()),
    "moe-router-sums": ("mixtral", 2, dict()),
    "lora-pp2-zbv": ("llama", 2, dict(lora=True, schedule="zbv")),
    "lora-nf4-base": ("llama", 1, dict(lora=True, quantize_base="nf4")),
    "fp8-rowwise": ("llama", 1, dict(fp8="rowwise")),
    "tp2": ("llama", 1, dict(tp=2)),
    "inductor-full-ac": ("llama", 1, dict(compile=True, activation_checkpointing="full")),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SLOW_CASES))
def test_one_replica_matches_fsdp2_matrix(case):
    kind, pp, kw = SLOW_CASES[case]
    path = tiny_checkpoint(kind, num_hidden_layers=4)
    assert_same_run(path, pp, **kw)


class _Stage(torch.nn.Module):
    """Two linear "layers" and a head tied to the first (one master under two names)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleDict({"0": torch.nn.Linear(8, 8), "1": torch.nn.Linear(8, 8)})
        self.head = torch.nn.Linear(8, 8, bias=False)
        self.head.weight = self.model.layers["0"].weight

    def forward(self, x):
        return self.head(self.model.layers["1"](self.model.layers["0"](x)))


def test_copies_live_for_a_step_gradients_sum_as_fsdp2_and_a_changed_master_is_cast_anew():
    from hfpipe.parallel.one_replica import apply_one_replica, one_replica_of, release

    stage, bf16 = _Stage(), _Stage().to(torch.bfloat16)  # bf16: the compute copies, by hand (the oracle)
    apply_one_replica([stage], torch.bfloat16, lambda m: set())
    masters = dict(stage.named_parameters())
    mixed = one_replica_of(stage)
    xs = [torch.randn(3, 8, generator=torch.Generator().manual_seed(i)) for i in range(2)]  # fp32: cast per layer
    for x in xs:
        stage(x).square().sum().backward()
        assert {str(p.dtype) for p in stage.parameters()} == {"torch.bfloat16"}, "the copies, until the step ends"
        mixed.post_backward()
    mixed.reshard()
    assert dict(stage.named_parameters()) == masters, "the masters again, under the same names"
    grads = []
    for x in xs:
        bf16.zero_grad(set_to_none=True)
        bf16(x.to(torch.bfloat16)).square().sum().backward()  # the tied weight's two uses sum in bf16
        grads.append({n: p.grad for n, p in bf16.named_parameters()})
    for n, p in masters.items():
        assert torch.equal(p.grad, grads[0][n].float() + grads[1][n]), f"{n}: upcast per microbatch, summed in fp32"

    with torch.no_grad():
        stage(xs[0])  # a forward-only pass left unreleased: its copies stay registered
    stale, before = next(stage.parameters()), {n: p._version for n, p in masters.items()}
    torch.optim.SGD(masters.values(), lr=0.1).step()
    assert all(p._version > before[n] for n, p in masters.items()), "an optimizer step bumps every master's version"
    with torch.no_grad():
        stage(xs[0])
    assert next(stage.parameters()) is not stale, "a copy is cast anew once its master changed"
    assert torch.equal(next(stage.parameters()), masters["model.layers.0.weight"].to(torch.bfloat16))
    release([stage])
    before = {n: p._version for n, p in masters.items()}
    stage.load_state_dict({k: v + 1 for k, v in stage.state_dict().items()})
    assert all(p._version > before[n] for n, p in masters.items()), "a checkpoint's load bumps them too"
