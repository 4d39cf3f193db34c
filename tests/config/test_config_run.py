"""FinetuneConfig: strict YAML loading, CLI overrides, one-line validation messages naming flags."""

import dataclasses
import json

import pytest
import yaml
from transformers import AutoConfig

from hfpipe.config.run import (
    INTERLEAVED_SCHEDULES,
    SCHEDULES,
    V_SCHEDULES,
    ConfigError,
    FinetuneConfig,
    bundled_config_dir,
    field_help,
)


def write(tmp_path, text, name="run.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def error(**kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        FinetuneConfig(**{"model": "m", **kwargs})
    return str(info.value)


# -- loading ---------------------------------------------------------------------------------------


def test_defaults():
    c = FinetuneConfig(model="m")
    assert (c.pp, c.dp, c.vpp, c.schedule, c.plan_method, c.layout) == (1, 1, 1, "1f1b", "balanced", None)
    assert c.betas == (0.9, 0.95) and c.dtype == "fp32" and c.max_grad_norm == 1.0
    assert c.num_microbatches == 1 and c.pipeline_style == "loop"


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_from_yaml_reads_every_key_type(tmp_path):
    path = write(tmp_path, """
model: meta-llama/Llama-3.1-8B
pp: 4
schedule: interleaved-1f1b
lr: 1e-5              # YAML 1.1 reads this as a string; it must still be a float
betas: [0.9, 0.999]
max_grad_norm: null
packing: false
layout: "Et|tL"
""")
    c = FinetuneConfig.from_yaml(path)
    assert c.model == "meta-llama/Llama-3.1-8B" and c.pp == 4 and c.vpp == 2
    assert c.lr == 1e-5 and isinstance(c.lr, float)
    assert c.betas == (0.9, 0.999) and isinstance(c.betas, tuple)
    assert c.max_grad_norm is None and c.packing is False and c.layout == "Et|tL"


def test_int_is_accepted_for_float():
    c = FinetuneConfig(model="m", lr=1, max_grad_norm=2)
    assert c.lr == 1.0 and isinstance(c.lr, float) and isinstance(c.max_grad_norm, float)


def test_to_dict_round_trips_through_yaml(tmp_path):
    c = FinetuneConfig(model="m", pp=2, schedule="zbv", betas=(0.8, 0.9), resume="auto")
    path = write(tmp_path, yaml.safe_dump(c.to_dict()))
    assert FinetuneConfig.from_yaml(path) == c
    assert FinetuneConfig.from_dict(c.to_dict()) == c
    assert c.to_dict()["betas"] == [0.8, 0.9]


def test_unknown_key_names_key_file_and_close_match(tmp_path):
    path = write(tmp_path, "model: m\nwarmup_step: 10\n")
    with pytest.raises(ConfigError) as info:
        FinetuneConfig.from_yaml(path)
    assert str(info.value) == f"{path}: unknown key 'warmup_step' (did you mean warmup_steps, max_steps?)"


def test_unknown_key_spelled_as_a_flag_suggests_the_field(tmp_path):
    path = write(tmp_path, "model: m\nbatch-size: 4\n")
    with pytest.raises(ConfigError, match=r"unknown key 'batch-size' \(did you mean batch_size"):
        FinetuneConfig.from_yaml(path)


def test_unknown_key_without_close_match_lists_valid_keys(tmp_path):
    path = write(tmp_path, "model: m\nzzz: 1\n")
    with pytest.raises(ConfigError) as info:
        FinetuneConfig.from_yaml(path)
    message = str(info.value)
    assert message.startswith(f"{path}: unknown key 'zzz' (valid keys: model, output_dir, pp,")
    assert "\n" not in message


@pytest.mark.parametrize("key, field", [("learning_rate", "lr"), ("num_train_epochs", "epochs"),
                                        ("gradient_accumulation_steps", "grad_accum"),
                                        ("max_seq_length", "seq_len"), ("lora_r", "lora_rank")])
def test_another_librarys_name_for_a_field_names_the_field(tmp_path, key, field):
    path = write(tmp_path, f"model: m\n{key}: 1\n")
    with pytest.raises(ConfigError) as info:
        FinetuneConfig.from_yaml(path)
    assert str(info.value) == f"{path}: unknown key {key!r} (did you mean {field}? hfpipe's name for {key})"


def test_unknown_key_in_dict_names_source():
    with pytest.raises(ConfigError, match=r"^recipe\.yaml: unknown key 'ppp' \(did you mean pp"):
        FinetuneConfig.from_dict({"model": "m", "ppp": 2}, source="recipe.yaml")


def test_unknown_override_is_an_error(tmp_path):
    path = write(tmp_path, "model: m\n")
    with pytest.raises(ConfigError, match=r"^command-line overrides: unknown key 'learning_rate'"):
        FinetuneConfig.from_yaml(path, learning_rate=1e-5)


def test_overrides_win_and_none_overrides_are_ignored(tmp_path):
    path = write(tmp_path, "model: m\npp: 2\nlr: 3.0e-5\nseq_len: 1024\n")
    c = FinetuneConfig.from_yaml(path, pp=4, lr=None, seq_len=None, dtype="bf16-mixed")
    assert (c.pp, c.lr, c.seq_len, c.dtype) == (4, 3e-5, 1024, "bf16-mixed")


def test_override_supplies_missing_model(tmp_path):
    path = write(tmp_path, "pp: 2\n")
    assert FinetuneConfig.from_yaml(path, model="other").model == "other"


@pytest.mark.parametrize("text", ["", "pp: 2\n"])
def test_missing_model(tmp_path, text):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        FinetuneConfig.from_yaml(path)
    assert str(info.value) == (f"{path}: the model is required (set `model:` in the recipe, "
                               "or give MODEL on the command line)")


def test_yaml_that_is_not_a_mapping(tmp_path):
    path = write(tmp_path, "- model\n- pp\n")
    with pytest.raises(ConfigError) as info:
        FinetuneConfig.from_yaml(path)
    assert str(info.value) == f"{path}: expected a mapping of option: value, got list"


def test_invalid_yaml_is_one_line(tmp_path):
    path = write(tmp_path, "model: m\npp: [1, 2\n")
    with pytest.raises(ConfigError) as info:
        FinetuneConfig.from_yaml(path)
    assert str(info.value).startswith(f"{path}: not valid YAML: ") and "\n" not in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"^cannot read config .*nope\.yaml: No such file"):
        FinetuneConfig.from_yaml(tmp_path / "nope.yaml")


