"""Spec of the checkpoint loader (``hfpipe.source.folder``, ``hfpipe.source.safetensors_io``, ``hfpipe.pipeline.load``).

Each pipeline rank opens only the shards that hold its own tensors and reads only those tensors;
what it loads is bit for bit what ``from_pretrained`` would put under the same names. Checkpoints
that do not match the model fail loudly, naming the key and the file and saying what to do.
All in one process, on tiny checkpoints built by the fixtures.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from _dist import folder_tensors
from hfpipe.pipeline.build import load_rank_stages
from hfpipe.pipeline.load import LoadError
from hfpipe.models.adapter import UnsupportedModelError
from hfpipe.plan.split import Plan, StageSpec, plan_pipeline
from hfpipe.source.folder import ModelSource, SourceError
from hfpipe.tiny import TINY_KINDS, make_fp8_checkpoint, make_tiny_checkpoint

CPU = torch.device("cpu")
INDEX = "model.safetensors.index.json"
BLOCK = 128


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """kind -> tiny checkpoint folder (several shards + index), built once per module; read-only."""
    cache: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in cache:
            cache[kind] = make_tiny_checkpoint(tmp_path_factory.mktemp(kind) / "ckpt", kind, tokenizer=False)
        return cache[kind]

    return get


def hf_model(folder: Path, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, **kwargs).eval()


def load_all_ranks(folder, pp: int, dtype=None, **plan_kwargs):
    """Every rank's (modules, stats), loaded one rank after the other as separate processes would."""
    src = ModelSource.open(folder)
    plan = plan_pipeline(src.config, pp, **plan_kwargs)
    return [load_rank_stages(src, plan, rank, CPU, dtype) for rank in range(pp)]


def stage_state(ranks) -> dict[str, torch.Tensor]:
    """The union of all stages' state dicts (names are the full model's)."""
    out = {}
    for modules, _ in ranks:
        for module in modules:
            out.update(module.state_dict())
    return out


def expected_reads(src: ModelSource, specs) -> tuple[list[str], list[str], int]:
    """(files, keys, bytes) a rank holding ``specs`` must read, worked out from the index alone."""
    keys = set()
    for spec in specs:
        prefixes = tuple(f"model.layers.{i}." for i in spec.layers)
        keys |= {k for k in src.weight_map if k.startswith(prefixes)}
        if spec.embed:
            keys.add("model.embed_tokens.weight")
        if spec.head:
            keys |= {"model.norm.weight", "model.embed_tokens.weight" if src.tied else "lm_head.weight"}
    files = sorted({src.weight_map[k] for k in keys})
    nbytes = 0
    for k in keys:
        begin, end = src.header(src.weight_map[k])[k]["data_offsets"]
        nbytes += end - begin
    return files, sorted(keys), nbytes


def edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def add_tensors(folder: Path, tensors: dict[str, torch.Tensor], shard: str = "extra.safetensors") -> None:
    """Write ``tensors`` into a new shard and list them in the index."""
    save_file(tensors, folder / shard, metadata={"format": "pt"})
    edit_json(folder / INDEX, lambda ix: ix["weight_map"].update(dict.fromkeys(tensors, shard)))


# --- each rank reads only its own tensors ------------------------------------------------------


@pytest.mark.parametrize("pp", [2, 3, 4])
@pytest.mark.parametrize("kind", ["llama", "llama_tied", "deepseek_v3"])
def test_each_rank_opens_only_its_shards_and_reads_only_its_tensors(tiny, kind, pp):
    src = ModelSource.open(tiny(kind))
    plan = plan_pipeline(src.config, pp)
    read_by_all = []
    for rank in range(pp):
        _, stats = load_rank_stages(src, plan, rank, CPU)
        files, keys, nbytes = expected_reads(src, plan.stages_of_rank(rank))
        assert len(files) < len(set(src.weight_map.values()))  # the test means something
        assert stats.files_opened == files, f"rank {rank}"  # each once, in name order
        assert sorted(stats.keys_read) == keys, f"rank {rank}"  # each once
        assert stats.bytes_read == nbytes
        read_by_all += stats.keys_read
    twice = ["model.embed_tokens.weight"] if src.tied else []  # first stage's embedding, last stage's head
    assert sorted(read_by_all) == sorted(list(src.weight_map) + twice)


