"""``--compile`` with ``--tp`` and the axes that change a layer's linears: float8 training (``fp8=``) and LoRA.

Compiled float8 layers split over tp ranks (sequence parallel) train as the eager ones do, and within the float8
tolerance of bf16-mixed (``tests/quant/test_quant_fp8_training.py``'s: 2%, while differing from it), at a second
sequence length too, where the layers run a symbolic graph. LoRA's adapters split over tp ranks, compiled, train as
PEFT's in one process; a row-split layer's ``lora_B`` multiplies row by row for it (``hfpipe.lora.tensor``), since
torch 2.13 cannot trace its ``F.linear`` at that second length (shown here in torch alone). The default suite runs
one aot_eager float8 case; inductor, both recipes, LoRA and torch's side are ``slow``.
"""

from __future__ import annotations

import pytest
import torch

from _dist import run_ranks, tiny_checkpoint


@pytest.mark.slow
def test_compiled_lora_at_pp2_x_tp2_matches_peft():
    """All-linear adapters split as their tp-split bases are (hfpipe.lora.tensor), inside compiled layers, sequence
    parallel, the length changing between steps: PEFT in one process (fp32, 1e-5)."""
    from test_lora_equivalence import run_and_check

    run_and_check("llama", 2, ("1f1b",), options={"tp": 2, "compile": True})


def sequence_parallel_linear(rows: int, batched: bool) -> list[str]:
    """On 2 ranks: a linear under torch's ``SequenceParallel`` (a row-split layer's ``lora_B``), compiled, on a
    sequence-sharded input of 16 then 12 tokens, as torch runs it or (``batched``) by hfpipe's
    ``_rows_times_weight``; what each call said."""
    from functools import partial

    import torch._functorch.config as functorch_config
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    from hfpipe.lora.tensor import _rows_times_weight

    functorch_config.enable_autograd_cache = False  # each process compiles its own graphs
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    linear = torch.nn.Linear(4, 16, bias=False)
    parallelize_module(linear, mesh, SequenceParallel(sequence_dim=1, use_local_output=False))
    if batched:
        linear.forward = partial(_rows_times_weight, linear)
    linear.compile(backend="aot_eager")  # the same trace as inductor's, without C++ builds
    said = []
    for seq in (16, 12):
        x = DTensor.from_local(torch.randn(rows, seq // 2, 4), mesh, [Shard(1)], run_check=False)
        try:
            linear(x).to_local().sum().backward()
            said.append("ran")
        except Exception as e:  # noqa: BLE001 - what torch raised is the finding
            said.append(f"{type(e).__name__}: {e}")
    return said


@pytest.mark.slow
@pytest.mark.parametrize("rows", [1, 2])
def test_a_compiled_sequence_parallel_linear_fails_at_a_second_length_and_rows_times_weight_runs(rows):
    """Why a row-split layer's ``lora_B`` multiplies by ``bmm`` (torch 2.13): torch's own ``F.linear`` on a
    sequence-sharded DTensor traces the first length (static sizes) and recurses without end at the second
    (symbolic); one matmul per row runs both. When the first assertion fails, torch has fixed it: drop
    ``_rows_times_weight``."""
    plain, batched = (run_ranks(sequence_parallel_linear, 2, rows, b) for b in (False, True))
    for rank in (0, 1):
        assert plain[rank][0] == "ran" and "maximum recursion depth exceeded" in plain[rank][1], plain
        assert batched[rank] == ["ran", "ran"], batched


def float8_worker(path: str, tp: int, recipe: str, backend: str, lengths: tuple, bf16: bool) -> dict:
    """Losses of ``recipe`` compiled with ``backend``, of ``recipe`` eager and (``bf16``) of bf16-mixed eager, each
    on pp 1 x tp ``tp`` (sequence parallel), over one-row microbatches of ``lengths`` tokens, a length a step (the
    second one: the compiled layers' symbolic graph); the float8 linears of each run and the graphs compiled."""
    from torch._dynamo.utils import counters
    from torchao.float8.float8_linear import Float8Linear

    from hfpipe.api import load_pipeline
    from hfpipe.parallel.dims import ParallelDims
    from hfpipe.parallel.mesh import init_distributed
    from test_quant_fp8_training import LR

    dist = init_distributed(ParallelDims(pp=1, tp=tp))
    runs = {"compiled": (recipe, {"compile": True, "compile_backend": backend}), "eager": (recipe, {})}
    out = {}
    for name, (fp8, extra) in {**runs, **({"bf16": (None, {})} if bf16 else {})}.items():
        pm = load_pipeline(path, pp=1, tp=tp, dtype="bf16-mixed", fp8=fp8, microbatches=2, dist=dist, **extra)
        trainer = pm.trainer(torch.optim.AdamW([p for _, p in pm.named_parameters()], lr=LR))
        g, losses = torch.Generator().manual_seed(0), []
        for seq in lengths:
            ids = torch.randint(3, pm.vocab_size, (2, seq), generator=g)
            batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
            losses.append(trainer.step(batch).loss)
        out[name] = {"loss": losses, "float8": sum(isinstance(m, Float8Linear) for s in pm.modules for m in s.modules())}
    out["graphs"] = counters["stats"]["unique_graphs"]
    return out


def _run_float8(recipe: str, backend: str, lengths: tuple, bf16: bool) -> dict:
    pytest.importorskip("torchao", reason="--fp8 needs torchao (pip install 'hfpipe[qlora]')")
    path = str(tiny_checkpoint("llama", num_hidden_layers=2))  # every decoder-layer dim a multiple of 16
    results = run_ranks(float8_worker, 2, path, 2, recipe, backend, lengths, bf16)
    for rank, r in results.items():
        assert r["graphs"] >= 1 and r["compiled"]["float8"] == r["eager"]["float8"] == 14, (rank, r)
        got, eager = torch.tensor(r["compiled"]["loss"]), torch.tensor(r["eager"]["loss"])
        torch.testing.assert_close(got, eager, rtol=0.02, atol=0, msg=lambda m: f"rank {rank}, vs eager: {m}")
        if bf16:
            want = torch.tensor(r["bf16"]["loss"])
            assert not torch.equal(got, want), f"rank {rank}: the compiled matmuls ran in float8"
            torch.testing.assert_close(got, want, rtol=0.02, atol=0, msg=lambda m: f"rank {rank}, vs bf16: {m}")
    return results


def test_compiled_fp8_at_tp2_trains_as_eager_fp8_does():
    """torchao's float8 linears split by tp's styles inside compiled layers, a second length included; aot_eager
    traces what inductor gets (the slow test below runs inductor against bf16-mixed too)."""
    _run_float8("rowwise", "aot_eager", (32, 24), bf16=False)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_compiled_fp8_at_tp2_with_inductor_within_2_percent_of_bf16_mixed(recipe):
    _run_float8(recipe, "inductor", (32, 24, 32, 16), bf16=True)