def test_validation_errors_from_a_file_name_the_file(tmp_path):
    path = write(tmp_path, "model: m\npp: 0\n")
    with pytest.raises(ConfigError) as info:
        FinetuneConfig.from_yaml(path)
    assert str(info.value) == f"{path}: --pp must be >= 1, got 0"


# -- every validation message ----------------------------------------------------------------------

MESSAGES = [
    (dict(model=""), "--model must not be empty"),
    (dict(output_dir=" "), "--output-dir must not be empty"),
    (dict(pp="4"), "--pp must be an integer, got '4'"),
    (dict(pp=2.0), "--pp must be an integer, got 2.0"),
    (dict(pp=True), "--pp must be an integer, got True"),
    (dict(packing="yes"), "--packing must be true or false, got 'yes'"),
    (dict(lr="fast"), "--lr must be a number, got 'fast'"),
    (dict(dataset=3), "--dataset must be a string, got 3"),
    (dict(betas=[0.9]), "--betas must be a list of 2 numbers, got [0.9]"),
    (dict(betas="0.9"), "--betas must be a list of 2 numbers, got '0.9'"),
    (dict(betas=[0.9, "x"]), "--betas must be a number, got 'x'"),
    (dict(pp=0), "--pp must be >= 1, got 0"),
    (dict(dp=0), "--dp must be >= 1, got 0"),
    (dict(vpp=0), "--vpp must be >= 1, got 0"),
    (dict(seq_len=0), "--seq-len must be >= 1, got 0"),
    (dict(batch_size=0), "--batch-size must be >= 1, got 0"),
    (dict(grad_accum=0), "--grad-accum must be >= 1, got 0"),
    (dict(epochs=0), "--epochs must be >= 1, got 0"),
    (dict(keep=0), "--keep must be >= 1, got 0"),
    (dict(log_every=0), "--log-every must be >= 1, got 0"),
    (dict(microbatches=0), "--microbatches must be >= 1, got 0"),
    (dict(max_steps=0), "--max-steps must be >= 1, got 0"),
    (dict(save_every=-1), "--save-every must be >= 1, got -1"),
    (dict(threads_per_rank=0), "--threads-per-rank must be >= 1, got 0"),
    (dict(warmup_steps=-1), "--warmup-steps must be >= 0, got -1"),
    (dict(seed=-1), "--seed must be >= 0, got -1"),
    (dict(min_lr=-1e-6), "--min-lr must be >= 0, got -1e-06"),
    (dict(weight_decay=-0.1), "--weight-decay must be >= 0, got -0.1"),
    (dict(lr=-1e-5), "--lr must be >= 0, got -1e-05"),
    (dict(eps=0), "--eps must be > 0, got 0.0"),
    (dict(max_grad_norm=0), "--max-grad-norm must be > 0, got 0.0"),
    (dict(lr=1e-5, min_lr=2e-5), "--min-lr (2e-05) must be <= --lr (1e-05)"),
    (dict(betas=[0.9, 1.0]), "--betas must both be in [0, 1), got [0.9, 1.0]"),
    (dict(schedule="1F1B"), "--schedule must be one of " + ", ".join(SCHEDULES) + "; got '1F1B' (did you mean 1f1b?)"),
    (dict(schedule="pipedream"), "--schedule must be one of " + ", ".join(SCHEDULES) + "; got 'pipedream'"),
    (dict(plan_method="greedy"), "--plan-method must be one of even, weighted, balanced; got 'greedy'"),
    (dict(lr_schedule="cosin"), "--lr-schedule must be one of cosine, linear, constant; got 'cosin' (did you mean cosine?)"),
    (dict(dtype="fp16"), "--dtype must be one of fp32, bf16-mixed, bf16, fp64; got 'fp16' (did you mean bf16?)"),
    (dict(activation_checkpointing="all"), "--activation-checkpointing must be one of none, full, selective; got 'all'"),
    (dict(schedule="zbv", vpp=3), "--vpp must be 2 for --schedule zbv (a V of two stages), got 3"),
    (dict(schedule="dualpipev", vpp=4), "--vpp must be 2 for --schedule dualpipev (a V of two stages), got 4"),
    (dict(schedule="1f1b", vpp=2), "--vpp must be 1 for --schedule 1f1b, got 2; use --schedule interleaved-1f1b for several stages per rank"),
    (dict(schedule="gpipe", vpp=3), "--vpp must be 1 for --schedule gpipe, got 3; use --schedule interleaved-1f1b for several stages per rank"),
    (dict(batch_size=6, microbatches=4), "--batch-size (6) must be a multiple of --microbatches (4)"),
    (dict(batch_size=12, pp=4, schedule="zbv"), "--batch-size (12) must be a multiple of --microbatches (8, the default pp * vpp)"),
]