def test_a_rank_with_two_v_stages_reads_the_union_of_their_tensors(tiny):
    src = ModelSource.open(tiny("llama_tied"))
    plan = plan_pipeline(src.config, 2, vpp=2, style="v")
    for rank in range(2):
        _, stats = load_rank_stages(src, plan, rank, CPU)
        files, keys, nbytes = expected_reads(src, plan.stages_of_rank(rank))
        assert (stats.files_opened, sorted(stats.keys_read), stats.bytes_read) == (files, keys, nbytes)


# --- what is loaded is what from_pretrained loads ------------------------------------------------


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_stage_tensors_equal_from_pretrained_bit_for_bit_under_the_same_names(tiny, kind):
    ranks = load_all_ranks(tiny(kind), 3)
    want = hf_model(tiny(kind)).state_dict()  # in memory: fused MoE experts, lm_head even if tied
    got = stage_state(ranks)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name


def test_bf16_stages_equal_from_pretrained_bf16_and_keep_the_fp32_router_bias(tiny):
    folder = tiny("deepseek_v3")
    got = stage_state(load_all_ranks(folder, 2, dtype=torch.bfloat16))
    want = hf_model(folder, dtype=torch.bfloat16).state_dict()
    assert want["model.layers.2.mlp.gate.e_score_correction_bias"].dtype == torch.float32  # transformers' rule
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name


def test_single_file_checkpoint_without_index_loads(tiny, tmp_path):
    hf_model(tiny("llama")).save_pretrained(tmp_path / "single")  # small enough for one file
    assert not (tmp_path / "single" / INDEX).exists() and (tmp_path / "single" / "model.safetensors").exists()
    ranks = load_all_ranks(tmp_path / "single", 2)
    assert all(stats.files_opened == ["model.safetensors"] for _, stats in ranks)
    want = hf_model(tiny("llama")).state_dict()
    assert all(torch.equal(t, want[n]) for n, t in stage_state(ranks).items())


# --- tied embeddings ----------------------------------------------------------------------------


def test_tied_head_of_the_last_stage_is_a_copy_of_the_embedding(tiny):
    ranks = load_all_ranks(tiny("llama_tied"), 3)
    first, last = ranks[0][0][0], ranks[-1][0][-1]
    assert last.model.embed_tokens is None and first.lm_head is None
    assert torch.equal(last.lm_head.weight, first.model.embed_tokens.weight)
    assert last.lm_head.weight is not first.model.embed_tokens.weight  # separate ranks, separate copies


@pytest.mark.parametrize(("pp", "vpp", "style"), [(1, 1, "loop"), (2, 2, "v")])
def test_tied_head_and_embedding_on_one_rank_are_one_parameter_read_once(tiny, pp, vpp, style):
    modules, stats = load_all_ranks(tiny("llama_tied"), pp, vpp=vpp, style=style)[0]
    first, last = modules[0], modules[-1]
    assert last.lm_head.weight is first.model.embed_tokens.weight
    assert stats.keys_read.count("model.embed_tokens.weight") == 1


# --- DeepSeek-V3 extras: MTP layer, FP8 weights -------------------------------------------------


def mtp_tensors(layer: int, hidden: int = 64) -> dict[str, torch.Tensor]:
    """Some of the tensors DeepSeek-V3 stores for its multi-token-prediction layer."""
    names = ["enorm.weight", "hnorm.weight", "shared_head.norm.weight"]
    out = {f"model.layers.{layer}.{n}": torch.ones(hidden) for n in names}
    out[f"model.layers.{layer}.eh_proj.weight"] = torch.zeros(hidden, 2 * hidden)
    out[f"model.layers.{layer}.self_attn.q_a_proj.weight"] = torch.zeros(32, hidden)
    out[f"model.layers.{layer}.mlp.experts.0.gate_proj.weight"] = torch.zeros(32, hidden)
    return out


