"""LoRA on an FP8 base split over tensor-parallel ranks (``--tp`` with ``--quantize-base fp8``) trains
exactly as PEFT does in one process on the same FP8 model.

Each colwise FP8 linear keeps its rows of the codes and of the tile-scale grid, each rowwise one its
columns (:mod:`hfpipe.quant.tensor`); the oracle, batches and checks are
``tests/lora/test_lora_equivalence.py``'s (loss and grad norm per step within 1e-5, every adapter after 3
steps within 1e-5 plus AdamW's derived drift, the base frozen), on ``tests/quant/test_quant_lora_base.py``'s
quantized models. A split that would cut a tile, and NF4 under tp, are refused in one line.

The tiny Llama's k/v projections have 32 rows, 16 per rank at tp 2: tiles of 16 stay whole on a rank,
tiles of 32 (``test_quant_lora_base.py``'s) would be cut.
"""

from __future__ import annotations

import pytest
import torch

from _dist import tiny_checkpoint
from test_lora_equivalence import run_and_check
from test_quant_lora_base import quantized_hf_model, transformers_fp8

TILE = 16
FP8_TP = {"quantize_base": "fp8", "quantize_block_size": TILE, "tp": 2}


def _fp8_checkpoint(block: int) -> str:
    import tempfile

    from hfpipe.tiny import make_fp8_checkpoint

    base = tiny_checkpoint("llama", num_hidden_layers=4)
    return str(make_fp8_checkpoint(base, tempfile.mkdtemp(prefix="hfpipe-fp8-"), block, dtype=None))


@pytest.mark.slow
def test_fp8_lora_pp2_x_tp2_sequence_parallel_matches_peft():
    """Quantized at load, tile by tile on each rank's slice; rowwise outputs reduce-scattered by sequence."""
    run_and_check("llama", 2, ("1f1b",), options=FP8_TP, build=quantized_hf_model("fp8", TILE),
                  path=str(tiny_checkpoint("llama", num_hidden_layers=4)))


@pytest.mark.slow
def test_fp8_checkpoint_kept_as_stored_pp2_x_tp2_matches_transformers_dequantized():
    """A checkpoint's own codes and scales sliced per rank (no sequence parallelism: all-reduced outputs)."""
    run_and_check("llama", 2, ("1f1b",), options={"quantize_base": "fp8", "tp": 2, "sequence_parallel": False},
                  build=transformers_fp8, path=_fp8_checkpoint(TILE))


def test_a_tp_split_that_cuts_fp8_tiles_is_refused_in_one_line_by_the_run_and_the_plan():
    from hfpipe.plan.report import plan_report
    from hfpipe.quant.linear import QuantError, check_quantize
    from hfpipe.source.folder import ModelSource

    config = ModelSource.open(str(tiny_checkpoint("llama", num_hidden_layers=2))).config
    check_quantize(config, "fp8", TILE, backend=False, tp=2)  # 16 rows per rank: whole tiles
    report = plan_report(config, pp=1, tp=2, lora_rank=4, quantize_base="fp8", quantize_block_size=TILE, seq_len=64)
    assert report.tp == 2 and any("base quantized fp8" in n for n in report.notes)  # what runs is planned
    for refuse in (lambda: check_quantize(config, "fp8", 2 * TILE, backend=False, tp=2),
                   lambda: plan_report(config, pp=1, tp=2, lora_rank=4, quantize_base="fp8",
                                       quantize_block_size=2 * TILE, seq_len=64)):
        with pytest.raises(QuantError) as e:
            refuse()
        msg = str(e.value)
        assert "\n" not in msg
        for part in ("--tp 2 with --quantize-base fp8", "model.layers.0.self_attn.k_proj.weight", "32x32",
                     "16 per tp rank", "--quantize-block-size that divides 16"):
            assert part in msg, (part, msg)


def test_nf4_under_tp_is_refused_in_one_line():
    from hfpipe.errors import ParallelError
    from hfpipe.parallel.dims import ParallelDims
    from hfpipe.parallel.rules import check_layout

    check_layout(ParallelDims(pp=1, tp=2), "1f1b", lora=True, quantize_base="fp8")  # fp8 runs
    with pytest.raises(ParallelError) as e:
        check_layout(ParallelDims(pp=1, tp=2), "1f1b", lora=True, quantize_base="nf4")
    assert str(e.value) == ("--tp 2 with --quantize-base nf4: NF4 weights are not split over tp ranks; "
                            "use --quantize-base fp8 (split on its tiles) or --tp 1")
    with pytest.raises(ParallelError, match=r"^--tp 2 with --ep 2 and --quantize-base fp8: a quantized base under "
                                            r"tensor and expert parallelism together is not checked exact yet"):
        check_layout(ParallelDims(pp=1, dp=2, tp=2, ep=2), "1f1b", lora=True, quantize_base="fp8")


