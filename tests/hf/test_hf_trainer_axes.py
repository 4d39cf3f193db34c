"""PipelineTrainer on the axes beside pp: context (cp), tensor (tp) and expert (ep) parallelism.

The spec is ``tests/hf/test_hf_trainer.py``'s: the same Trainer script in one process with transformers' ``Trainer``
and under ``torchrun`` with ``PipelineTrainer``; logged losses, grad norms, the eval loss and ``save_model()``'s
tensors (whole, under the source keys) agree within 1e-5 (fp32, CPU), and one process prints the logs.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from _dist import tiny_checkpoint
from test_hf_trainer import assert_same_run, history, losses, run_pair

IGNORE = -100


# ---- the token count under cp (pure logic, default run) ---------------------------------------------
def _cp_loop(cp: int, rank: int):
    """A PipelineLoop whose pipeline is cp rank ``rank`` of ``cp``, alone in its process (no group)."""
    from hfpipe.hf.loop import PipelineLoop
    from hfpipe.loss.objective import TokenMean
    from hfpipe.parallel.context import ContextParallel
    from hfpipe.pipeline.schedule import Pipeline
    from hfpipe.train.step import StepEngine

    loop = PipelineLoop()
    pipe = SimpleNamespace(context=ContextParallel(None, cp, rank))
    pipe.local = lambda batch: Pipeline.local(pipe, batch)
    loop.pipeline = SimpleNamespace(pipe=pipe, dist=SimpleNamespace(dims=SimpleNamespace(cp=cp)))
    steps = SimpleNamespace(dist=SimpleNamespace(batch_group=None), objective=TokenMean(), vocab_size=None)
    loop._steps = SimpleNamespace(step_count=lambda batches: StepEngine.step_count(steps, batches),
                                  local_batches=lambda *a: StepEngine.local_batches(steps, *a))
    return loop


def _batches(seed: int = 0) -> list[dict]:
    """Two accumulation batches of padded rows (-100 on the padding, as DataCollatorForLanguageModeling)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(2):
        ids = torch.randint(0, 50, (3, 16), generator=g)
        labels = ids.clone()
        labels[0, 11:] = IGNORE
        labels[2, 5:] = IGNORE
        out.append({"input_ids": ids, "labels": labels})
    return out


@pytest.mark.parametrize("cp", [2, 4])
def test_under_cp_the_step_tokens_summed_over_the_cp_ranks_are_the_plain_trainers(cp):
    """transformers counts ``labels[..., 1:] != -100`` over the step's batches (num_items_in_batch); each cp
    rank counts its own tokens of the shifted labels, and the sum over the cp group is that count."""
    batches = _batches()
    want = sum(int(b["labels"][..., 1:].ne(IGNORE).sum()) for b in batches)
    counts = [int(_cp_loop(cp, r)._get_num_items_in_batch(batches, "cpu")) for r in range(cp)]
    assert sum(counts) == want, f"cp ranks count {counts}, the plain Trainer {want}"
    assert all(0 < c < want for c in counts)  # each rank counted a part, not the whole rows


def test_under_cp_a_sequence_length_the_chunks_do_not_divide_is_refused_in_the_trainers_terms():
    from hfpipe.errors import ParallelError

    batch = {"input_ids": torch.zeros(2, 18, dtype=torch.long), "labels": torch.zeros(2, 18, dtype=torch.long)}
    with pytest.raises(ParallelError, match=re.escape("PipelineTrainer(cp=2): a batch of sequence length 18 does "
                                                      "not split into 4 equal chunks; pad rows to a multiple of 4")):
        _cp_loop(2, 0)._get_num_items_in_batch([batch], "cpu")


# ---- slow: the runs against the plain Trainer ---------------------------------------------------------
def _printed_logs(out) -> list[str]:
    """The log lines the Trainer's PrinterCallback printed (``disable_tqdm``), over every process of the run."""
    text = (out.parent / f"{out.name}.log").read_text()
    return [line for line in text.splitlines() if line.startswith("{'loss'")]


def _assert_one_process_logs(got, want) -> None:
    """As many printed training logs as the plain Trainer logged steps: one process prints (not every loss rank)."""
    assert len(_printed_logs(got)) == len(losses(want)) > 0, _printed_logs(got)


@pytest.mark.slow
def test_dp2_x_cp2_with_accumulation_equals_the_plain_trainer_and_its_eval_loss(tmp_path):
    """Each sequence split over 2 cp ranks, 2 dp replicas of 4 rows, 2 accumulation batches: the loss is divided
    by the plain Trainer's token count, and evaluate() gives its eval loss (rows counted once per replica)."""
    got, want = run_pair(tmp_path, dict(batch=8, eval_batch=8, ga=2, eval=True),
                         dict(dp=2, cp=2, batch=4, eval_batch=4, ga=2, eval=True), nprocs=4)
    assert len(losses(want, "eval_loss")) >= 2
    assert_same_run(got, want)
    _assert_one_process_logs(got, want)
    for h in history(got):  # evaluate() counted the 8 eval rows once, not once per cp rank
        if "eval_runtime" in h:
            assert round(h["eval_samples_per_second"] * h["eval_runtime"]) == 8, h


