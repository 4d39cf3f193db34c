"""A MoE model's routed experts stay quantized on their ranks (``--quantize-base fp8|nf4``), with and
without ``--ep``, and LoRA over them (and over ep-split experts of a full-precision base) equals PEFT on
the same model dequantized.

The oracle is the one of tests/quant/test_quant_lora_base.py: for a checkpoint that ships FP8 (DeepSeek-V3's format: every
expert's 2-D weight with its ``weight_scale_inv``), transformers' own ``from_pretrained`` with
``FineGrainedFP8Config(dequantize=True)``, under PEFT's ``get_peft_model``, trained in one process on the
whole batch; for a full-precision checkpoint quantized at load, the same model with every quantized
weight replaced by its dequantized value (FP8 tile by tile, NF4 block by block, expert by expert), run
by transformers' own experts kernel. Loss and grad norm per step and every adapter after 3 steps agree within 1e-5.

The default run takes DeepSeek-V3's own FP8 at pp 2 x dp 2 x ep 2 with adapters on the experts, where
each rank's codes are, and all-linear as PEFT resolves it; ``pytest -m slow`` runs NF4 experts at ep 2,
every schedule at pp 2, an interleaved ep mesh, five more families quantized at load at pp 2 x dp 2 x
ep 2 (GPT-OSS: transposed stacks with biases), LoRA with --ep over a full-precision base, merges and
a resume at another ep and pp.
"""

from __future__ import annotations

import pytest
import torch

from _dist import folder_tensors, run_ranks, tiny_checkpoint
from test_lora_equivalence import DSV3_LORA, run_and_check
from test_quant_lora_base import FP8_BLOCK, transformers_fp8

#: DeepSeek-V3's attention projections alone (PEFT maps gate_proj/up_proj/down_proj onto the fused routed
#: experts: its transformers-v5 MoE conversion).
DSV3_ATTENTION = dict(r=4, lora_alpha=8, lora_dropout=0.0,
                      target_modules=["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"])
