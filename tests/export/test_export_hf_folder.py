"""Spec of ``hfpipe.export.hf_folder``: a DCP training checkpoint back to a Hugging Face folder.

Checkpoints are made here the way the trainer writes them: the full transformers model's in-memory
state dict under ``model.<fqn>`` (fused MoE experts, no ``lm_head`` when tied) saved by ``dcp.save``
in one process, plus ``hfpipe.json``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import save_file

from _dist import folder_tensors as tensors
from hfpipe.export import hf_folder as export_mod
from hfpipe.export.hf_folder import ExportError, export_checkpoint, read_checkpoint_meta
from hfpipe.export.hf_writer import ShardWriter
from hfpipe.tiny import make_fp8_checkpoint, make_tiny_checkpoint
from hfpipe.checkpoint.dcp import record_checksums

BLOCK = 128  # DeepSeek-V3's FP8 weight block


def _model(folder: Path, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, **kwargs)


def make_dcp_checkpoint(src: Path, ckpt: Path, *, edit=None, source_dtype: str = "float32") -> Path:
    """A checkpoint as the trainer writes it, from the HF model loaded out of ``src``."""
    model = _model(src, dtype=torch.float32)  # fp32 masters, whatever the source dtype
    tied = bool(model.config.tie_word_embeddings)
    state = {"model." + k: v for k, v in model.state_dict().items()}
    if tied:
        del state["model.lm_head.weight"]
    state["extra"] = {"rng": torch.tensor([1, 2, 3])}  # non-model keys must be ignored
    if edit is not None:
        edit(state)
    dcp.save(state, checkpoint_id=ckpt, no_dist=True)
    meta = {"format": 1, "step": 10, "source": str(src), "source_dtype": source_dtype, "tied": tied, "config": {}}
    (ckpt / "hfpipe.json").write_text(json.dumps(meta))
    record_checksums(ckpt)  # as every checkpoint hfpipe saves
    return ckpt


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """kind -> (source folder, checkpoint folder), built once per module."""
    cache = {}

    def get(kind: str) -> tuple[Path, Path]:
        if kind not in cache:
            root = tmp_path_factory.mktemp(kind)
            src = make_tiny_checkpoint(root / "src", kind)
            cache[kind] = (src, make_dcp_checkpoint(src, root / "ckpt"))
        return cache[kind]

    return get


# --- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["llama_tied", "deepseek_v3", "qwen3_moe"])
def test_round_trip_gives_the_source_checkpoint_back_bit_for_bit(tiny, tmp_path, kind):
    src, ckpt = tiny(kind)
    out = export_checkpoint(ckpt, tmp_path / "out", progress=False)
    want, got = tensors(src), tensors(out)
    assert sorted(got) == sorted(want)  # per-expert keys restored; no lm_head when tied
    for key in want:
        assert got[key].dtype == want[key].dtype, key
        assert torch.equal(got[key], want[key]), key
    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name


def test_tied_export_has_no_lm_head(tiny, tmp_path):
    out = export_checkpoint(tiny("llama_tied")[1], tmp_path / "out", progress=False)
    assert "lm_head.weight" not in tensors(out)
    assert "model.embed_tokens.weight" in tensors(out)


@pytest.mark.parametrize("kind", ["llama_tied", "deepseek_v3"])
def test_from_pretrained_of_the_export_gives_the_source_logits(tiny, tmp_path, kind):
    src, ckpt = tiny(kind)
    out = export_checkpoint(ckpt, tmp_path / "out", progress=False)
    ids = torch.randint(0, 384, (2, 12), generator=torch.Generator().manual_seed(0))
    exported, info = _model(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, _model(src)(ids).logits, rtol=0, atol=0)


def test_a_trained_weight_shows_up_in_the_export(tmp_path):
    src = make_tiny_checkpoint(tmp_path / "src", "deepseek_v3")

    def train(state):
        state["model.model.layers.3.mlp.experts.gate_up_proj"] += 1.0  # fused [E, 2I, H]
        state["model.model.norm.weight"] += 1.0

    ckpt = make_dcp_checkpoint(src, tmp_path / "ckpt", edit=train)
    want, got = tensors(src), tensors(export_checkpoint(ckpt, tmp_path / "out", progress=False))
    for key in want:
        changed = key == "model.norm.weight" or (
            key.startswith("model.layers.3.mlp.experts.") and key.endswith(("gate_proj.weight", "up_proj.weight"))
        )
        torch.testing.assert_close(got[key], want[key] + 1.0 if changed else want[key], rtol=0, atol=0)


def test_dtype_bf16_casts_every_tensor_and_the_config(tiny, tmp_path):
    src, ckpt = tiny("qwen3_moe")
    out = export_checkpoint(ckpt, tmp_path / "out", dtype="bf16", progress=False)
    want, got = tensors(src), tensors(out)
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].dtype == torch.bfloat16
        assert torch.equal(got[key], want[key].to(torch.bfloat16)), key
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_auto_dtype_follows_a_bf16_source_even_from_fp32_masters(tmp_path):
    src = make_tiny_checkpoint(tmp_path / "src", "llama", dtype=torch.bfloat16)
    ckpt = make_dcp_checkpoint(src, tmp_path / "ckpt", source_dtype="bfloat16")
    masters = export_mod._DcpReader(ckpt).tensors("model.")
    assert {md.properties.dtype for md in masters.values()} == {torch.float32}
    want, got = tensors(src), tensors(export_checkpoint(ckpt, tmp_path / "out", progress=False))
    assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], want[k]) for k in want)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"


def test_max_shard_size_splits_into_indexed_shards(tiny, tmp_path):
    src, ckpt = tiny("deepseek_v3")
    out = export_checkpoint(ckpt, tmp_path / "out", max_shard_size="100KB", progress=False)
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(shards) > 4 and not (out / "model.safetensors").exists()
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    for path in shards:
        with safe_open(path, "pt") as f:
            assert f.metadata() == {"format": "pt"}  # no DCP_* junk
            if len(f.keys()) > 1:
                assert path.stat().st_size < 100_000 + 10_000  # + header
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors(out).values())
    assert sorted(index["weight_map"]) == sorted(tensors(src))


def test_a_model_that_fits_one_shard_is_still_indexed_as_one_of_one(tiny, tmp_path):
    src, ckpt = tiny("llama_tied")
    out = export_checkpoint(ckpt, tmp_path / "out", progress=False)
    assert [p.name for p in out.glob("*.safetensors")] == ["model-00001-of-00001.safetensors"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == dict.fromkeys(sorted(tensors(src)), "model-00001-of-00001.safetensors")
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors(out).values())
    assert index["metadata"]["total_parameters"] == sum(t.numel() for t in tensors(out).values())


def test_dcp_load_fallback_reads_the_same_tensors(tiny, tmp_path, monkeypatch):
    """Sharded (FSDP) items go through dcp.load; forcing that path changes nothing."""
    src, ckpt = tiny("qwen3_moe")
    monkeypatch.setattr(export_mod, "_create_file_view", None)
    got = tensors(export_checkpoint(ckpt, tmp_path / "out", progress=False))
    assert all(torch.equal(got[k], v) for k, v in tensors(src).items())


# --- FP8 sources ------------------------------------------------------------------------------


def dequantise(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows, cols = q.shape
    full = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :cols]
    return q.float() * full


@pytest.fixture
def fp8_source(tmp_path):
    """(FP8 source folder, dequantised fp32 folder, FP8 tensors) of a tiny DeepSeek-V3 with hidden 256."""
    base = make_tiny_checkpoint(tmp_path / "base", "deepseek_v3", hidden_size=256)
    src = make_fp8_checkpoint(base, tmp_path / "fp8", block=BLOCK)  # bf16 but the fp32 router bias, as V3 ships
    fp8 = tensors(src)
    plain = {k: dequantise(w, fp8[k + "_scale_inv"]) if k + "_scale_inv" in fp8 else w.float()
             for k, w in fp8.items() if not k.endswith("_scale_inv")}
    deq = shutil.copytree(base, tmp_path / "deq", ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    save_file(plain, deq / "model.safetensors", metadata={"format": "pt"})
    return src, deq, fp8


def test_fp8_source_exports_dequantised_bf16_without_scales(fp8_source, tmp_path):
    src, deq, fp8 = fp8_source
    ckpt = make_dcp_checkpoint(deq, tmp_path / "ckpt", source_dtype="bfloat16")  # the trainer's dequantised load
    meta = json.loads((ckpt / "hfpipe.json").read_text())
    (ckpt / "hfpipe.json").write_text(json.dumps({**meta, "source": str(src)}))
    out = export_checkpoint(ckpt, tmp_path / "out", progress=False)
    got = tensors(out)
    assert sorted(got) == sorted(k for k in fp8 if not k.endswith("weight_scale_inv"))
    for key, t in got.items():
        if (key + "_scale_inv") in fp8:
            assert t.dtype == torch.bfloat16
            assert torch.equal(t, dequantise(fp8[key], fp8[key + "_scale_inv"]).to(torch.bfloat16)), key
        else:
            assert t.dtype == fp8[key].dtype and torch.equal(t, fp8[key]), key
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["dtype"] == "bfloat16"
    _, info = _model(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


# --- source cross-check -----------------------------------------------------------------------


def test_source_only_keys_transformers_ignores_are_dropped_others_are_errors(tiny, tmp_path):
    src_orig, ckpt = tiny("deepseek_v3")
    src = shutil.copytree(src_orig, tmp_path / "src")
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    save_file({"model.layers.61.eh_proj.weight": torch.zeros(2, 2)}, src / "mtp.safetensors")
    index["weight_map"]["model.layers.61.eh_proj.weight"] = "mtp.safetensors"  # DeepSeek-V3's MTP layer
    index_path.write_text(json.dumps(index))
    out = export_checkpoint(ckpt, tmp_path / "out", source=src, progress=False)
    assert "model.layers.61.eh_proj.weight" not in tensors(out)

    index["weight_map"]["model.mystery.weight"] = "mtp.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(ExportError, match=r"source only model\.mystery\.weight"):
        export_checkpoint(ckpt, tmp_path / "out2", source=src, progress=False)


def test_a_checkpoint_of_another_model_is_refused_naming_keys(tiny, tmp_path):
    with pytest.raises(ExportError, match=r"does not match the source model: missing .*experts"):
        export_checkpoint(tiny("llama_tied")[1], tmp_path / "out", source=tiny("qwen3_moe")[0], progress=False)
    assert not (tmp_path / "out").exists()


# --- atomicity and errors ---------------------------------------------------------------------


def test_existing_out_is_refused_and_force_replaces_only_an_earlier_export(tiny, tmp_path):
    src, ckpt = tiny("llama_tied")
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(ExportError, match="exists; pass --force to overwrite"):
        export_checkpoint(ckpt, out, progress=False)
    with pytest.raises(ExportError, match="holds files and no hfpipe_export.json; --force replaces only a folder"):
        export_checkpoint(ckpt, out, force=True, progress=False)
    assert [p.name for p in out.iterdir()] == ["old.txt"]
    (out / "old.txt").unlink()
    export_checkpoint(ckpt, out, force=True, progress=False)  # an empty folder: nothing to lose
    (out / "old.txt").write_text("old")  # put into an earlier export since: not hfpipe's to delete
    with pytest.raises(ExportError, match="holds 'old.txt', which is not hfpipe's"):
        export_checkpoint(ckpt, out, force=True, progress=False)
    (out / "old.txt").unlink()
    (out / "config.json").write_text("{}")  # a file the export wrote, changed since: still the export's
    export_checkpoint(ckpt, out, force=True, progress=False)  # an earlier export
    assert json.loads((out / "config.json").read_text()) != {}
    assert json.loads((out / "hfpipe_export.json").read_text())["step"] == json.loads((ckpt / "hfpipe.json").read_text())["step"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


@pytest.mark.parametrize("existing", [False, True])
def test_a_failure_mid_export_leaves_no_output_and_no_temp_folder(tiny, tmp_path, monkeypatch, existing):
    _, ckpt = tiny("deepseek_v3")
    out = tmp_path / "out"
    if existing:  # an earlier export, which --force may replace
        out.mkdir()
        (out / "old.txt").write_text("old")
        (out / "hfpipe_export.json").write_text('{"written_by": "hfpipe", "files": ["old.txt"]}')
    written = []
    opened = ShardWriter.__init__

    def failing_writer(self, path, specs, pool=None):
        if written:
            raise OSError("disk full")
        written.append(path)
        opened(self, path, specs, pool)

    monkeypatch.setattr(ShardWriter, "__init__", failing_writer)
    with pytest.raises(OSError, match="disk full"):
        export_checkpoint(ckpt, out, max_shard_size="100KB", force=True, progress=False)
    assert written  # it did fail midway
    assert [p.name for p in tmp_path.iterdir()] == (["out"] if existing else [])
    if existing:
        assert sorted(p.name for p in out.iterdir()) == ["hfpipe_export.json", "old.txt"]


@pytest.mark.parametrize("missing", [".metadata", "hfpipe.json"])
def test_an_incomplete_checkpoint_is_refused(tiny, tmp_path, missing):
    ckpt = shutil.copytree(tiny("llama_tied")[1], tmp_path / "step-00000010")
    (ckpt / missing).unlink()
    with pytest.raises(ExportError, match=f"step-00000010 is incomplete: {missing} missing; pick an earlier"):
        export_checkpoint(ckpt, tmp_path / "out", progress=False)


def test_a_moved_source_needs_source_option(tiny, tmp_path):
    src_orig, ckpt_orig = tiny("llama_tied")
    src = shutil.copytree(src_orig, tmp_path / "src")
    ckpt = make_dcp_checkpoint(src, tmp_path / "ckpt")
    moved = src.rename(tmp_path / "moved")
    with pytest.raises(ExportError, match=r"no config\.json .*pass source="):
        export_checkpoint(ckpt, tmp_path / "out", progress=False)
    out = export_checkpoint(ckpt, tmp_path / "out", source=moved, progress=False)
    assert sorted(tensors(out)) == sorted(tensors(moved))


def test_unwritable_output_parent_is_an_export_error(tiny, tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ExportError, match="writable --out"):
        export_checkpoint(tiny("llama_tied")[1], tmp_path / "file" / "out", progress=False)


@pytest.mark.parametrize("stop", [KeyboardInterrupt, OSError])  # Ctrl-C; a disk error midway
def test_a_failed_export_removes_the_parents_it_made_and_a_finished_one_keeps_them(tiny, tmp_path, monkeypatch, stop):
    ckpt = tiny("llama_tied")[1]
    (tmp_path / "there").mkdir()
    out = tmp_path / "there" / "new" / "deeper" / "out"
    real = export_mod.build_folder

    def failing(out, fill, *args, **kwargs):
        def fill_then_stop(tmp):
            fill(tmp)
            raise stop("stopped midway")
        return real(out, fill_then_stop, *args, **kwargs)

    monkeypatch.setattr(export_mod, "build_folder", failing)
    with pytest.raises(stop):
        export_checkpoint(ckpt, out, progress=False)
    assert sorted(p.name for p in (tmp_path / "there").iterdir()) == [], "the folders it made, and nothing in them"
    monkeypatch.setattr(export_mod, "build_folder", real)
    export_checkpoint(ckpt, out, progress=False)
    assert (out / "config.json").exists()


def test_out_may_not_overwrite_the_checkpoint_or_source(tiny, tmp_path):
    src, ckpt = tiny("llama_tied")
    for target in (ckpt, src, ckpt.parent):
        with pytest.raises(ExportError, match="would overwrite"):
            export_checkpoint(ckpt, target, force=True, progress=False)
    assert (ckpt / ".metadata").exists() and (src / "config.json").exists()


@pytest.mark.parametrize(
    ("option", "value", "match"),
    [("dtype", "int8", "fix --dtype"), ("max_shard_size", "lots", "fix --max-shard-size")],
)
def test_bad_options_name_the_flag(tiny, tmp_path, option, value, match):
    with pytest.raises(ExportError, match=match):
        export_checkpoint(tiny("llama_tied")[1], tmp_path / "out", progress=False, **{option: value})


def test_shard_sizes_parse_like_save_pretrained():
    assert export_mod._parse_size("5GB") == 5_000_000_000
    assert export_mod._parse_size("300MB") == 300_000_000
    assert export_mod._parse_size("2GiB") == 2 * 1024**3
    assert export_mod._parse_size(1234) == 1234


def test_read_checkpoint_meta_validates_fields(tiny, tmp_path):
    ckpt = shutil.copytree(tiny("llama_tied")[1], tmp_path / "ckpt")
    meta = read_checkpoint_meta(ckpt)
    assert meta["step"] == 10 and meta["tied"] is True
    (ckpt / "hfpipe.json").write_text(json.dumps({**meta, "step": "ten"}))
    with pytest.raises(ExportError, match="field 'step' must be int"):
        read_checkpoint_meta(ckpt)
    (ckpt / "hfpipe.json").write_text(json.dumps({**meta, "format": 2}))
    with pytest.raises(ExportError, match="format 2 is not supported"):
        read_checkpoint_meta(ckpt)
    with pytest.raises(ExportError, match="not found"):
        read_checkpoint_meta(tmp_path / "nowhere")
