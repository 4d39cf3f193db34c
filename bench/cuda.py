"""Benchmark: hfpipe on one CUDA device against plain transformers, same model, same tokens, one run.

Each case trains a random model of real shapes for a few steps in a process of its own (so one case's memory
never weighs on the next) and prints tokens/s, MFU, peak device memory and the losses; ratios are taken against
the first case of the same shape, measured in the same run on the same device:

============================  ===========================================================================
 case                          what runs
============================  ===========================================================================
 ``plain``                      ``AutoModelForCausalLM`` (fp32 master weights, bf16 autocast), fused AdamW,
                                the loss transformers computes from the full logits
 ``plain-compile``              the same, ``torch.compile`` on each decoder layer
 ``hfpipe``                     ``load_pipeline(pp=1, dtype="bf16-mixed")`` + ``trainer.step`` (the chunked head loss)
 ``hfpipe-full-logits``         the same with ``loss_chunk_tokens=0``: the head loss against full logits
 ``hfpipe-compile``             ``compile=True``
 ``hfpipe-fp8``                 ``fp8="rowwise"`` (torchao float8 training)
 ``hfpipe-compile-fp8``         both
 ``hfpipe-compile-fp8-tensorwise``  the same with ``fp8="tensorwise"`` (one scale per tensor)
 ``trainer`` / ``pipeline-trainer``  transformers' ``Trainer(bf16=True)`` and ``PipelineTrainer(pp=1)``, same data
 ``lora-plain``                 PEFT ``get_peft_model`` r16 all-linear on a bf16 base (``--lora-shape``), autocast
 ``lora-hfpipe`` (``-compile``)  ``load_pipeline(dtype="bf16", lora=LoraConfig(...))`` (and ``compile=True``)
 ``lora-hfpipe-compile-fp8``    and ``fp8="rowwise"``: the frozen base multiplies in float8
 ``lora-hfpipe-ac``             ``activation_checkpointing="full"`` (the plan's other LoRA row)
 ``lora-hfpipe-mixed`` (``-compile-fp8``)  ``dtype="bf16-mixed"``: the base in bf16, the fp32 adapters computed in
                                bf16 (as PEFT under autocast computes them)
 ``lora-hfpipe-fp8base``        ``quantize_base="fp8"``: the base as 128 x 128 FP8 tiles, dequantized per matmul
 ``lora-hfpipe-fp8base-blockwise`` (``-compile``)  ``fp8="blockwise"`` too: the base multiplies its codes in
                                float8 (torch's one-GEMM blockwise kernel on SM90, else tile by tile)
============================  ===========================================================================

Beside each ``hfpipe`` case: what ``hfpipe plan`` promises for it (``plan_report``'s rank 0 total) and the plan's
ratio to the peak measured (``torch.cuda.max_memory_allocated``): the plan must never be under it. The plan
prices eager layers (compiled ones hold less, so it stays over).

MFU = tokens/s x FLOPs per token / peak, with FLOPs per token = 6 N + 12 L h s for full fine-tuning and
4 N + 12 L h s for LoRA (no weight gradients of the frozen base), N the parameters other than the input
embedding, L layers, h hidden size, s sequence length (torchtitan's count); peak ``--peak-tflops`` (989: the
dense bf16 peak of an H100/H200 SXM).

Run (on a GPU):  python bench/cuda.py [--cases plain,hfpipe,...] [--shape llama3-8b-slice] [--seq 4096] [--batch 2]
Each case's result is one JSON line in ``--results`` as soon as it ends (a run cut short keeps what it had).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {  # Llama-3-8B's dims; the slice keeps 8 of its 32 layers
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                      max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False),
    "tiny": dict(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
}
SHAPES["llama3-8b-slice"] = {**SHAPES["llama3-8b"], "num_hidden_layers": 8}
CASES = ("plain", "plain-compile", "hfpipe", "hfpipe-full-logits", "hfpipe-compile", "hfpipe-fp8",
         "hfpipe-compile-fp8", "trainer", "pipeline-trainer", "lora-plain", "lora-hfpipe", "lora-hfpipe-compile",
         "hfpipe-compile-fp8-tensorwise", "lora-hfpipe-compile-fp8", "lora-hfpipe-ac", "lora-hfpipe-mixed",
         "lora-hfpipe-mixed-compile-fp8", "hfpipe-fsdp2", "hfpipe-compile-fsdp2", "lora-hfpipe-fp8base",
         "lora-hfpipe-fp8base-blockwise", "lora-hfpipe-fp8base-blockwise-compile")
PROFILE: dict = {}  # {"to": path} when --profile-dir is given
HFPIPE = {"hfpipe": {}, "hfpipe-full-logits": {"loss_chunk_tokens": 0}, "hfpipe-compile": {"compile": True},
          "hfpipe-fp8": {"fp8": "rowwise"}, "hfpipe-compile-fp8": {"compile": True, "fp8": "rowwise"},
          "hfpipe-compile-fp8-tensorwise": {"compile": True, "fp8": "tensorwise"},
          "lora-hfpipe": {}, "lora-hfpipe-compile": {"compile": True},
          "lora-hfpipe-compile-fp8": {"compile": True, "fp8": "rowwise"},
          "lora-hfpipe-ac": {"activation_checkpointing": "full"},
          "lora-hfpipe-mixed": {"dtype": "bf16-mixed"},
          "lora-hfpipe-mixed-compile-fp8": {"dtype": "bf16-mixed", "compile": True, "fp8": "rowwise"},
          # bf16-mixed at one replica through FSDP2's one-rank path, as before hfpipe.parallel.one_replica
          "hfpipe-fsdp2": {"fsdp2": True}, "hfpipe-compile-fsdp2": {"compile": True, "fsdp2": True},
          "lora-hfpipe-fp8base": {"quantize_base": "fp8"},
          "lora-hfpipe-fp8base-blockwise": {"quantize_base": "fp8", "fp8": "blockwise"},
          "lora-hfpipe-fp8base-blockwise-compile": {"quantize_base": "fp8", "fp8": "blockwise", "compile": True}}


def _device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _batches(vocab: int, a) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (a.batch, a.seq), generator=g) for _ in range(a.warmup + a.steps)]


def _lora_config():
    from peft import LoraConfig

    return LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0)


def _timed(step, batches, warmup: int) -> dict:
    """Run ``step(ids) -> loss`` over ``batches``; the first ``warmup`` steps (kernels, compilation) untimed."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    walls, losses = [], []
    for i, ids in enumerate(batches):
        _sync()
        t0 = time.perf_counter()
        losses.append(step(ids))
        _sync()
        if i >= warmup:
            walls.append(time.perf_counter() - t0)
    losses = [float(x) for x in losses]
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    if PROFILE.get("to"):  # one more step under the profiler: where the time goes, by op
        with torch.profiler.profile() as prof:
            step(batches[-1])
            _sync()
        by = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        Path(PROFILE["to"]).write_text(prof.key_averages().table(sort_by=by, row_limit=40))
    return {"wall": statistics.median(walls), "loss": losses, "peak": peak}