FP8 = {"quantize_base": "fp8"}
ATTENTION = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
EXPERTS = dict(ATTENTION, target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
LOAD_BLOCK = 16  # tiles of the checkpoints quantized at load: partial tiles at the edges of most weights


def fp8_moe_checkpoint(kind: str = "deepseek_v3", layers: int = 4) -> str:
    """A block-FP8 copy of a tiny MoE checkpoint (tiles of 32: the experts' intermediate size is 32)."""
    import tempfile

    from hfpipe.tiny import make_fp8_checkpoint

    base = tiny_checkpoint(kind, num_hidden_layers=layers)
    return str(make_fp8_checkpoint(base, tempfile.mkdtemp(prefix=f"hfpipe-fp8-{kind}-"), FP8_BLOCK, dtype=None))


def test_lora_on_fp8_experts_pp2_dp2_ep2_matches_peft_on_transformers_dequantized():
    """The routed experts adapted too (PEFT's target_parameters), as FP8 codes split over ep 2."""
    run_and_check("deepseek_v3", 2, ("1f1b",), DSV3_LORA, dp=2, options={**FP8, "ep": 2},
                  build=transformers_fp8, path=fp8_moe_checkpoint())


@pytest.mark.slow
def test_fp8_experts_attention_lora_pp2_dp2_ep2():
    run_and_check("deepseek_v3", 2, ("1f1b",), DSV3_ATTENTION, dp=2, options={**FP8, "ep": 2},
                  build=transformers_fp8, path=fp8_moe_checkpoint())


@pytest.mark.slow
def test_fp8_experts_pp2_match_peft_on_transformers_dequantized():
    run_and_check("deepseek_v3", 2, ("1f1b",), DSV3_ATTENTION, options=FP8, build=transformers_fp8,
                  path=fp8_moe_checkpoint())


def _storage_worker(path: str, ep: int) -> dict:
    """Each experts module's stacks on this rank: dtype, shape, and the codes themselves."""
    from hfpipe.api import load_pipeline
    from hfpipe.lora.adapters import lora_config
    from hfpipe.parallel.mesh import init_distributed
    from hfpipe.quant.experts import fused_experts

    dist = init_distributed(1, ep)
    pm = load_pipeline(path, pp=1, dp=ep, ep=ep, schedule="gpipe", microbatches=1, dist=dist,
                       lora=lora_config(4, targets="q_a_proj,o_proj"), **FP8)
    out = {"params": {n: (str(p.dtype), p.dim()) for m in pm.modules for n, p in m.named_parameters()}}
    for name, experts in fused_experts(pm.modules[0]).items():
        out[name] = {a: experts._buffers[a].clone() for a in ("gate_up_proj", "gate_up_proj_scale_inv", "down_proj")}
    return out


def test_each_ep_rank_keeps_its_experts_fp8_codes_as_the_checkpoint_stores_them():
    path = fp8_moe_checkpoint()
    ranks = run_ranks(_storage_worker, 2, path, 2)
    stored = folder_tensors(path)
    experts = 8  # tiny DeepSeek-V3: 8 routed experts per MoE layer
    for rank, got in ranks.items():
        assert not [n for n, (_, dim) in got["params"].items() if dim == 3], "no 3-D expert parameter is left"
        layers = [k for k in got if k != "params"]
        assert layers, "the stage holds MoE layers"
        for name in layers:
            lo, hi = rank * experts // 2, (rank + 1) * experts // 2
            codes = got[name]
            assert codes["gate_up_proj"].dtype == torch.float8_e4m3fn and codes["gate_up_proj"].shape[0] == hi - lo
            for key, want_of in (("gate_up_proj", lambda e, s: torch.cat([stored[f"{name}.{e}.gate_proj.{s}"],
                                                                           stored[f"{name}.{e}.up_proj.{s}"]])),
                                 ("down_proj", lambda e, s: stored[f"{name}.{e}.down_proj.{s}"])):
                for i, e in enumerate(range(lo, hi)):
                    assert torch.equal(codes[key][i].view(torch.uint8), want_of(e, "weight").view(torch.uint8)), \
                        f"rank {rank} {name}.{key}[{e}]: codes differ from the checkpoint's"
                    if key == "gate_up_proj":
                        assert torch.equal(codes[key + "_scale_inv"][i], want_of(e, "weight_scale_inv"))


def test_an_expert_saves_only_its_fp8_codes_for_backward():
    """Just in time: autograd keeps no full-precision expert weight between forward and backward."""
    from hfpipe.models.experts import _ExpertLinear
    from hfpipe.quant.fp8 import dequantize_blocks, quantize_blocks

    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 32, generator=g)
    q, s = quantize_blocks(w, 16)
    x = torch.randn(5, 32, generator=g, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = _ExpertLinear.apply(x, q, s, None, None, 1.0, 16, dequantize_blocks, False)
    assert all(t.dtype != torch.float32 or t.numel() < w.numel() for t in saved), [t.dtype for t in saved]
    y.sum().backward()
    dense = dequantize_blocks(q, s, 16)
    torch.testing.assert_close(y, x @ dense.T, atol=0, rtol=0)
    torch.testing.assert_close(x.grad, torch.ones(5, 64) @ dense, atol=1e-6, rtol=0)


def quantized_moe_model(block: int, kind: str = "fp8"):
    """The oracle for a base quantized at load: decoder linears as in tests/quant/test_quant_lora_base.py, and each routed
    expert's matrix replaced by its dequantized value (NF4: gate and up apart, as two checkpoint
    matrices), which transformers' own experts kernel runs."""
    from test_quant_lora_base import quantized_hf_model

    dense = quantized_hf_model(kind, block)

    def round_trip(w: torch.Tensor) -> torch.Tensor:
        from hfpipe.quant.fp8 import dequantize_blocks, quantize_blocks
        from hfpipe.quant.nf4 import quantize_nf4

        if kind == "nf4":
            return quantize_nf4(w.contiguous(), block).get_original_weight()
        return dequantize_blocks(*quantize_blocks(w, block), block, w.dtype)

    def build(path: str, dtype: torch.dtype):
        from hfpipe.quant.experts import STACKS, fused_experts, split_seam

        model = dense(path, dtype)
        with torch.no_grad():
            for experts in fused_experts(model).values():
                for attr in STACKS:
                    p = experts._parameters.get(attr)
                    if p is not None and p.dim() == 3:
                        halves = 2 if kind == "nf4" and split_seam(experts, attr) else 1
                        p.copy_(torch.stack([torch.cat([round_trip(h) for h in w.chunk(halves)]) for w in p]))
        return model

    return build


NF4 = {"quantize_base": "nf4", "quantize_block_size": LOAD_BLOCK}


@pytest.mark.slow  # the default run keeps NF4 at pp 2 (test_quant_lora_base) and quantized experts over ep (FP8 below)
def test_nf4_experts_pp2_dp2_ep2_match_peft_on_the_same_nf4_model():
    """NF4: one NF4Tensor per expert's matrix, on its ep rank; adapters on attention and the experts."""
    run_and_check("qwen3_moe", 2, ("1f1b",), EXPERTS, dp=2, options={**NF4, "ep": 2},
                  build=quantized_moe_model(LOAD_BLOCK, "nf4"), path=str(tiny_checkpoint("qwen3_moe", num_hidden_layers=4)))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["deepseek_v3", "mixtral", "gpt_oss"])
