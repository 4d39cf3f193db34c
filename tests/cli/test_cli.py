"""Spec of the ``hfpipe`` command line: its commands, its help, and how it fails.

Every user mistake gives exit code 2 and exactly one stderr line ``error: <what to fix>``, with no
traceback and nothing half-written on disk; ``--debug`` adds the traceback. Most tests drive the
Typer app in-process; two run the real console entry point in a subprocess.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import yaml
from typer.main import get_command
from typer.testing import CliRunner

from hfpipe import __version__
from hfpipe.cli.main import app
from hfpipe.tiny import make_tiny_checkpoint
from hfpipe.checkpoint.dcp import record_checksums
from _trust import error_lines

COMMANDS = ("finetune", "plan", "export", "verify", "quickstart", "generate", "chat", "recipes")
runner = CliRunner()


def run(*args) -> object:
    return runner.invoke(app, [str(a) for a in args])


def assert_user_error(result, message: str) -> None:
    """Exit 2, one line ``error: ...`` on stderr containing ``message``, no traceback."""
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr)
    lines = error_lines(result.stderr)  # a progress line may come first on a loaded machine
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert message in lines[0], lines[0]
    assert "Traceback" not in result.stdout + result.stderr


# --- fixtures: a good tiny model and broken copies of it -------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama")


def broken(tiny: Path, root: Path, how: str) -> Path:
    """A copy of ``tiny`` damaged in one way."""
    out = root / how
    shutil.copytree(tiny, out)
    shards = sorted(out.glob("*.safetensors"))
    config = json.loads((out / "config.json").read_text())
    if how == "missing-shard":
        shards[1].unlink()
    elif how == "truncated-shard":
        with open(shards[1], "r+b") as f:
            f.truncate(shards[1].stat().st_size // 2)
    elif how == "malformed-index":
        (out / "model.safetensors.index.json").write_text('{"metadata": {}}')
    elif how == "mismatched-config":
        (out / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    elif how == "gpt2":
        (out / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 4}))
    elif how == "remote-code":
        (out / "config.json").write_text(json.dumps(
            {**config, "model_type": "my_llama", "auto_map": {"AutoConfig": "my.Config"}}))
    return out


def write_meta(ckpt: Path, source: Path, *, checksums: bool = True) -> None:
    """The ``hfpipe.json`` the trainer writes beside its DCP files (and its checksums, as every save)."""
    meta = {"format": 1, "step": 3, "source": str(source), "source_dtype": "float32", "tied": False,
            "config": {}}
    (ckpt / "hfpipe.json").write_text(json.dumps(meta))
    if checksums:
        record_checksums(ckpt)


def fake_checkpoint(root: Path, source: Path, *, metadata: bool = True) -> Path:
    """A checkpoint folder that passes export's checks up to the output folder."""
    ckpt = root / "ckpt"
    ckpt.mkdir()
    if metadata:
        (ckpt / ".metadata").write_bytes(b"")
    write_meta(ckpt, source, checksums=False)  # export refuses before it reads them
    return ckpt


# --- commands and help -----------------------------------------------------------------------


