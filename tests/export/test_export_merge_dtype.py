"""``hfpipe export --merge --dtype fp64``: a LoRA run merged into its base in float64 is PEFT's ``merge_and_unload()``
of the same adapter on the base loaded in float64.

The tolerance: both merges add PEFT's own ``B @ A * scaling`` (computed in fp64, PEFT's LoRA layers take the base
layer's dtype) to the same fp64-widened base, so the weights are equal bit for bit and the forward is the same fp64
program on the same inputs: 0. 1e-12 is the bound left for another kernel's summation order, ~64 sums of O(1)
terms at fp64's 2.2e-16 (about 1e-14), with two orders to spare; the fp32 merge widened afterwards, the defect this
guards against, is ~1e-8 away.
"""

from __future__ import annotations

import json

import torch
from typer.testing import CliRunner

from hfpipe.cli.main import app
from test_checkpoint_dcp import tensors
from test_lora_checkpoint import lora_checkpoint_from_peft

TOL = 1e-12


def test_merge_in_fp64_loads_in_float64_with_peft_merge_and_unload_logits(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hfpipe.export.hf_folder import export_checkpoint
    from hfpipe.tiny import make_tiny_checkpoint

    base = make_tiny_checkpoint(tmp_path / "base", "llama", num_hidden_layers=2, tokenizer=False)  # fp32
    ckpt = lora_checkpoint_from_peft(base, tmp_path / "step-00000003", "all-linear")
    adapter = export_checkpoint(ckpt, tmp_path / "adapter", progress=False)
    result = CliRunner().invoke(app, ["export", str(ckpt), str(tmp_path / "merged"), "--merge", "--dtype", "fp64",
                                      "--no-progress"])
    assert result.exit_code == 0, result.output
    merged = tmp_path / "merged"

    got, src = tensors(merged), tensors(base)
    assert sorted(got) == sorted(src) and all(t.dtype == torch.float64 for t in got.values())
    assert json.loads((merged / "config.json").read_text())["dtype"] == "float64"
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float64), adapter)
    oracle = peft.merge_and_unload().eval()
    want = oracle.state_dict()
    assert sum(not torch.equal(got[k], src[k].double()) for k in src) == 2 * 7  # every linear but the head
    for key, t in got.items():
        assert torch.equal(t, want[key]), key

    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float64).eval()
    assert all(p.dtype == torch.float64 for p in model.parameters())
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(ids).logits, oracle(ids).logits
    assert ours.dtype == torch.float64
    assert (ours - theirs).abs().max().item() <= TOL


def test_adapters_on_fused_moe_experts_merge_in_fp64_as_peft_merge_and_unload(tmp_path):
    """DeepSeek-V3's routed experts merge on the fused tensor and go back per expert: in fp64 too, PEFT's values."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from _dist import tiny_checkpoint
    from hfpipe.export.hf_folder import export_checkpoint

    base = tiny_checkpoint("deepseek_v3", num_hidden_layers=3)
    ckpt = lora_checkpoint_from_peft(base, tmp_path / "step-00000003", ["q_b_proj", "o_proj"],
                                     ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    adapter = export_checkpoint(ckpt, tmp_path / "adapter", progress=False)
    merged = export_checkpoint(ckpt, tmp_path / "merged", merge=True, dtype="float64", progress=False)
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float64), adapter)
    peft.merge_and_unload().save_pretrained(tmp_path / "peft-merged")
    got, want, src = tensors(merged), tensors(tmp_path / "peft-merged"), tensors(base)
    assert sorted(got) == sorted(want) == sorted(src) and all(t.dtype == torch.float64 for t in got.values())
    assert any(".mlp.experts.5.up_proj." in k and not torch.equal(got[k], src[k].double()) for k in got)
    for key in src:  # transformers keeps the router's bias in fp32 (loaded so from either folder): equal values
        assert torch.equal(got[key], want[key].double()), key
