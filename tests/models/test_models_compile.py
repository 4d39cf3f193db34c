"""``--compile``: every decoder layer compiled in place (``hfpipe.models.compile``) trains as eager transformers
does in one process, keeps every name, compiles a bounded number of graphs as lengths vary, and is refused in
one line where torch cannot run it.

The oracle and the batches are ``tests/train/test_train_equivalence.py``'s (full-batch AdamW with clipping,
padded and prompt-masked rows, a sequence length that changes between steps): loss and grad norm per step
within 1e-5, step-1 gradients within reordering noise, every weight after the last step within 1e-5 plus
AdamW's drift. The backend is torch's default, inductor (C++ on CPU), which is what a user gets: its fused
kernels stay within those tolerances here. The default suite runs one cheap pp2 case on a 2-layer model; the
matrix (dp, tp, cp, ep, LoRA, activation checkpointing, the quantized base, every schedule) is ``slow``.
"""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from _dist import run_ranks, tiny_checkpoint
from test_train_equivalence import check_equal, pipeline_worker, reference_run
from _trust import error_lines

COMPILE = {"compile": True}
ZERO_BUBBLE = ("interleaved-zb", "zbv", "dualpipev")


def compiled_worker(*args) -> dict:
    """``pipeline_worker``'s run, and how many graphs torch compiled on this rank (none: it ran eagerly)."""
    from torch._dynamo.utils import counters

    out = pipeline_worker(*args)
    out["graphs"] = counters["stats"]["unique_graphs"]
    return out


def _run(kind: str, pp: int, schedules, dp: int = 1, layers: int = 2, **options) -> None:
    path = str(tiny_checkpoint(kind, num_hidden_layers=layers))
    ref = reference_run(path, dp=dp)
    results = run_ranks(compiled_worker, pp * dp, path, pp, dp, tuple(schedules), 1, {**COMPILE, **options})
    assert all(r["graphs"] >= 1 for r in results.values()), {rank: r["graphs"] for rank, r in results.items()}
    check_equal(ref, results, schedules)


def test_compiled_layers_at_pp2_train_as_transformers_does():
    _run("llama_tied", 2, ("1f1b",))


def test_compiled_layers_keep_their_modules_and_every_name(tmp_path):
    """In place, not wrapped: no ``_orig_mod.`` in parameter names, state dicts, the DCP view or LoRA keys; a
    compiled pipeline's checkpoint resumes an eager one, and its export holds the checkpoint's own keys."""
    from peft import LoraConfig

    from _dist import folder_tensors
    from hfpipe.api import load_pipeline

    path = str(tiny_checkpoint("llama", num_hidden_layers=2))
    lora = LoraConfig(r=4, target_modules="all-linear")
    for extra in ({}, {"lora": lora}):
        eager, compiled = load_pipeline(path, pp=1, **extra), load_pipeline(path, pp=1, compile=True, **extra)
        assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]
        assert list(compiled.model_state_dict()) == list(eager.model_state_dict())
        assert list(compiled.view().state_dict()) == list(eager.view().state_dict())  # what DCP saves
        layers = compiled.modules[0].model.layers
        assert all(type(layer).__name__ == "LlamaDecoderLayer" for layer in layers.values())
        assert all(layer._compiled_call_impl is not None for layer in layers.values())
        assert all(layer._compiled_call_impl is None for layer in eager.modules[0].model.layers.values())
    compiled.save_checkpoint(str(tmp_path / "ckpt"), 1)
    assert eager.load_checkpoint(str(tmp_path / "ckpt")).step == 1
    plain = load_pipeline(path, pp=1, compile=True)
    plain.save_pretrained(str(tmp_path / "hf"))
    assert sorted(folder_tensors(tmp_path / "hf")) == sorted(folder_tensors(path))


@pytest.mark.parametrize("schedule", ZERO_BUBBLE)
def test_the_zero_bubble_schedules_are_refused_with_compile_in_one_line(schedule):
    """Their split backward fails on a compiled layer inside torch (measured): refused before anything loads, by
    the one validator the API, finetune and plan share."""
    from hfpipe.errors import ParallelError
    from hfpipe.parallel.dims import ParallelDims
    from hfpipe.parallel.rules import check_layout

    with pytest.raises(ParallelError, match=f"--compile with --schedule {schedule}: the zero-bubble") as e:
        check_layout(ParallelDims(pp=2), schedule, compile=True)
    assert "\n" not in str(e.value)
    check_layout(ParallelDims(pp=2), schedule)  # without --compile it runs


