"""Bad ``--quantize-base`` input: one line naming the option or tensor and the fix, exit 2.

- ``--quantize-base`` (or ``--quantize-block-size``) without ``--lora-rank``;
- an NF4 block size that does not divide a weight's rows (found before any process starts);
- an FP8 weight without its ``weight_scale_inv`` (any load, quantized or not);
- FP8 scales that do not match config.json's ``weight_block_size``;
- an NF4 base that cannot split into ``--dp`` equal FSDP2 shards;
- an FP8 tile that straddles the seam of a MoE layer's stacked gate and up experts.

No fp8 setting is refused for the machine it runs on: the FP8 codes are dequantized by plain torch
ops (CPU and CUDA alike) and stay out of every collective (FSDP2 leaves buffers alone).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from hfpipe.errors import HfpipeError

from test_cli import assert_user_error, run, tiny  # noqa: F401 - fixture

pytest.importorskip("torchao", reason="--quantize-base nf4 needs torchao (pip install 'hfpipe[qlora]')")


def test_quantize_base_needs_lora(tiny):  # noqa: F811
    assert_user_error(run("finetune", tiny, "--quantize-base", "nf4"), "--quantize-base applies to LoRA runs only")
    assert_user_error(run("finetune", tiny, "--lora-rank", 4, "--quantize-base", "int3"),
                      "--quantize-base must be one of nf4, fp8")
    assert_user_error(run("finetune", tiny, "--lora-rank", 4, "--quantize-block-size", 64),
                      "--quantize-block-size takes a positive size and applies with --quantize-base only")
    from hfpipe.pipeline.options import StageOptions

    with pytest.raises(ValueError, match="add --lora-rank"):
        StageOptions(quantize_base="nf4")
    for block in (64.0, "64", True, 0):  # the Python API names the argument (was a bare TypeError for a float)
        with pytest.raises(HfpipeError, match=r"^load_pipeline\(quantize_block_size="):
            StageOptions(quantize_base="nf4", quantize_block_size=block, lora=object())


def test_nf4_block_size_must_divide_every_weight_row(tiny):  # noqa: F811
    assert_user_error(run("finetune", tiny, "--seq-len", 32, "--lora-rank", 4, "--quantize-base", "nf4",
                          "--quantize-block-size", 48),
                      "--quantize-block-size 48 does not divide the rows of model.layers.0.self_attn.q_proj.weight")


def _load(folder: Path, kind: str = "fp8", block=None):
    from hfpipe.pipeline.build import load_rank_stages
    from hfpipe.plan.split import plan_pipeline
    from hfpipe.quant.linear import QuantSpec
    from hfpipe.source.folder import ModelSource

    source = ModelSource.open(str(folder))
    plan = plan_pipeline(source.config, 1)
    return load_rank_stages(source, plan, 0, torch.device("cpu"), torch.float32, QuantSpec(kind, block))[0]


@pytest.fixture(scope="module")
def fp8(tiny, tmp_path_factory) -> Path:  # noqa: F811
    from hfpipe.tiny import make_fp8_checkpoint

    return make_fp8_checkpoint(tiny, tmp_path_factory.mktemp("fp8") / "fp8", 32, dtype=None)


def _rewrite(src: Path, out: Path, change) -> Path:
    """A copy of ``src`` whose tensors (all shards) and config pass through ``change(tensors, config)``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    config = json.loads((out / "config.json").read_text())
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(out / shard)
        change(tensors, config)
        save_file(tensors, out / shard, metadata={"format": "pt"})
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != shard or k in tensors}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_an_fp8_weight_without_its_scale_is_refused(fp8, tmp_path):
    from hfpipe.source.folder import SourceError

    key = "model.layers.1.mlp.up_proj.weight"
    broken = _rewrite(fp8, tmp_path / "no-scale", lambda t, c: t.pop(key + "_scale_inv", None))
    for kind in ("fp8", "nf4"):  # the shard's header check names it before anything is read
        with pytest.raises(SourceError, match=f"FP8 tensor '{key}' has no '{key}_scale_inv' beside it"):
            _load(broken, kind)


def test_fp8_scales_must_match_the_block_size(fp8, tmp_path):
    from hfpipe.quant.nf4 import QuantError

    def lie(tensors, config):
        config["quantization_config"]["weight_block_size"] = [16, 16]

    from hfpipe.source.config import SourceError

    with pytest.raises(SourceError, match=r"weight_block_size \[16, 16\] tiles .* config.json's quantization_config "
                       "does not match the checkpoint"):  # refused as the shard header is read
        _load(_rewrite(fp8, tmp_path / "lie", lie))
    with pytest.raises(QuantError, match="the checkpoint's FP8 tiles are 32; drop the option"):
        _load(fp8, "fp8", 64)


def test_fp8_checkpoint_weights_stay_fp8_as_stored(fp8):
    from safetensors import safe_open

    from hfpipe.quant.fp8 import FP8Linear

    (stage,) = _load(fp8)
    q_proj = stage.model.layers["0"].self_attn.q_proj
    assert isinstance(q_proj, FP8Linear) and q_proj.weight.dtype == torch.float8_e4m3fn
    index = json.loads((fp8 / "model.safetensors.index.json").read_text())["weight_map"]
    key = "model.layers.0.self_attn.q_proj.weight"
    with safe_open(fp8 / index[key], "pt") as f:
        assert torch.equal(q_proj.weight.view(torch.uint8), f.get_tensor(key).view(torch.uint8))
    assert stage.model.embed_tokens.weight.dtype == torch.float32 and stage.lm_head.weight.dtype == torch.float32


def test_nf4_weights_that_cannot_split_over_dp_are_refused(tiny):  # noqa: F811
    from hfpipe.quant.linear import check_shardable
    from hfpipe.quant.nf4 import QuantError

    modules = _load(tiny, "nf4")
    check_shardable(modules, 2)
    with pytest.raises(QuantError, match="--dp 3: NF4 weight model.layers.0.self_attn.q_proj.weight"):
        check_shardable(modules, 3)


def test_fp8_tiles_must_not_straddle_the_experts_gate_up_seam(tmp_path):
    """Gate and up are one stack in memory, two matrices in the checkpoint (and in a merged export)."""
    from _dist import tiny_checkpoint

    model = tiny_checkpoint("qwen3_moe", num_hidden_layers=2)
    size = json.loads((model / "config.json").read_text())["moe_intermediate_size"]
    block = size * 2 // 3 if size % 3 == 0 else 24  # a tile that does not divide the intermediate size
    assert size % block
    assert_user_error(run("finetune", model, "--seq-len", 32, "--lora-rank", 4, "--quantize-base", "fp8",
                          "--quantize-block-size", block, "--output-dir", tmp_path / "out"),
                      f"--quantize-block-size {block} must divide the routed experts' intermediate size {size}")
    assert not (tmp_path / "out").exists()