@pytest.mark.parametrize("kwargs, message", MESSAGES, ids=[m for _, m in MESSAGES])
def test_validation_message(kwargs, message):
    assert error(**kwargs) == message


def test_every_message_is_one_line_and_names_a_flag():
    for kwargs, _ in MESSAGES:
        message = error(**kwargs)
        assert "\n" not in message and message.startswith("--")


def test_validation_also_runs_on_replace():
    c = FinetuneConfig(model="m")
    with pytest.raises(ConfigError, match="--pp must be >= 1"):
        dataclasses.replace(c, pp=0)


# -- stages per rank and microbatches --------------------------------------------------------------


@pytest.mark.parametrize("schedule", V_SCHEDULES + INTERLEAVED_SCHEDULES)
def test_vpp_left_at_one_becomes_two(schedule):
    assert FinetuneConfig(model="m", schedule=schedule).vpp == 2


@pytest.mark.parametrize("schedule", V_SCHEDULES)
def test_v_schedules_accept_vpp_two(schedule):
    c = FinetuneConfig(model="m", schedule=schedule, vpp=2)
    assert c.vpp == 2 and c.pipeline_style == "v"


@pytest.mark.parametrize("schedule", INTERLEAVED_SCHEDULES)
def test_interleaved_schedules_keep_larger_vpp(schedule):
    c = FinetuneConfig(model="m", schedule=schedule, vpp=3, batch_size=6)
    assert c.vpp == 3 and c.pipeline_style == "loop"


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_single_stage_schedules_keep_vpp_one(schedule):
    assert FinetuneConfig(model="m", schedule=schedule).vpp == 1