@pytest.mark.parametrize("command", ["plan", "finetune"])
def test_plan_and_finetune_refuse_what_cannot_run_compiled_exit_2(command, tmp_path):
    from hfpipe.cli.main import app

    args = [command, "meta-llama/Llama-3.1-8B", "--pp", "2", "--schedule", "zbv", "--compile"]
    if command == "finetune":
        args += ["--dataset", str(tmp_path / "d.jsonl"), "--output-dir", str(tmp_path / "out")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = error_lines(result.output)
    assert len(lines) == 1 and "--compile with --schedule zbv: the zero-bubble schedules" in lines[0], lines
    assert not (tmp_path / "out").exists()


def test_a_recipe_sets_compile_and_is_checked_as_the_flag_is(tmp_path):
    from hfpipe.config.run import FinetuneConfig
    from hfpipe.errors import HfpipeError
    from hfpipe.pipeline.options import from_config

    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: meta-llama/Llama-3.1-8B\npp: 2\ncompile: true\n")
    assert from_config(FinetuneConfig.from_yaml(recipe))[1].compile is True
    with pytest.raises(HfpipeError, match="--compile with --schedule dualpipev"):
        FinetuneConfig.from_yaml(recipe, schedule="dualpipev")


def test_plan_prices_a_compiled_run_as_an_eager_one():
    from hfpipe.cli.main import app

    args = ["plan", "meta-llama/Llama-3.1-8B", "--pp", "2", "--seq-len", "4096"]
    eager, compiled = (CliRunner().invoke(app, args + extra) for extra in ([], ["--compile"]))
    assert compiled.exit_code == 0, compiled.output
    assert compiled.stdout == eager.stdout


@pytest.mark.parametrize("options, says", [
    ({"compile": True, "compile_backend": "no-such-backend"}, "backend 'no-such-backend' is unknown"),
    ({"compile": True, "compile_mode": "fastest"}, "mode 'fastest' is unknown"),
    ({"compile_backend": "inductor"}, "apply with compile=True only"),
    ({"compile": "yes"}, "compile must be True or False"),
])
def test_bad_compile_options_are_refused_in_one_line(options, says):
    from hfpipe.pipeline.options import StageOptions
    from hfpipe.pipeline.schedule import PipelineError

    with pytest.raises(PipelineError, match=says) as e:
        StageOptions(**options)
    assert "\n" not in str(e.value)


def test_varying_lengths_compile_a_bounded_number_of_graphs_and_say_each_recompile(caplog):
    """Lengths 16, 12, 9, 20, 33, 7, ... with and without padding: after the first length and the first other
    one (when torch makes the length symbolic), no step compiles again, and each recompile is one log line."""
    from hfpipe.api import load_pipeline
    from hfpipe.models.compile import watch_recompiles

    path = str(tiny_checkpoint("llama", num_hidden_layers=2))
    # aot_eager: the same graphs and guards as inductor (dynamo decides what recompiles), without C++ builds
    pm = load_pipeline(path, pp=1, microbatches=2, compile=True, compile_backend="aot_eager")
    trainer = pm.trainer(torch.optim.SGD(pm.parameters(), lr=0.0), max_grad_norm=None)
    g = torch.Generator().manual_seed(0)
    watch, lengths = watch_recompiles(), [16, 12, 9, 20, 33, 7, 25, 11]
    seen = []
    with caplog.at_level("INFO", logger="hfpipe.models.compile"):
        for step, seq in enumerate(lengths):
            ids = torch.randint(3, pm.source.config.vocab_size, (4, seq), generator=g)
            mask = torch.ones_like(ids)
            mask[0, seq - step % 3:] = 0  # padding in two steps of three: the layers get a mask, or none
            before = watch.count
            trainer.step({"input_ids": ids, "attention_mask": mask, "labels": ids.clone()})
            seen.append(watch.count - before)
    assert sum(seen[4:]) == 0, f"recompiles per step: {seen}"  # every later length reuses a symbolic graph
    assert 1 <= sum(seen) <= 3, seen
    said = [r for r in caplog.records if "compiling frame" in r.getMessage()]
    assert len(said) == sum(seen) and all("TORCH_LOGS=recompiles" in r.getMessage() for r in said)


# --- The matrix: every axis and schedule that composes with --compile -------------------------------------
@pytest.mark.slow
def test_compiled_every_schedule_that_runs_it():
    _run("llama", 2, ("gpipe", "interleaved-1f1b", "looped-bfs"), layers=4)


@pytest.mark.slow
def test_compiled_deepseek_v3_dense_and_moe_layers_on_one_stage():
    """Two kinds of layer in one compiled frame: more graphs than torch's default limit of 8 allows."""
    _run("deepseek_v3", 2, ("1f1b",), layers=6)


@pytest.mark.slow
def test_compiled_dp2_x_pp2_fsdp2():
    _run("llama_tied", 2, ("1f1b",), dp=2)


@pytest.mark.slow
def test_compiled_full_activation_checkpointing():
    _run("llama", 2, ("1f1b",), activation_checkpointing="full")


def test_under_tp_or_ep_the_compiled_layers_keep_out_of_aotautograds_cache(monkeypatch):
    """torch 2.13's AOTAutograd cache (on disk, shared by the ranks of a node and by later runs) keys a graph that
    reaches its mesh only through a DTensor input by the mesh's ranks and shape, the same for every tp group,
    while the graph calls its own group by name: one stage loaded another's and failed ("Could not resolve the
    process group registered under the name 12"). So it is off where tp or ep DTensors reach the layers, and
    only there (``test_aotautograds_cache_hands_one_tp_group_another_groups_graph`` shows torch's side)."""
    import torch._functorch.config as functorch_config

    from hfpipe.models.compile import CompileSpec, apply_compile

    monkeypatch.setattr(functorch_config, "enable_autograd_cache", True)
    assert apply_compile([], CompileSpec()) == 0 and functorch_config.enable_autograd_cache
    apply_compile([], CompileSpec(), sub_meshes=True)
    assert not functorch_config.enable_autograd_cache


def test_a_forced_aotautograd_cache_is_refused_with_tp_in_one_line(monkeypatch):
    """TORCHINDUCTOR_AUTOGRAD_CACHE=1 outranks the switch in code: refused by the validator before anything loads."""
    from hfpipe.errors import ParallelError
    from hfpipe.parallel.dims import ParallelDims
    from hfpipe.parallel.rules import check_layout

    monkeypatch.setenv("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
    check_layout(ParallelDims(pp=2, tp=2), "1f1b")  # not compiled: nothing to refuse
    with pytest.raises(ParallelError, match=r"^TORCHINDUCTOR_AUTOGRAD_CACHE=1 forces .* unset it for --compile "
                                            r"with --tp$") as e:
        check_layout(ParallelDims(pp=2, tp=2), "1f1b", compile=True)
    assert "\n" not in str(e.value)


def graph_of_another_tp_group(cache_dir: str) -> tuple[str, str]:
    """torch alone, on hfpipe's pp 2 x tp 2 mesh: each rank compiles a DTensor gather over its tp group (the
    graph's one input is the DTensor, as in a stage's last-layer PrepareModuleOutput), the second stage's ranks
    first; once with AOTAutograd's cache on, once off, over the same cache folder. What each call said."""
    import os

    import torch._functorch.config as functorch_config
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from hfpipe.parallel.dims import ParallelDims
    from hfpipe.parallel.mesh import init_distributed

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    d = init_distributed(ParallelDims(pp=2, tp=2))
    x = DTensor.from_local(torch.ones(2, 3, requires_grad=True), d.mesh["tp"], [Shard(0)], run_check=False)
    said = []
    for cache in (True, False):
        functorch_config.enable_autograd_cache = cache
        torch._dynamo.reset()  # compile again in this process: only the folder is shared
        if d.pp_rank == 0:
            dist.barrier()  # the second stage's tp group compiles (and caches) first
        try:
            torch.compile(lambda t: t.redistribute(placements=[Replicate()]).to_local())(x).sum().backward()
            said.append("ran")
        except RuntimeError as e:
            said.append(str(e))
        if d.pp_rank == 1:
            dist.barrier()
    return tuple(said)


@pytest.mark.slow
def test_aotautograds_cache_hands_one_tp_group_another_groups_graph(tmp_path):
    """Why ``apply_compile(sub_meshes=True)`` turns the cache off (torch 2.13): with it on, the first stage's
    ranks load the graph the second stage's tp group compiled and fail on that group's name; off, all run."""
    said = run_ranks(graph_of_another_tp_group, 4, str(tmp_path))
    assert [said[r][0] for r in (2, 3)] == ["ran", "ran"], said
    assert all(said[r][0].startswith("Could not resolve the process group registered under the name")
               for r in (0, 1)), said
    assert all(said[r][1] == "ran" for r in range(4)), said


@pytest.mark.slow
def test_compiled_pp2_x_tp2():
    """With sequence parallelism (the default): every block's input a DTensor, gathered by sequence."""
    from test_parallel_tensor_pipeline import _run as run_tp

    run_tp("llama", 2, 2, ("1f1b",), **COMPILE)


def test_compile_with_tp_without_sequence_parallelism_is_refused_in_one_line():
    """Measured with the refusal lifted (pp2 x tp2 Llama, the slow test above with sequence_parallel=False): torch
    2.13's AOTAutograd trace of such a layer's backward recurses without end at the second sequence length."""
    from hfpipe.errors import ParallelError
    from hfpipe.parallel.dims import ParallelDims
    from hfpipe.parallel.rules import check_layout

    check_layout(ParallelDims(pp=2, tp=2), "1f1b", compile=True)  # with sequence parallelism: runs (above)
    with pytest.raises(ParallelError, match=r"^--compile with --tp 2 --no-sequence-parallel: torch 2.13 cannot "
                                            r"trace") as e:
        check_layout(ParallelDims(pp=2, tp=2), "1f1b", compile=True, sequence_parallel=False)
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_compiled_pp2_x_cp2():
    from test_parallel_context import _run as run_cp

    run_cp("llama", 2, 2, **COMPILE)


@pytest.mark.slow
def test_compiled_lora_matches_peft():
    from test_lora_equivalence import run_and_check

    run_and_check("llama_tied", 2, ("1f1b",), options=COMPILE)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["nf4", "fp8"])
def test_compiled_lora_on_a_quantized_base(kind):
    from test_lora_equivalence import run_and_check
    from test_quant_lora_base import FP8, FP8_BLOCK, NF4, quantized_hf_model

    options = NF4 if kind == "nf4" else FP8
    run_and_check("llama", 2, ("1f1b",), options={**options, **COMPILE},
                  build=quantized_hf_model(kind, FP8_BLOCK if kind == "fp8" else None))


@pytest.mark.slow
def test_compiled_experts_with_ep2_and_the_router_aux_loss():
    """pp 2 x dp 2 x ep 2: routed experts dispatched by all-to-all inside a compiled layer, the router sums
    carried beside the hidden states (tests/pipeline/test_pipeline_router_loss.py's oracle)."""
    from test_pipeline_router_loss import check

    check("qwen3_moe", 2, "1f1b", 4, dp=2, options={"ep": 2, **COMPILE})



def _finetune(tmp_path, name: str, *flags) -> tuple[list[dict], dict, str]:
    """``hfpipe finetune`` at pp 2 with LoRA on the builtin chat data, in subprocesses: its metrics, adapters and
    log."""
    import json

    from _dist import folder_tensors
    from test_cli_e2e import hfpipe

    model = tiny_checkpoint("llama", num_hidden_layers=4)
    run = hfpipe("finetune", model, "--pp", 2, "--lora-rank", 4, "--max-steps", 4, "--seq-len", 64, "--batch-size",
                 4, "--microbatches", 2, "--lr", 3e-3, "--output-dir", name, "--save-hf-at-end", *flags,
                 cwd=tmp_path, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return rows, folder_tensors(tmp_path / name / "hf"), run.stderr


@pytest.mark.slow
def test_finetune_compile_with_full_and_selective_checkpointing_and_lora_at_pp2_trains_as_eager(tmp_path):
    """The CLI's run, eager against compiled with each checkpointing mode: the same losses and grad norms per step
    (fp32, 1e-5), the same adapters at the end (the builtin data's varying lengths: a symbolic graph too)."""
    eager, eager_adapters, _ = _finetune(tmp_path, "eager")
    for ac in ("full", "selective"):
        rows, adapters, log = _finetune(tmp_path, ac, "--compile", "--activation-checkpointing", ac)
        assert "hfpipe.models.compile: torch.compile: compiling frame 0 again" in log, "compiled, then symbolic"
        assert [r["step"] for r in rows] == [r["step"] for r in eager] == [1, 2, 3, 4]
        for key in ("loss", "grad_norm"):
            torch.testing.assert_close(torch.tensor([r[key] for r in rows]), torch.tensor([r[key] for r in eager]),
                                       rtol=0, atol=1e-5, msg=lambda m: f"{ac} {key}: {m}")
        assert sorted(adapters) == sorted(eager_adapters) and all(".lora_" in k for k in adapters)
        for key, want in eager_adapters.items():
            torch.testing.assert_close(adapters[key], want, rtol=0, atol=1e-5, msg=lambda m: f"{ac} {key}: {m}")