def test_mtp_layer_tensors_are_skipped_with_a_log_line_and_never_read(tiny, tmp_path, caplog):
    folder = shutil.copytree(tiny("deepseek_v3"), tmp_path / "ckpt")
    n = ModelSource.open(folder).config.num_hidden_layers
    add_tensors(folder, mtp_tensors(n), "mtp.safetensors")
    with caplog.at_level(logging.INFO, logger="hfpipe.pipeline.load"):
        ranks = load_all_ranks(folder, 2)
    for _, stats in ranks:
        assert stats.skipped_mtp == 6
        assert "mtp.safetensors" not in stats.files_opened
        assert not any(k.startswith(f"model.layers.{n}.") for k in stats.keys_read)
    assert "skipped 6 checkpoint tensors of MTP layers" in caplog.text
    want = hf_model(tiny("deepseek_v3")).state_dict()
    assert all(torch.equal(t, want[name]) for name, t in stage_state(ranks).items())


def test_a_layer_beyond_the_mtp_layers_is_unexpected(tiny, tmp_path):
    folder = shutil.copytree(tiny("deepseek_v3"), tmp_path / "ckpt")
    n = ModelSource.open(folder).config.num_hidden_layers
    add_tensors(folder, {f"model.layers.{n + 1}.enorm.weight": torch.ones(64)}, "mtp.safetensors")
    with pytest.raises(LoadError, match=rf"mtp\.safetensors: unexpected tensor 'model\.layers\.{n + 1}\.enorm"):
        load_all_ranks(folder, 2)


def dequantise(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """w = fp8 * scale, each scale covering one BLOCK x BLOCK tile (edge tiles cut short)."""
    rows, cols = q.shape
    return q.float() * torch.kron(scale_inv, torch.ones(BLOCK, BLOCK))[:rows, :cols]


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    """(FP8 folder, folder of its independently dequantised fp32 weights) of a DeepSeek-V3.

    Hidden 160 and intermediate 288 are not multiples of 128: edge tiles are partial.
    """
    root = tmp_path_factory.mktemp("fp8")
    base = make_tiny_checkpoint(root / "base", "deepseek_v3", hidden_size=160, intermediate_size=288, tokenizer=False)
    src = make_fp8_checkpoint(base, root / "fp8", block=BLOCK)
    tensors = folder_tensors(src)
    plain = {k: dequantise(t, tensors[k + "_scale_inv"]) if k + "_scale_inv" in tensors else t.float()
             for k, t in tensors.items() if not k.endswith("_scale_inv")}
    deq = shutil.copytree(base, root / "deq", ignore=shutil.ignore_patterns("*.safetensors", INDEX))
    save_file(plain, deq / "model.safetensors", metadata={"format": "pt"})
    return src, deq


def test_fp8_builder_writes_deepseek_v3_block_fp8(fp8, tiny):
    src, _ = fp8
    cfg = json.loads((src / "config.json").read_text())
    assert cfg["quantization_config"] == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                          "weight_block_size": [BLOCK, BLOCK]}
    index = json.loads((src / INDEX).read_text())["weight_map"]
    assert len(set(index.values())) > 1
    tensors = folder_tensors(src)
    assert sorted(index) == sorted(tensors)
    base = folder_tensors(src.parent / "base")
    quantised = {k for k, t in tensors.items() if t.dtype == torch.float8_e4m3fn}
    assert "model.layers.3.mlp.experts.7.down_proj.weight" in quantised
    assert not {k for k in quantised if "norm" in k or "mlp.gate.weight" in k or not k.startswith("model.layers.")}
    assert sorted(k for k in tensors if k.endswith("_scale_inv")) == sorted(k + "_scale_inv" for k in quantised)
    partial = 0
    for k in quantised:
        q, s, w = tensors[k], tensors[k + "_scale_inv"], base[k]
        assert s.dtype == torch.float32 and s.shape == (math.ceil(q.shape[0] / BLOCK), math.ceil(q.shape[1] / BLOCK))
        partial += any(d > BLOCK and d % BLOCK for d in q.shape)
        torch.testing.assert_close(dequantise(q, s), w, rtol=0.07, atol=1e-3 * w.abs().max().item())
    assert partial  # tiles cut short at the edge of a multi-tile dimension


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_weights_are_dequantised_then_cast_to_the_stage_dtype(fp8, dtype):
    src, deq = fp8
    got = stage_state(load_all_ranks(src, 2, dtype=dtype))
    want = hf_model(deq, dtype=dtype).state_dict()  # the dequantised weights as transformers places them
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name