def test_help_lists_every_command():
    result = run("--help")
    assert result.exit_code == 0
    for command in COMMANDS:
        assert command in result.stdout
    assert {c for c in get_command(app).commands} == set(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_argument_and_option_has_help(command):
    cmd = get_command(app).commands[command]
    assert cmd.help and cmd.help.strip()
    for param in cmd.params:
        assert (getattr(param, "help", None) or "").strip(), f"{command} {param.name} has no help"
    assert run(command, "--help").exit_code == 0


def test_version():
    result = run("--version")
    assert result.exit_code == 0 and result.stdout.strip() == f"hfpipe {__version__}"


def test_finetune_has_a_flag_for_every_config_field():
    from hfpipe.config.run import FinetuneConfig

    names = {p.name for p in get_command(app).commands["finetune"].params}
    assert {f.name for f in FinetuneConfig.__dataclass_fields__.values()} <= names


def test_plans_config_flags_are_finetunes_own():
    """Both commands take each shared flag from its FinetuneConfig field (hfpipe.cli.options): same names,
    type, default and help."""
    def flags(command):
        return {p.name: (p.opts, p.secondary_opts, p.type_descriptor.annotation, p.nargs, p.default, p.help)
                for p in get_command(app).commands[command].params if p.param_type_name == "option"}

    finetune, plan = flags("finetune"), flags("plan")
    shared = set(finetune) & set(plan) - {"recipe"}
    assert len(shared) == 25
    assert all(plan[name] == finetune[name] for name in shared), [n for n in shared if plan[n] != finetune[n]]


# --- plan -------------------------------------------------------------------------------------


def test_plan_prints_the_report(tiny):
    result = run("plan", tiny, "--pp", 2, "--seq-len", 64, "--dtype", "bf16")
    assert result.exit_code == 0, result.stderr
    for needle in ("embed, layer", "norm, head", "balance", "bubble", "optimizer", "total"):
        assert needle in result.stdout


def test_plan_a_bundled_model_from_its_id():
    result = run("plan", "meta-llama/Llama-3.2-1B", "--pp", 2, "--schedule", "zbv")
    assert result.exit_code == 0, result.stderr
    assert "meta-llama/Llama-3.2-1B: 1.24B parameters" in result.stdout


def test_plan_png(tiny, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "plan.png"
    result = run("plan", tiny, "--pp", 2, "--schedule", "interleaved-1f1b", "--png", png)
    assert result.exit_code == 0, result.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.png"]


def test_plan_png_without_matplotlib_says_what_to_install(tiny, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    png = tmp_path / "plan.png"
    result = run("plan", tiny, "--pp", 2, "--png", png)
    assert_user_error(result, "pip install 'hfpipe[plot]'")
    assert result.stdout == "" and not png.exists()


# --- the bad-input matrix ----------------------------------------------------------------------

# (id, command line with {tiny} / {<how>} / {ckpt} / {out} placeholders, message, setup)
CASES = [
    ("plan: pp above the layer count", "plan {tiny} --pp 9 --batch-size 9", "reduce --pp", None),
    ("plan: unknown architecture", "plan {gpt2} --pp 2", "'gpt2' is not supported: its model has no model.embed_tokens", None),
    ("plan: unknown schedule", "plan {tiny} --pp 2 --schedule zigzag", "--schedule must be one of", None),
    ("plan: too few microbatches for 1f1b", "plan {tiny} --pp 4 --microbatches 2",
     "needs at least as many microbatches as stages (4)", None),
    ("plan: batch not divisible", "plan {tiny} --pp 2 --batch-size 3",
     "--batch-size (3) must be a multiple of --microbatches (2, the default pp * vpp)", None),
    ("plan: layout of the wrong layer count", "plan {tiny} --pp 2 --layout Et|tL",
     "--layout has 2 't' layers but the model has 6", None),
    ("plan: remote code without --trust-remote-code", "plan {remote-code} --pp 2",
     "pass --trust-remote-code", None),
    ("plan: no model", "plan --pp 2", "give a model folder or hub id", None),
    ("plan: unknown recipe", "plan --recipe llama3_1_8b", "did you mean llama3_1_8b_sft_pp4", None),
    ("plan: bad --gpu-memory", "plan {tiny} --gpu-memory lots", "--gpu-memory 'lots' is not a size", None),
    ("plan: not a number", "plan {tiny} --pp two", "Invalid value for '--pp'", None),
    ("verify: missing shard", "verify {missing-shard}", "shard file is missing", None),
    ("verify: truncated shard", "verify {truncated-shard}", "truncated shard", None),
    ("verify: malformed index", "verify {malformed-index}", "malformed index", None),
    ("verify: config does not match the weights", "verify {mismatched-config}",
     "config.json does not match the weights", None),
    ("verify: no such folder", "verify {out}", "no such folder", None),
    ("verify: unknown schedule", "verify {tiny} --schedule zigzag", "--schedule 'zigzag' is unknown", None),
    ("export: existing output without --force", "export {ckpt} {out}", "exists; pass --force", "existing"),
    ("export: checkpoint incomplete", "export {ckpt} {out}", "incomplete: .metadata missing", "no-metadata"),
    ("export: bad --dtype", "export {ckpt} {out} --dtype int8", "'int8' is not one of", None),
    ("export: bad --max-shard-size", "export {ckpt} {out} --max-shard-size lots", "not a size like", None),
    ("export: unwritable output folder", "export {ckpt} {out}", "not writable", "read-only"),
    ("finetune: unknown recipe key", "finetune --recipe {recipe} --output-dir {out}",
     "unknown key 'lr_shedule' (did you mean lr_schedule", "recipe"),
    ("finetune: unknown schedule", "finetune {tiny} --schedule zigzag --output-dir {out}",
     "--schedule must be one of", None),
    ("finetune: batch not divisible", "finetune {tiny} --pp 2 --batch-size 3 --output-dir {out}",
     "--batch-size (3) must be a multiple of --microbatches", None),
    ("finetune: no model", "finetune --output-dir {out} --pp 2", "give a model folder or hub id", None),
    ("finetune: missing recipe file", "finetune --recipe {out}.yaml", "cannot read config", None),
    ("unknown command", "train {tiny}", "No such command 'train'", None),
]


@pytest.mark.parametrize("line, message, setup", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_user_errors_are_one_line_exit_2_and_leave_nothing_behind(tiny, tmp_path, line, message, setup):
    out = tmp_path / "work" / "out"
    out.parent.mkdir()
    ckpt = fake_checkpoint(tmp_path, tiny, metadata=setup != "no-metadata")
    if setup == "existing":
        out.mkdir()
        (out / "keep.txt").write_text("old")
    if setup == "read-only":
        out.parent.chmod(0o555)
        if os.access(out.parent, os.W_OK):  # root ignores permissions
            out.parent.chmod(0o755)
            pytest.skip("running as root: a read-only folder is still writable")
    if setup == "recipe":
        (tmp_path / "recipe.yaml").write_text(yaml.safe_dump({"model": str(tiny), "lr_shedule": "cosine"}))
    names = {how: broken(tiny, tmp_path, how) for how in
             ("missing-shard", "truncated-shard", "malformed-index", "mismatched-config", "gpt2",
              "remote-code") if "{" + how + "}" in line}
    args = line.split()
    subst = {"{tiny}": tiny, "{ckpt}": ckpt, "{out}": out, "{out}.yaml": f"{out}.yaml",
             "{recipe}": tmp_path / "recipe.yaml", **{"{" + k + "}": v for k, v in names.items()}}
    try:
        result = run(*[subst.get(a, a) for a in args])
    finally:
        out.parent.chmod(0o755)
    assert_user_error(result, message)
    if setup == "existing":
        assert [p.name for p in out.iterdir()] == ["keep.txt"]
    else:
        assert not out.exists()
    assert [p.name for p in out.parent.iterdir()] == (["out"] if setup == "existing" else [])


def test_debug_adds_the_traceback(tiny):
    result = run("--debug", "plan", tiny, "--pp", 9, "--batch-size", 9)
    assert result.exit_code == 2
    assert "Traceback" in result.stderr and "PlanError" in result.stderr
    assert result.stderr.splitlines()[-1].startswith("error: --pp 9")


def test_verify_exits_1_on_fail(tiny, monkeypatch):
    import hfpipe.verify

    failing = hfpipe.verify.VerifyResult(max_abs_diff=2e-3, kl=1e-6, tolerance=1e-5, tokens=56, pp=2,
                                         schedule="1f1b")
    monkeypatch.setattr(hfpipe.verify, "verify", lambda *a, **k: failing)
    result = run("verify", tiny)
    assert result.exit_code == 1 and result.stdout.startswith("FAIL: max |logits - transformers| = 2.000e-03")


# --- finetune wiring (the runner itself is tested with it) -----------------------------------


@pytest.fixture
def fake_runner(monkeypatch):
    """Replace hfpipe.train.runner with a recorder; ``calls`` holds (config, kwargs)."""
    module = types.ModuleType("hfpipe.train.runner")
    module.calls = []
    module.error = None

    def run_finetune(config, **kwargs):
        module.calls.append((config, kwargs))
        if module.error is not None:
            raise module.error
        return {"history": [{"step": 1, "loss": 2.5}], "checkpoint": "out/checkpoints/step-00000001"}

    module.run_finetune = run_finetune
    monkeypatch.setitem(sys.modules, "hfpipe.train.runner", module)
    return module


def test_finetune_flags_override_the_recipe(fake_runner, tmp_path, tiny):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"model": str(tiny), "pp": 2, "lr": 1e-4, "batch_size": 4,
                                      "packing": True, "output_dir": str(tmp_path / "a")}))
    result = run("finetune", "--recipe", recipe, "--lr", 3e-5, "--no-packing", "--betas", 0.8, 0.9,
                 "--nnodes", 2, "--node-rank", 1, "--rdzv-endpoint", "host:29500")
    assert result.exit_code == 0, result.stderr
    ((config, kwargs),) = fake_runner.calls
    assert (config.model, config.pp, config.batch_size) == (str(tiny), 2, 4)  # from the recipe
    assert (config.lr, config.packing, config.betas) == (3e-5, False, (0.8, 0.9))  # from the flags
    assert config.schedule == "1f1b" and config.seed == 0  # FinetuneConfig's defaults
    assert kwargs == {"nnodes": 2, "node_rank": 1, "rdzv_endpoint": "host:29500"}
    assert result.stdout.strip() == "finished: step 1, loss 2.5000, checkpoint out/checkpoints/step-00000001"


def test_finetune_model_argument_without_a_recipe(fake_runner, tiny):
    result = run("finetune", tiny, "--pp", 2, "--microbatches", 2, "--max-steps", 5)
    assert result.exit_code == 0, result.stderr
    ((config, _),) = fake_runner.calls
    assert (config.model, config.pp, config.microbatches, config.max_steps) == (str(tiny), 2, 2, 5)


def test_finetune_runner_errors(fake_runner, tiny):
    from hfpipe.data.config import DataError

    fake_runner.error = DataError("dataset 'x' has no column 'text'; pass --format")
    assert_user_error(run("finetune", tiny), "has no column 'text'")
    fake_runner.error = RuntimeError("boom")
    result = run("finetune", tiny)
    assert result.exit_code == 1
    assert result.stderr.strip() == "error: unexpected RuntimeError: boom (run with --debug for the traceback)"


def test_the_runner_takes_what_the_cli_passes():
    import inspect

    from hfpipe.train.runner import run_finetune

    params = inspect.signature(run_finetune).parameters
    assert list(params)[0] == "cfg" and {"nnodes", "node_rank", "rdzv_endpoint"} <= set(params)


@pytest.mark.slow
def test_finetune_trains_a_tiny_model(tiny, tmp_path):
    """The real runner: two gloo processes, one optimizer step, one checkpoint (~20 s)."""
    out = tmp_path / "out"
    result = run("finetune", tiny, "--pp", 2, "--max-steps", 1, "--seq-len", 32, "--batch-size", 2,
                 "--output-dir", out)
    assert result.exit_code == 0, result.stderr
    assert result.stdout.startswith("finished: step 1, loss ")
    assert (out / "checkpoints" / "step-00000001" / "hfpipe.json").is_file()


# --- export --------------------------------------------------------------------------------------


def test_export_writes_a_loadable_folder(tiny, tmp_path):
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny)
    ckpt = tmp_path / "ckpt"
    dcp.save({"model." + k: v for k, v in model.state_dict().items()}, checkpoint_id=ckpt, no_dist=True)
    write_meta(ckpt, tiny)
    result = run("export", ckpt, tmp_path / "hf", "--dtype", "bf16", "--no-progress")
    assert result.exit_code == 0, result.stderr
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert exported.dtype == torch.bfloat16
    torch.testing.assert_close(exported.lm_head.weight, model.lm_head.weight.bfloat16(), rtol=0, atol=0)