def _plain(path: str, a, compile_layers: bool, lora: bool) -> dict:
    from transformers import AutoModelForCausalLM

    dev = _device()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16 if lora else torch.float32).to(dev)
    if lora:
        from peft import get_peft_model

        model = get_peft_model(model, _lora_config())
    if compile_layers:
        for layer in model.get_decoder().layers:
            layer.compile()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8,
                            **({"fused": True} if dev.type == "cuda" else {}))

    def step(ids):
        ids = ids.to(dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return _timed(step, _batches(model.config.vocab_size, a), a.warmup)


def _hfpipe(path: str, a, options: dict, lora: bool) -> dict:
    from hfpipe.api import load_pipeline
    from hfpipe.train.optim import build_optimizer

    extra = {"dtype": "bf16", "lora": _lora_config()} if lora else {"dtype": "bf16-mixed"}
    options = dict(options)
    if options.pop("fsdp2", False):  # each case runs in a child process of its own: the switch is the case's
        import hfpipe.parallel.fsdp as fsdp

        fsdp._FSDP2_AT_ONE_REPLICA = True
    pm = load_pipeline(path, pp=1, schedule="1f1b", microbatches=1, **{**extra, **options})
    trainer = pm.trainer(build_optimizer(pm.modules, lr=1e-4, weight_decay=0.0), max_grad_norm=1.0)

    def step(ids):
        return trainer.step({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}).loss

    return _timed(step, _batches(pm.source.config.vocab_size, a), a.warmup)


def _trainer(path: str, a, pipelined: bool) -> dict:
    """transformers' Trainer or hfpipe's PipelineTrainer on the same random rows; steps timed by a callback."""
    from transformers import TrainerCallback, TrainingArguments, default_data_collator

    if pipelined:
        importlib.import_module("hfpipe.hf")  # first, as a user's script has it (it quiets the process start)
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    data = [{"input_ids": row, "labels": row} for row in torch.cat(_batches(vocab, a))]  # a map-style dataset
    steps = a.warmup + a.steps
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=steps, per_device_train_batch_size=a.batch,
                             bf16=True, optim="adamw_torch_fused", learning_rate=1e-4, max_grad_norm=1.0,
                             weight_decay=0.0, adam_beta2=0.95, logging_steps=steps, save_strategy="no",
                             report_to=[], disable_tqdm=True, dataloader_num_workers=0, seed=0,
                             use_cpu=not torch.cuda.is_available())  # bf16 on CPU needs use_cpu
    walls: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *_, **__):
            _sync()
            self.t0 = time.perf_counter()

        def on_step_end(self, _args, state, *_, **__):
            _sync()
            if state.global_step > a.warmup:
                walls.append(time.perf_counter() - self.t0)

    common = {"args": args, "train_dataset": data, "data_collator": default_data_collator, "callbacks": [Clock()]}
    if pipelined:
        from hfpipe.hf import PipelineTrainer

        trainer = PipelineTrainer(path, pp=1, **common)
    else:
        from transformers import AutoModelForCausalLM, Trainer

        trainer = Trainer(model=AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), **common)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    return {"wall": statistics.median(walls), "loss": losses, "peak": peak}