@pytest.mark.slow
def test_pp2_x_cp2_with_checkpointing_equals_the_plain_trainer(tmp_path):
    """cp beside pp: the loss rank's cp group holds the loss, the broadcast along each pipeline shares it;
    gradient checkpointing recomputes the cp attention alike, and the input tokens seen are the whole rows'."""
    got, want = run_pair(tmp_path, dict(eval=True, checkpointing=True),
                         dict(pp=2, cp=2, eval=True, checkpointing=True), nprocs=4)
    assert_same_run(got, want)
    assert losses(got, "num_input_tokens_seen") == losses(want, "num_input_tokens_seen") != []


@pytest.mark.slow
def test_sft_under_cp2_with_completion_only_loss_equals_trl(tmp_path):
    """TRL's collator pads the chat rows to a multiple of 4 (pad_to_multiple_of), the prompt masked out; each
    of the 2 cp ranks trains its tokens, the loss divided by the completion tokens of the whole rows."""
    pytest.importorskip("trl", reason="PipelineSFTTrainer needs the optional extra trl")
    got, want = run_pair(tmp_path, dict(script="train_sft.py", pad_to=4),
                         dict(pp=1, cp=2, script="train_sft.py", pad_to=4))
    assert len(losses(want)) == 3 and len(losses(want, "eval_loss")) >= 2
    assert_same_run(got, want)


@pytest.mark.slow
def test_pp2_x_tp2_equals_the_plain_trainer_and_saves_whole_tensors(tmp_path):
    """Every tp rank is a loss rank: the logs are still printed once, and save_model() writes whole tensors
    under the source keys (assert_same_run compares keys and values with the plain Trainer's)."""
    got, want = run_pair(tmp_path, dict(eval=True), dict(pp=2, tp=2, eval=True), nprocs=4)
    assert_same_run(got, want)
    _assert_one_process_logs(got, want)


@pytest.mark.slow
def test_tp2_with_lora_equals_peft_under_the_plain_trainer(tmp_path):
    """PEFT's adapters on tp-split layers: trained alike, and save_model() writes the adapter folder whole."""
    got, want = run_pair(tmp_path, dict(lora=True, eval=True), dict(pp=1, tp=2, lora=True, eval=True))
    assert_same_run(got, want)
    assert (got / "final" / "adapter_config.json").is_file()


def _moe(kind: str = "qwen3_moe") -> str:
    return str(tiny_checkpoint(kind, num_hidden_layers=2))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3"])
def test_dp2_x_ep2_on_a_moe_equals_the_plain_trainer(tmp_path, kind):
    """The routed experts sharded over 2 ep ranks of the 2 dp replicas; the export writes them per expert,
    under the keys the plain Trainer's save_model() writes."""
    got, want = run_pair(tmp_path, dict(model=_moe(kind), batch=8, eval_batch=8, eval=True),
                         dict(model=_moe(kind), dp=2, ep=2, batch=4, eval_batch=4, eval=True), nprocs=2)
    assert_same_run(got, want)


@pytest.mark.slow
def test_dp2_x_ep2_x_tp2_on_qwen3_moe_equals_the_plain_trainer(tmp_path):
    got, want = run_pair(tmp_path, dict(model=_moe(), batch=8, eval_batch=8, eval=True),
                         dict(model=_moe(), dp=2, ep=2, tp=2, batch=4, eval_batch=4, eval=True), nprocs=4)
    assert_same_run(got, want)
    _assert_one_process_logs(got, want)


@pytest.mark.slow
def test_a_router_aux_loss_is_summed_over_accumulation_batches_as_the_plain_trainer_does(tmp_path):
    """Qwen3-MoE with output_router_logits: transformers adds coef * aux of each forward's batch to its loss and
    the Trainer sums the 2 accumulation batches' losses; one microbatch per batch makes it exact (pp=1, the
    PipelineTrainer in one process). evaluate() adds each eval batch's aux loss as the plain model's loss does."""
    model = _router_moe()
    got, want = run_pair(tmp_path, dict(model=model, ga=2, eval=True), dict(model=model, pp=1, ga=2, eval=True),
                         nprocs=1)
    assert_same_run(got, want)


def _router_moe() -> str:
    return str(tiny_checkpoint("qwen3_moe", num_hidden_layers=2, output_router_logits=True, router_aux_loss_coef=0.5))


@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(pp=2), dict(pp=2, dp=2, eval_batch=2)])
def test_the_eval_loss_of_a_moe_with_a_router_aux_loss_is_the_plain_trainers_at_pp2(tmp_path, layout):
    """evaluate() of the loaded model: each eval batch of 4 rows runs as 2 microbatches (and over 2 dp replicas),
    its aux loss taken over the whole batch as the plain model's forward takes it, not per microbatch."""
    model = _router_moe()
    got, want = run_pair(tmp_path, dict(model=model, eval=True, train=False),
                         dict(model=model, eval=True, train=False, **layout), nprocs=2 * layout.get("dp", 1))
    g, w = losses(got, "eval_loss"), losses(want, "eval_loss")
    assert len(g) == len(w) > 0 and all(abs(a[1] - b[1]) <= 1e-5 for a, b in zip(g, w)), (g, w)