@pytest.mark.slow
def test_routed_experts_whose_tp_split_cuts_fp8_tiles_are_refused_in_one_line():
    from hfpipe.quant.linear import QuantError, check_quantize
    from hfpipe.source.folder import ModelSource

    config = ModelSource.open(str(tiny_checkpoint("qwen3_moe", num_hidden_layers=2))).config
    check_quantize(config, "fp8", TILE, backend=False, tp=2)  # intermediate 32: 16 per rank, whole 16-tiles
    with pytest.raises(QuantError, match=r"^--tp 2 with --quantize-base fp8: the routed experts' intermediate size "
                                         r"32 of model\.layers\.0\.mlp\.experts splits into 16 per tp rank, which "
                                         r"cuts its 32x32 FP8 tiles .*[^\n]$"):
        check_quantize(config, "fp8", 2 * TILE, backend=False, tp=2)


@pytest.mark.slow
def test_fp8_lora_pp2_x_tp2_deepseek_v3_mla_dense_shared_and_routed_experts_matches_peft():
    """Every FP8 linear split on its tiles (MLA's q_b/kv_b colwise, o_proj rowwise, q_a/kv_a whole; dense and
    shared-expert MLPs), and the routed experts' FP8 stacks split as transformers' moe_tp_experts splits them
    (gate and up rows, down columns, per-expert scale grids alike); LoRA on the attention."""
    from test_quant_experts import DSV3_ATTENTION, quantized_moe_model

    run_and_check("deepseek_v3", 2, ("1f1b",), DSV3_ATTENTION, options=FP8_TP, build=quantized_moe_model(TILE))


@pytest.mark.slow
def test_fp8_lora_dp2_x_tp2_matches_peft():
    """FSDP2 over dp shards the tp-split adapters; the FP8 codes stay whole on each dp rank."""
    run_and_check("llama", 1, ("1f1b",), dp=2, options=FP8_TP, build=quantized_hf_model("fp8", TILE),
                  path=str(tiny_checkpoint("llama", num_hidden_layers=4)))


def _layer0_local_weights(path: str, options: dict) -> dict:
    """This tp rank's dequantized layer-0 weights (FP8 codes kept or plain), and the bytes it read."""
    from hfpipe.api import load_pipeline
    from hfpipe.parallel.dims import ParallelDims
    from hfpipe.parallel.mesh import init_distributed
    from test_lora_equivalence import LORA, lora_config

    dist = init_distributed(ParallelDims(pp=1, tp=2))
    lora = lora_config(LORA) if "quantize_base" in options else None
    pm = load_pipeline(path, pp=1, tp=2, dist=dist, lora=lora, **options)
    out = {}
    for name, m in pm.modules[0].named_modules():
        if "layers.0." in name and hasattr(m, "dequantized"):  # an FP8 linear (under PEFT: its base_layer)
            out[name.replace(".base_layer", "") + ".weight"] = m.dequantized(torch.float32)
        elif "layers.0." in name and type(m) is torch.nn.Linear and "lora_" not in name:
            out[name + ".weight"] = m.weight.to_local().detach().clone()
    return {"weights": out, "bytes": pm.load_stats.bytes_read, "rank": dist.mesh["tp"].get_local_rank()}


@pytest.mark.slow
@pytest.mark.parametrize("block, options", [(2 * TILE, {}), (TILE, {"quantize_base": "fp8"})],
                         ids=["dequantized-at-load", "kept-fp8"])
def test_a_tp_rank_reads_its_rows_of_an_fp8_checkpoint_with_the_tiles_over_them(block, options):
    """Colwise weights are read as the rank's rows and the scale rows of the tiles over them (a split off the
    tile edges, k/v's 16 rows of 32-tiles, reads the weight whole and slices it once dequantized); each rank's
    part equals its slice of transformers' own dequantization."""
    from _dist import folder_tensors, run_ranks

    path = _fp8_checkpoint(block)
    ref = dict(transformers_fp8(path, torch.float32).named_parameters())
    stored = {k: t.numel() * t.element_size() for k, t in folder_tensors(path).items()}
    by_rows = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight",
               "embed_tokens.weight", "lm_head.weight")
    halves = sum(n for k, n in stored.items() if k.removesuffix("_scale_inv").endswith(by_rows)) // 2
    ranks = run_ranks(_layer0_local_weights, 2, path, options)
    read = {got["rank"]: got["bytes"] for got in ranks.values()}
    if block == TILE:  # every row split on a tile edge, k/v's 2 tile rows too: each rank reads half of those
        assert read == {0: sum(stored.values()) - halves, 1: sum(stored.values()) - halves}
    else:  # k/v (one tile row of 32): rank 0's rows start on its edge, rank 1's do not (read whole)
        assert sum(stored.values()) - halves <= read[0] < read[1] < sum(stored.values()), read
    for got in ranks.values():
        assert len(got["weights"]) == 7, sorted(got["weights"])
        for name, w in got["weights"].items():
            dim = 1 if name.endswith(("o_proj.weight", "down_proj.weight")) else 0
            want = ref[name].chunk(2, dim)[got["rank"]]
            assert torch.equal(w, want), f"{name}: max diff {float((w - want).abs().max())}"