def run_case(case: str, path: str, a) -> dict:
    lora = case.startswith("lora-")
    if case in ("plain", "plain-compile", "lora-plain"):
        return _plain(path, a, compile_layers=case == "plain-compile", lora=lora)
    if case in ("trainer", "pipeline-trainer"):
        return _trainer(path, a, pipelined=case == "pipeline-trainer")
    return _hfpipe(path, a, HFPIPE[case], lora=lora)


def flops_per_token(shape: dict, seq: int, lora: bool) -> float:
    h, L, i, v = shape["hidden_size"], shape["num_hidden_layers"], shape["intermediate_size"], shape["vocab_size"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    n = L * (2 * h * h + 2 * h * kv + 3 * h * i + 2 * h) + h + v * h  # layers, final norm, head
    return (4 if lora else 6) * n + 12 * L * h * seq


def _build(folder: Path, shape: dict) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    if (folder / "config.json").exists():
        return
    torch.manual_seed(0)
    with torch.device(_device()):  # random init on the device: seconds for 8B, where the CPU takes minutes
        model = AutoModelForCausalLM.from_config(LlamaConfig(**shape), dtype=torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="5GB")
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def planned_bytes(folder: Path, case: str, a) -> int | None:
    """What ``hfpipe plan`` promises rank 0 of an ``hfpipe`` case (``None`` for the others)."""
    if case not in HFPIPE:
        return None
    from hfpipe.plan.report import plan_report
    from hfpipe.source.config import load_config

    lora = case.startswith("lora-")
    options = HFPIPE[case]
    return plan_report(load_config(folder), pp=1, schedule="1f1b", microbatches=1, seq_len=a.seq,
                       batch_size=a.batch, dtype=options.get("dtype", "bf16" if lora else "bf16-mixed"),
                       activation_checkpointing=options.get("activation_checkpointing", "none"),
                       lora_rank=16 if lora else None, lora_targets="all-linear",
                       quantize_base=options.get("quantize_base"), fp8=options.get("fp8")).ranks[0].total_bytes


def _report(rows: list[dict], a) -> None:
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    print(f"\n{name}, torch {torch.__version__}, seq {a.seq} x batch {a.batch}, {a.steps} timed steps after "
          f"{a.warmup}; MFU of {a.peak_tflops:.0f} TFLOP/s")
    print(f"{'case':30} {'shape':16} {'tok/s':>9} {'ratio':>6} {'MFU':>6} {'peak GiB':>9} {'plan GiB':>9} "
          f"{'plan/peak':>9}  losses (first, last)")
    base: dict[str, float] = {}
    for r in rows:
        if "error" in r:
            print(f"{r['case']:30} {r['shape']:16} failed: {r['error']}")
            continue
        key = r["shape"] + ("-lora" if r["case"].startswith("lora") else "")
        ref = base.setdefault(key, r["tok_s"])
        plan = (f"{r['plan'] / 2**30:9.1f} {r['plan'] / r['peak']:9.3f}" if r.get("plan") and r["peak"]
                else f"{'':9} {'':9}")
        print(f"{r['case']:30} {r['shape']:16} {r['tok_s']:9.0f} {r['tok_s'] / ref:6.3f} {r['mfu']:6.1%} "
              f"{r['peak'] / 2**30:9.1f} {plan}  {r['loss'][0]:.4f}, {r['loss'][-1]:.4f}")


def _run_child(case: str, folder: Path, a, timeout: float) -> dict:
    """One case in a process of its own; its result row (``error`` where it failed)."""
    profile = a.profile_dir and (a.profile_cases is None or case in a.profile_cases.split(","))
    cmd = [sys.executable, __file__, "--run-case", case, "--model", str(folder)] + [
        f"--{k}={getattr(a, k)}" for k in ("seq", "batch", "steps", "warmup")] + (
        [f"--profile-dir={a.profile_dir}"] if profile else [])
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"ran past {timeout:.0f} s"}
    found = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if not found:
        sys.stderr.write(done.stderr[-4000:])
        return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1][-300:]}
    row = json.loads(found[-1][7:])
    row["tok_s"] = a.batch * a.seq / row["wall"]
    flops = flops_per_token(SHAPES[_shape_name(case, a)], a.seq, case.startswith("lora-"))
    row["mfu"] = row["tok_s"] * flops / (a.peak_tflops * 1e12)
    return row