def test_nf4_experts_pp2_dp2_ep2(kind):
    lora = DSV3_LORA if kind == "deepseek_v3" else EXPERTS
    run_and_check(kind, 2, ("1f1b",), lora, dp=2, options={**NF4, "ep": 2},
                  build=quantized_moe_model(LOAD_BLOCK, "nf4"), path=str(tiny_checkpoint(kind, num_hidden_layers=4)))


@pytest.mark.slow
def test_fp8_checkpoint_every_schedule_pp2():
    from test_train_equivalence import ALL_SCHEDULES

    run_and_check("deepseek_v3", 2, ALL_SCHEDULES, DSV3_ATTENTION, options=FP8, build=transformers_fp8,
                  path=fp8_moe_checkpoint())


@pytest.mark.slow
def test_fp8_checkpoint_interleaved_pp2_dp2_ep2():
    run_and_check("deepseek_v3", 2, ("interleaved-1f1b",), DSV3_ATTENTION, dp=2, options={**FP8, "ep": 2},
                  build=transformers_fp8, path=fp8_moe_checkpoint())


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "gpt_oss", "qwen2_moe", "deepseek_v4"])
def test_fp8_quantized_at_load_pp2_dp2_ep2(kind):
    lora = dict(ATTENTION, target_modules=["q_a_proj", "q_b_proj", "o_b_proj"]) \
        if kind == "deepseek_v4" else ATTENTION
    run_and_check(kind, 2, ("1f1b",), lora, dp=2, options={**FP8, "quantize_block_size": LOAD_BLOCK, "ep": 2},
                  build=quantized_moe_model(LOAD_BLOCK), path=str(tiny_checkpoint(kind, num_hidden_layers=4)))


@pytest.mark.slow
@pytest.mark.parametrize("kind, lora", [("qwen3_moe", ATTENTION), ("deepseek_v3", DSV3_ATTENTION),
                                        ("deepseek_v3", DSV3_LORA), ("qwen3_moe", EXPERTS), ("gpt_oss", EXPERTS)])
def test_lora_with_ep_over_a_full_precision_base(kind, lora):
    """Adapters on attention, and on the routed experts split over ep 2 (GPT-OSS: transposed stacks)."""
    run_and_check(kind, 2, ("1f1b",), lora, dp=2, options={"ep": 2}, path=str(tiny_checkpoint(kind, num_hidden_layers=4)))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
def test_lora_on_fp8_experts_quantized_at_load_pp2_dp2_ep2(kind):
    run_and_check(kind, 2, ("1f1b",), EXPERTS, dp=2, options={**FP8, "quantize_block_size": LOAD_BLOCK, "ep": 2},
                  build=quantized_moe_model(LOAD_BLOCK), path=str(tiny_checkpoint(kind, num_hidden_layers=4)))


@pytest.mark.slow
def test_lora_on_fp8_experts_pp2_every_schedule():
    from test_train_equivalence import ALL_SCHEDULES

    run_and_check("deepseek_v3", 2, ALL_SCHEDULES, DSV3_LORA, options=FP8, build=transformers_fp8,
                  path=fp8_moe_checkpoint())


# Slow (both): the default run keeps LoRA on FP8 experts over ep against PEFT
# (test_lora_on_fp8_experts_pp2_dp2_ep2_matches_peft_on_transformers_dequantized).
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mixtral", "deepseek_v3"])
def test_all_linear_adapts_what_peft_adapts_on_a_moe_model_split_over_ep(kind):
    """PEFT's own get_peft_model(all-linear) is the oracle: on transformers 5 it adapts Mixtral's and
    DeepSeek-V3's fused experts and routers (its MoE conversion), and so does the pipeline, at ep 2."""
    from test_lora_equivalence import LORA

    run_and_check(kind, 2, ("1f1b",), LORA, dp=2, options={"ep": 2}, path=str(tiny_checkpoint(kind, num_hidden_layers=4)))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fp8", "nf4"])