# --- the installed entry point ----------------------------------------------------------------


def entry(*args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hfpipe.cli.main", *map(str, args)],
                          capture_output=True, text=True, timeout=120, **kwargs)


def test_entry_point_help_in_a_subprocess():
    proc = entry("--help")
    assert proc.returncode == 0, proc.stderr
    for command in COMMANDS:
        assert command in proc.stdout
    if shutil.which("hfpipe"):
        console = subprocess.run(["hfpipe", "--version"], capture_output=True, text=True, timeout=60)
        assert console.returncode == 0 and console.stdout.strip() == f"hfpipe {__version__}"


def test_entry_point_user_error_in_a_subprocess(tmp_path):
    proc = entry("finetune", "--recipe", tmp_path / "missing.yaml")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [f"error: cannot read config {tmp_path / 'missing.yaml'}: "
                                        "No such file or directory"]


def test_entry_point_plan_prints_everything_before_its_fast_exit():
    proc = entry("plan", "meta-llama/Llama-3.2-1B", "--pp", 2)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("meta-llama/Llama-3.2-1B: 1.24B parameters")
    *_, per_parameter, total = proc.stdout.rstrip().splitlines()
    assert per_parameter.startswith("per parameter: weights 4 B")  # fp32
    assert total.startswith("total: gradients and activations as they coexist")


@pytest.mark.parametrize("args", [["export", "nope", "x"], ["verify", "./nope"], ["finetune", "./nope"],
                                  ["finetune", ".", "--dataset", "data/chat.jsonl"],
                                  ["generate", "./nope", "--prompt", "x"], ["chat", "out/checkpoints/step-9"]])
def test_a_wrong_path_is_named_before_torch_loads(tmp_path, args):
    # Importing torch and transformers takes seconds on a busy machine; a typo should not wait for it.
    probe = ("import sys; from hfpipe.cli.main import app; code = app(sys.argv[1:], standalone_mode=False); "
             "print(code, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe, *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.split() == ["2", "False"], (done.stdout, done.stderr)
    assert "no such folder" in done.stderr or "not found" in done.stderr or "does not exist" in done.stderr