def test_microbatches_default_to_stage_count():
    c = FinetuneConfig(model="m", pp=4, schedule="interleaved-1f1b", batch_size=16)
    assert c.microbatches is None and c.num_microbatches == 8
    assert FinetuneConfig(model="m", pp=4, schedule="gpipe", microbatches=2, batch_size=4).num_microbatches == 2


# -- field docs and bundled model configs ----------------------------------------------------------


def test_every_field_has_a_docstring():
    docs = field_help()
    names = [f.name for f in dataclasses.fields(FinetuneConfig)]
    assert sorted(docs) == sorted(names)
    assert all(len(docs[n]) > 10 for n in names)


def test_bundled_config_dir_maps_hub_ids():
    folder = bundled_config_dir("meta-llama/Llama-3.1-8B")
    assert folder is not None and folder.name == "meta-llama--Llama-3.1-8B"
    assert (folder / "config.json").is_file()
    assert bundled_config_dir("nobody/Nothing-1B") is None
    assert bundled_config_dir("..") is None


BUNDLED = {
    "meta-llama/Llama-3.2-1B": dict(model_type="llama", num_hidden_layers=16, hidden_size=2048, tie_word_embeddings=True),
    "meta-llama/Llama-3.1-8B": dict(model_type="llama", num_hidden_layers=32, hidden_size=4096, tie_word_embeddings=False),
    "meta-llama/Llama-3.1-70B": dict(model_type="llama", num_hidden_layers=80, hidden_size=8192, num_key_value_heads=8),
    "meta-llama/Llama-3.1-405B": dict(model_type="llama", num_hidden_layers=126, hidden_size=16384, num_attention_heads=128,
                                      num_key_value_heads=8, intermediate_size=53248, vocab_size=128256),
    "deepseek-ai/DeepSeek-V2-Lite": dict(model_type="deepseek_v2", num_hidden_layers=27, q_lora_rank=None, n_routed_experts=64),
    "deepseek-ai/DeepSeek-V3": dict(model_type="deepseek_v3", num_hidden_layers=61, num_nextn_predict_layers=1, first_k_dense_replace=3),
    "deepseek-ai/DeepSeek-V3.2-Exp": dict(model_type="deepseek_v32", num_hidden_layers=61, num_nextn_predict_layers=1),
    "deepseek-ai/DeepSeek-V4-Flash-Base": dict(model_type="deepseek_v4", num_hidden_layers=43),
}


@pytest.mark.parametrize("model_id", BUNDLED)
def test_bundled_config_loads_natively(model_id):
    folder = bundled_config_dir(model_id)
    assert folder is not None
    config = AutoConfig.from_pretrained(folder)  # no trust_remote_code: transformers' own class
    assert type(config).__module__.startswith("transformers.models.")
    for key, value in BUNDLED[model_id].items():
        assert getattr(config, key) == value, key


def test_bundled_rope_and_quantization():
    llama = AutoConfig.from_pretrained(bundled_config_dir("meta-llama/Llama-3.2-1B"))
    assert llama.rope_parameters["rope_type"] == "llama3" and llama.rope_parameters["factor"] == 32.0
    v3 = AutoConfig.from_pretrained(bundled_config_dir("deepseek-ai/DeepSeek-V3"))
    assert v3.rope_parameters["rope_type"] == "yarn" and v3.rope_parameters["factor"] == 40
    raw = json.loads((bundled_config_dir("deepseek-ai/DeepSeek-V3") / "config.json").read_text())
    assert raw["quantization_config"]["quant_method"] == "fp8"
    assert raw["quantization_config"]["weight_block_size"] == [128, 128]
    assert "auto_map" in raw  # kept as published


def test_bundled_readme_lists_every_folder():
    root = bundled_config_dir("meta-llama/Llama-3.1-8B").parent
    readme = (root / "README.md").read_text()
    folders = sorted(p.name for p in root.iterdir() if p.is_dir())
    assert len(folders) == len(BUNDLED)
    for name in folders:
        assert f"`{name}`" in readme