def _shape_name(case: str, a) -> str:
    """The model shape a case trains: ``--lora-shape`` for the LoRA cases, else ``--shape``."""
    return a.lora_shape if case.startswith("lora-") else a.shape


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(CASES[:9]))
    p.add_argument("--shape", default="llama3-8b-slice", choices=sorted(SHAPES))
    p.add_argument("--lora-shape", default="llama3-8b", choices=sorted(SHAPES))
    for name, default in (("seq", 4096), ("batch", 2), ("steps", 4), ("warmup", 2)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "hfpipe-bench-cuda"))
    p.add_argument("--results", default="cuda_results.jsonl")
    p.add_argument("--case-timeout", type=float, default=300.0)
    p.add_argument("--budget", type=float, default=float("inf"),
                   help="seconds for the whole run: a case gets what is left, and none starts with under 30 s")
    p.add_argument("--profile-dir", help="write each case's profile (one extra step, by op) to DIR/CASE.txt")
    p.add_argument("--profile-cases", help="profile only these cases (comma-separated; default: all)")
    p.add_argument("--run-case", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.run_case:  # a child: one case, its result as the last line of stdout
        if a.profile_dir:
            PROFILE["to"] = os.path.join(a.profile_dir, f"{a.run_case}.txt")
        print("RESULT " + json.dumps(run_case(a.run_case, a.model, a)), flush=True)
        return
    if a.profile_dir:
        os.makedirs(a.profile_dir, exist_ok=True)
    start, rows = time.monotonic(), []
    for case in a.cases.split(","):
        shape = _shape_name(case, a)
        left = a.budget - (time.monotonic() - start)
        row = {"case": case, "shape": shape}
        if left < 30:
            row["error"] = "not run: the --budget is spent"
        else:
            folder = Path(a.work) / shape
            _build(folder, SHAPES[shape])
            row.update(_run_child(case, folder, a, min(a.case_timeout, left)))
            if "error" not in row:
                row["plan"] = planned_bytes(folder, case, a)
        rows.append(row)
        with open(a.results, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps({k: v for k, v in row.items() if k != "loss"}), flush=True)
    _report(rows, a)


if __name__ == "__main__":
    main()