def test_adapter_export_and_merges_of_lora_on_quantized_experts(kind, tmp_path):
    """The exported adapter on the oracle's model (DeepSeek-V3's own FP8 dequantized by transformers;
    NF4 quantized at load) gives the training logits; ``--merge`` writes every expert as PEFT's merge
    of it (``dequant(Q) + delta``) rounded once to bf16, and ``--merge --dtype fp8`` writes the
    experts FP8, which transformers loads."""
    import json

    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    from hfpipe.export.hf_folder import export_checkpoint
    from test_quant_export import _logits, train_and_save
    from test_train_equivalence import make_batches

    path = fp8_moe_checkpoint() if kind == "fp8" else str(tiny_checkpoint("deepseek_v3", num_hidden_layers=4))
    build = transformers_fp8 if kind == "fp8" else quantized_moe_model(LOAD_BLOCK, "nf4")
    ranks = run_ranks(train_and_save, 2, path, str(tmp_path / "ckpts"), FP8 if kind == "fp8" else NF4, DSV3_LORA)
    trained = next(r["logits"] for r in ranks.values() if r["logits"] is not None)
    ckpt = ranks[0]["ckpt"]
    batch = make_batches(AutoConfig.from_pretrained(path).vocab_size)[0][0]
    adapter = export_checkpoint(ckpt, tmp_path / "adapter")
    peft = PeftModel.from_pretrained(build(path, torch.float32), adapter).eval()
    torch.testing.assert_close(_logits(peft, batch), trained, atol=1e-5, rtol=0)

    merged = AutoModelForCausalLM.from_pretrained(export_checkpoint(ckpt, tmp_path / "merged", merge=True),
                                                  dtype=torch.float32)
    want = _merged_experts(peft)  # PEFT's merge() of each expert stack (NF4 linears take no in-place add)
    assert want
    for name, w in want.items():
        torch.testing.assert_close(merged.state_dict()[name], w.to(torch.bfloat16).float(), atol=0, rtol=0,
                                   msg=lambda m: f"{name}: {m}")
    fp8 = export_checkpoint(ckpt, tmp_path / "merged-fp8", merge=True, dtype="fp8")
    assert json.loads((fp8 / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    stored = folder_tensors(str(fp8))
    assert stored["model.layers.2.mlp.experts.0.gate_proj.weight"].dtype == torch.float8_e4m3fn
    reloaded = AutoModelForCausalLM.from_pretrained(fp8, dtype=torch.float32).float()  # CPU: dequantized at load
    assert (_logits(reloaded, batch) - trained).abs().max() < 0.5


@pytest.mark.slow
def test_lora_on_fp8_experts_saved_at_ep2_resumes_exactly_at_ep1_and_pp3():
    """The adapters of the experts are whole on every rank (FSDP2 over dp), so a checkpoint saved at
    pp 2 x dp 2 x ep 2 resumes at ep 1 and at pp 3 and its step 3 equals the uninterrupted run's."""
    import tempfile

    from test_parallel_expert import MESHES
    from test_parallel_expert_io import _merged, _resume_worker
    from test_train_equivalence import check_equal

    path, root = fp8_moe_checkpoint(), tempfile.mkdtemp(prefix="hfpipe-resume-")
    options = {**FP8, "lora": DSV3_LORA}
    want = _merged(run_ranks(_resume_worker, 4, path, MESHES["pp2-dp2-ep2"], root, True, options))
    assert any(".mlp.experts.lora_A." in k for k in want["weights"]), "the experts' adapters are checked"
    for name, other in {"pp2-dp1-ep1": (2, 1, 1, "1f1b", 2, None), "pp3-dp2-ep2": MESHES["pp3-dp2-ep2"]}.items():
        got = run_ranks(_resume_worker, other[0] * other[1], path, other, root, False, options)
        check_equal(want, {r: {name: res} for r, res in got.items()}, (name,))


def _merged_experts(peft) -> dict[str, torch.Tensor]:
    """Full-model name -> PEFT's merge of each adapted expert stack: the stack plus the wrapper's delta."""
    from peft.tuners.lora.layer import ParamWrapper

    out = {}
    for name, wrapper in peft.base_model.model.named_modules():
        if isinstance(wrapper, ParamWrapper) and ".mlp.experts" in name:
            base = wrapper.get_base_layer()
            owner = name.split(".mlp.experts")[0] + ".mlp.experts"
            out[f"{owner}.{wrapper.parameter_name}"] = (getattr(base, wrapper.parameter_name)
                                                        + wrapper.get_delta_weight("default")).detach()
    return out