def _logits_worker(path: str, ids: torch.Tensor):
    from hfpipe.api import load_pipeline
    from hfpipe.parallel.dims import ParallelDims
    from hfpipe.parallel.mesh import init_distributed
    from test_lora_equivalence import LORA, lora_config

    dist = init_distributed(ParallelDims(pp=1, tp=2))
    pm = load_pipeline(path, pp=1, tp=2, dist=dist, lora=lora_config(LORA), **{k: v for k, v in FP8_TP.items()
                                                                              if k != "tp"})
    logits = pm.forward({"input_ids": ids})
    return None if logits is None else logits.detach().clone()


@pytest.mark.slow
def test_fp8_tp2_forward_without_gradients_gives_the_one_process_logits():
    """Inference takes transformers' no-grad paths of its styles (a rowwise output all-reduced by hand)."""
    from _dist import run_ranks
    from peft import get_peft_model
    from test_lora_equivalence import LORA, lora_config

    path = str(tiny_checkpoint("llama", num_hidden_layers=4))
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    got = [t for t in run_ranks(_logits_worker, 2, path, ids).values() if t is not None]
    model = get_peft_model(quantized_hf_model("fp8", TILE)(path, torch.float32), lora_config(LORA))
    with torch.no_grad():  # lora_B starts at zero in both: the quantized base's logits
        want = model(input_ids=ids).logits
    assert got and all(t.shape == want.shape for t in got)
    for t in got:
        torch.testing.assert_close(t, want, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_fp8_lora_pp2_x_tp2_qwen3_with_biases_matches_peft():
    """Qwen3 with attention biases: a colwise bias split with its rows, a rowwise one added once after the
    reduce-scatter; per-head q/k norms after the colwise FP8 projections."""
    run_and_check("qwen3", 2, ("1f1b",), options=FP8_TP, build=quantized_hf_model("fp8", TILE),
                  path=str(tiny_checkpoint("qwen3", num_hidden_layers=4, attention_bias=True)))


@pytest.mark.slow
def test_deepseek_v3_own_fp8_kept_as_stored_pp2_x_tp2_matches_transformers_dequantized():
    """DeepSeek-V3's format (every expert's 2-D codes with their scales): stacked as stored, then each rank's
    rows and columns of codes and scale grids; no sequence parallelism. Tiles of 8 divide every weight:
    transformers' dequantization (the oracle) of a partial edge tile (kv_a_proj_with_mqa's 24 rows in tiles
    of 16) was 4x further from the unquantized weight than the tile's own rounding (measured, 5.23)."""
    import tempfile

    from hfpipe.tiny import make_fp8_checkpoint
    from test_lora_equivalence import LAYERS
    from test_quant_experts import DSV3_ATTENTION

    base = tiny_checkpoint("deepseek_v3", num_hidden_layers=LAYERS)
    path = str(make_fp8_checkpoint(base, tempfile.mkdtemp(prefix="hfpipe-fp8-dsv3-"), TILE // 2, dtype=None))
    run_and_check("deepseek_v3", 2, ("1f1b",), DSV3_ATTENTION, build=transformers_fp8, path=path,
                  options={"quantize_base": "fp8", "tp": 2, "sequence_parallel": False})


@pytest.mark.slow
def test_cli_finetune_tp2_on_an_fp8_base_equals_tp1_and_refuses_a_tile_cut(tmp_path):
    """As a user runs it: a 128-tile default cuts k_proj's 128 rows at tp 2 (exit 2, one line); tiles of 64
    train at --tp 2 as at --tp 1 (losses and grad norms within 1e-5), and the checkpoint exports."""
    import json

    from test_cli_e2e import hfpipe
    from test_quant_cli import WIDE

    model = tiny_checkpoint("llama", **WIDE)
    flags = ("--max-steps", 3, "--seq-len", 32, "--batch-size", 4, "--microbatches", 2, "--lr", 3e-3,
             "--lora-rank", 8, "--quantize-base", "fp8", "--save-every", 3)
    run = hfpipe("finetune", model, "--tp", 2, *flags, "--output-dir", "cut", cwd=tmp_path, timeout=600)
    assert run.returncode == 2 and "self_attn.k_proj.weight's 128 rows split into 64 per tp rank" in run.stderr
    assert not (tmp_path / "cut").exists()
    rows = {}
    for tp in (1, 2):
        run = hfpipe("finetune", model, "--tp", tp, *flags, "--quantize-block-size", 64, "--output-dir", f"tp{tp}",
                     cwd=tmp_path, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        rows[tp] = [json.loads(line) for line in (tmp_path / f"tp{tp}" / "metrics.jsonl").read_text().splitlines()]
    for what in ("loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor([r[what] for r in rows[2]]), torch.tensor([r[what] for r in rows[1]]),
                                   atol=1e-5, rtol=0, msg=lambda m: f"{what} tp2 vs tp1: {m}")
    (ckpt,) = sorted((tmp_path / "tp2" / "checkpoints").glob("step-*"))
    run = hfpipe("export", ckpt, tmp_path / "adapter", cwd=tmp_path)
    assert run.returncode == 0 and (tmp_path / "adapter" / "adapter_model.safetensors").is_file(), run.stderr[-3000:]