def test_fp8_stages_give_the_logits_of_the_dequantised_model(fp8):
    src, deq = fp8
    ranks = load_all_ranks(src, 2)
    ids = torch.randint(0, 384, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    with torch.no_grad():
        h = ids
        for modules, _ in ranks:
            for module in modules:
                h = module(h, attention_mask=mask)
        torch.testing.assert_close(h, hf_model(deq)(ids, attention_mask=mask).logits, rtol=0, atol=0)


# --- strict errors ------------------------------------------------------------------------------


@pytest.fixture
def llama(tiny, tmp_path) -> Path:
    """A private, editable copy of the tiny Llama checkpoint."""
    return Path(shutil.copytree(tiny("llama"), tmp_path / "llama"))


def shard_of(folder: Path, key: str) -> str:
    return json.loads((folder / INDEX).read_text())["weight_map"][key]


def drop_from_its_shard(folder: Path, key: str) -> str:
    """Remove tensor ``key`` from the shard the index names for it (the index keeps it); return the shard."""
    shard = shard_of(folder, key)
    tensors = load_file(folder / shard)
    del tensors[key]
    save_file(tensors, folder / shard, metadata={"format": "pt"})
    return shard


def test_missing_tensor_names_the_key_and_the_index(llama):
    key = "model.layers.3.mlp.up_proj.weight"
    drop_from_its_shard(llama, key)
    edit_json(llama / INDEX, lambda ix: ix["weight_map"].pop(key))
    with pytest.raises(LoadError, match=rf"{INDEX}: tensor '{key}' is missing .*incomplete or does not match"):
        load_all_ranks(llama, 2)


def test_tensor_listed_in_the_index_but_absent_from_its_shard_says_re_download(llama):
    key = "model.layers.3.mlp.up_proj.weight"
    shard = drop_from_its_shard(llama, key)
    with pytest.raises(LoadError, match=rf"{shard}: tensor '{key}' is not in this file .*re-download"):
        load_all_ranks(llama, 2)


def test_unexpected_tensor_names_the_key_and_its_file(llama):
    add_tensors(llama, {"model.layers.0.mlp.bogus.weight": torch.zeros(2, 2)})
    with pytest.raises(LoadError, match=r"extra\.safetensors: unexpected tensor 'model\.layers\.0\.mlp\.bogus\.weight'"
                                        r".*does not match"):
        load_all_ranks(llama, 2)


@pytest.mark.parametrize(("field", "key"), [("hidden_size", "model.embed_tokens.weight"),
                                            ("intermediate_size", "model.layers.0.mlp.down_proj.weight")])
def test_shape_mismatch_names_the_key_the_shapes_and_config_json(llama, field, key):
    edit_json(llama / "config.json", lambda cfg: cfg.update({field: cfg[field] * 2}))
    with pytest.raises(LoadError, match=rf"{shard_of(llama, key)}: '{key}' has shape .* but the model expects .*"
                                        r"config\.json does not match the weights"):
        load_all_ranks(llama, 2)


def test_truncated_shard_fails_on_the_rank_that_reads_it_only(llama):
    key = "model.layers.5.mlp.up_proj.weight"  # on the last of pp=2's ranks
    path = llama / shard_of(llama, key)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    src = ModelSource.open(llama)
    plan = plan_pipeline(src.config, 2)
    assert path.name not in load_rank_stages(src, plan, 0, CPU)[1].files_opened
    with pytest.raises(SourceError, match=rf"{path.name}: truncated shard: .*; re-download"):
        load_rank_stages(src, plan, 1, CPU)  # the header check finds it before a byte is read


@pytest.mark.parametrize("text", ["{not json", '{"metadata": {}}', '{"weight_map": {}}'])
def test_malformed_index_is_refused_naming_it(llama, text):
    (llama / INDEX).write_text(text)
    with pytest.raises(SourceError, match=rf"{INDEX}: .*malformed.*re-download"):
        ModelSource.open(llama)


def test_missing_shard_file_is_named(llama):
    key = "model.layers.5.mlp.up_proj.weight"
    (llama / shard_of(llama, key)).unlink()
    with pytest.raises(SourceError, match=rf"{shard_of(llama, key)}: shard file is missing; re-download"):
        load_all_ranks(llama, 2)


def test_pickle_only_folder_is_refused(llama):
    for path in llama.glob("*.safetensors"):
        path.unlink()
    (llama / INDEX).unlink()
    torch.save({}, llama / "pytorch_model.bin")
    with pytest.raises(SourceError, match=r"only pickle weights .*safetensors only: convert"):
        ModelSource.open(llama)


def test_config_needing_remote_code_asks_for_trust_remote_code(llama):
    auto_map = {"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    edit_json(llama / "config.json", lambda cfg: cfg.update(model_type="x_lm", auto_map=auto_map))
    with pytest.raises(SourceError, match=r"config\.json: model type 'x_lm' needs remote code; pass --trust-remote"):
        ModelSource.open(llama)


def one_stage_plan(num_layers: int) -> Plan:
    return Plan((StageSpec(0, tuple(range(num_layers)), embed=True, head=True),), pp=1, vpp=1, style="loop")


def test_unknown_architecture_lists_the_supported_ones(tmp_path):
    """The entry check names the missing part and the supported families; loading alone refuses too."""
    from transformers import GPT2Config

    from hfpipe.models.support import get_adapter

    GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100).save_pretrained(tmp_path)
    save_file({"transformer.wte.weight": torch.zeros(100, 32)}, tmp_path / "model.safetensors")
    src = ModelSource.open(tmp_path)
    with pytest.raises(UnsupportedModelError, match=r"'gpt2' is not supported: its model has no model.embed_tokens .*; supported: .*llama.*qwen3"):
        get_adapter(src.config)
    with pytest.raises(UnsupportedModelError, match=r"'gpt2' is not proven exact yet; call .*get_adapter"):
        load_rank_stages(src, one_stage_plan(2), 0, CPU)


def test_refused_architecture_says_why(tmp_path):
    from transformers import FalconH1Config

    FalconH1Config(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=16, vocab_size=100).save_pretrained(tmp_path)
    save_file({"model.embed_tokens.weight": torch.zeros(100, 32)}, tmp_path / "model.safetensors")
    src = ModelSource.open(tmp_path)
    with pytest.raises(UnsupportedModelError, match=r"'falcon_h1' is not supported: its Mamba layers .* supported: .*llama"):
        load_rank_stages(src, one_stage_plan(2), 0, CPU)


# --- hub ids ------------------------------------------------------------------------------------


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """An offline hub cache dir (env and huggingface_hub's import-time constants both point at it)."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def put_in_cache(cache: Path, repo_id: str, folder: Path) -> Path:
    """Lay ``folder`` out as huggingface_hub caches a download of ``repo_id`` at main."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    return repo / "snapshots" / commit


def test_hub_id_loads_offline_from_the_cache_resolving_only_the_ranks_shards(tiny, offline_hub, monkeypatch):
    snapshot = put_in_cache(offline_hub, "tiny/llama", tiny("llama"))
    resolved = []
    real_path = ModelSource.path
    monkeypatch.setattr(ModelSource, "path", lambda self, name: resolved.append(name) or real_path(self, name))

    src = ModelSource.open("tiny/llama")
    assert (src.repo_id, src.folder) == ("tiny/llama", snapshot) and resolved == []
    plan = plan_pipeline(src.config, 4)
    modules, stats = load_rank_stages(src, plan, 1, CPU)
    assert sorted(set(resolved)) == stats.files_opened == expected_reads(src, plan.stages_of_rank(1))[0]
    want = hf_model(tiny("llama")).state_dict()
    assert all(torch.equal(t, want[n]) for m in modules for n, t in m.state_dict().items())


def test_hub_id_missing_from_an_offline_cache_says_so(offline_hub):
    with pytest.raises(SourceError, match=r"tiny/absent: .*HF_HUB_OFFLINE is set and it is not in the cache"):
        ModelSource.open("tiny/absent")
