"""Benchmark: ``hfpipe plan``'s memory per rank against what the run really holds, mode by mode.

Random weights of real shapes (``--model-shape``: Llama-3-8B's, or a small Llama of its proportions),
``--layers`` of them, one optimizer step of ``--batch`` x ``--seq`` tokens, pp 1:

- **on CUDA**: the plan's peak per rank beside ``torch.cuda.max_memory_allocated`` of the run's second
  step (the first builds the optimizer state), and the plan's activations beside the bytes autograd
  saves (counted as on CPU);
- **on CPU**: the bytes the run holds, counted: parameters and buffers, gradients (at the optimizer
  step), AdamW state, and the peak of the activations autograd saves for backward, counted with
  ``torch.autograd.graph.saved_tensors_hooks`` over unique storages (a view saved twice counts
  once; a parameter or a view of one is a weight, not an activation).

Printed per mode: plan / run for the total and for activations (``--detail``: the largest saved
tensors, by module). ``tests/plan/test_plan_memory_measured.py`` asserts the CPU ratios in CI.

``--tp``, ``--cp`` and ``--ep`` launch that many ranks (as ``finetune`` launches them) and compare rank 0.

Run (GPU, what the lead runs):
  python bench/plan_memory.py --model-shape llama3-8b --layers 8 --seq 4096 --batch 2 \\
      --mode full,lora --ac none,full
CPU:
  python bench/plan_memory.py --model-shape llama3-small --layers 4 --seq 512 --batch 2 --mode full,lora
  python bench/plan_memory.py --mode full,lora --cp 2 --detail 30
  python bench/plan_memory.py --model-shape qwen3-moe-small --mode full,lora --ep 2
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import shutil
import sys
import tempfile
import weakref
from collections import Counter
from pathlib import Path

import torch
import torch.utils.checkpoint as ckpt

from hfpipe.plan.transient import LiveBytes

#: Shapes of real models, as transformers' LlamaConfig fields (``num_hidden_layers`` from ``--layers``).
SHAPES = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                      vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192),
    # Llama-3's ratios (heads 4:1 over kv heads, head_dim 32 at this width, MLP 3.5 h) at hidden 256
    "llama3-small": dict(hidden_size=256, intermediate_size=896, num_attention_heads=8, num_key_value_heads=2,
                         vocab_size=8192, rope_theta=500000.0, max_position_embeddings=4096),
    # Qwen3-30B-A3B's ratios (128 experts of 0.375 h, 8 a token, head_dim 128 at 32 heads over 4) at hidden 256
    "qwen3-moe-small": dict(model_type="qwen3_moe", hidden_size=256, intermediate_size=768,
                            moe_intermediate_size=96, num_experts=16, num_experts_per_tok=4, num_attention_heads=8,
                            num_key_value_heads=2, head_dim=32, vocab_size=8192, max_position_embeddings=4096),
}
#: qlora: LoRA on an nf4-quantized base; fp8lora: on an FP8 base (dequantized per matmul); fp8tiles: on an FP8 base
#: multiplied in float8 tile by tile (--fp8-recipe blockwise)
MODES = ("full", "lora", "qlora", "fp8lora", "fp8tiles")
_BASE = {"qlora": "nf4", "fp8lora": "fp8", "fp8tiles": "fp8"}


@dataclasses.dataclass(frozen=True)
class Case:
    """One run to price and measure."""

    mode: str = "full"
    ac: str = "none"
    dtype: str = "bf16"
    seq: int = 512
    batch: int = 2
    tp: int = 1
    cp: int = 1
    ep: int = 1
    lora_rank: int = 16
    block: int | None = None  # --quantize-block-size of the quantized modes (None: the default)

    def __str__(self) -> str:
        mesh = "".join(f"-{k}{getattr(self, k)}" for k in ("tp", "cp", "ep") if getattr(self, k) > 1)
        return f"{self.mode}-ac_{self.ac}-{self.dtype}{mesh}"

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.ep

    def options(self) -> dict:
        """``load_pipeline`` keywords of this case."""
        from hfpipe.lora.adapters import lora_config

        lora = lora_config(self.lora_rank, targets="all-linear") if self.mode != "full" else None
        return dict(pp=1, dp=self.ep, ep=self.ep, tp=self.tp, cp=self.cp, schedule="1f1b", microbatches=1,
                    dtype=self.dtype, activation_checkpointing=self.ac, lora=lora, **self._base())

    def plan_options(self) -> dict:
        """``plan_report`` keywords of this case."""
        return dict(pp=1, dp=self.ep, ep=self.ep, tp=self.tp, cp=self.cp, schedule="1f1b", microbatches=1,
                    seq_len=self.seq, batch_size=self.batch, dtype=self.dtype, activation_checkpointing=self.ac,
                    lora_rank=self.lora_rank if self.mode != "full" else None, lora_targets="all-linear",
                    **self._base())

    def _base(self) -> dict:
        """The frozen base's keywords, the same for the run and its plan."""
        return dict(quantize_base=_BASE.get(self.mode), fp8="blockwise" if self.mode == "fp8tiles" else None,
                    quantize_block_size=self.block)


@dataclasses.dataclass
class Held:
    """Bytes one rank holds, counted."""

    weights: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0  # the peak of what autograd saves for backward
    together: int = 0  # the peak of those and the gradients at once
    live: int = 0  # the peak of every storage the step makes (activations, gradients, working sets)
    peak: int = 0  # torch.cuda.max_memory_allocated on CUDA (0 on CPU)
    top: list = dataclasses.field(default_factory=list)  # (bytes, shape, dtype, module) at the peak

    @property
    def total(self) -> int:
        return self.weights + self.optimizer + max(self.together, self.grads, self.live)


class SavedTensors:
    """The bytes autograd keeps for backward, over unique storages, and their peak.

    A saved tensor is packed into a holder; autograd drops the holder when the node that saved it
    has run its backward (or is freed), so the storages alive are exactly those some holder keeps.
    Parameters (and views of them: ``weight.t()``) are excluded: they are weights.
    """

    def __init__(self, modules, live=None):
        self.live = live  # a hfpipe.plan.transient.LiveBytes running beside
        self.own = _storage_bytes([*(t for m in modules for t in [*m.parameters(), *m.buffers()])])
        self.refs: Counter = Counter()  # storage address -> live holders
        self.info: dict[int, tuple] = {}  # storage address -> (bytes, shape, dtype, module)
        self.now = self.peak = 0
        self.at_peak: list = []
        # gradients, which appear during backward as activations go: their peak together is the run's
        self.params = {id(p): p for m in modules for p in m.parameters() if p.requires_grad}
        self.together = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad) for p in self.params.values()]
        self.module = ["?"]
        self._hooks += [m.register_forward_pre_hook(self._enter) for m in _named(modules)]
        self._hooks += [m.register_forward_hook(self._leave) for m in _named(modules)]

    def _enter(self, module, args):
        self.module.append(module._plan_memory_name)
        # under FSDP2 (bf16-mixed) a module's parameters are now the gathered compute copies: weights too
        gathered = _storage_bytes(module.parameters(recurse=False))
        self.own.update(gathered)
        if self.live is not None:  # counted as weights, not among what the step makes
            self.live.forget(gathered)
        for p in module.parameters(recurse=False):
            if p.requires_grad and id(p) not in self.params:
                self.params[id(p)] = p
                self._hooks.append(p.register_post_accumulate_grad_hook(self._grad))

    def _grad(self, param) -> None:
        self._together()

    def _together(self) -> None:
        grads = _storages(p.grad for p in self.params.values() if p.grad is not None)
        self.together = max(self.together, self.now + grads)

    def _leave(self, module, args, out):
        self.module.pop()

    def pack(self, t: torch.Tensor):
        parts = _storage_bytes([t])  # a quantized weight (NF4Tensor) is a wrapper of several storages
        if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
            return t if parts.keys() <= self.own.keys() else _Holder(self, t, parts)
        if not parts or next(iter(parts)) in self.own:
            return t
        return _Holder(self, t, parts)

    @staticmethod
    def unpack(held):
        return held.tensor if isinstance(held, _Holder) else held

    def add(self, t, parts: dict[int, int]) -> None:
        for ptr, nbytes in parts.items():
            if not self.refs[ptr]:
                self.now += nbytes
                self.info[ptr] = (nbytes, tuple(t.shape), str(t.dtype).replace("torch.", ""), self.module[-1])
            self.refs[ptr] += 1
        self._together()
        if self.now > self.peak:
            self.peak = self.now
            self.at_peak = sorted(self.info.values(), key=lambda x: -x[0])

    def drop(self, parts: dict[int, int]) -> None:
        for ptr, nbytes in parts.items():
            self.refs[ptr] -= 1
            if not self.refs[ptr]:
                del self.refs[ptr], self.info[ptr]
                self.now -= nbytes

    def recomputed(self, x: torch.Tensor) -> torch.Tensor:
        """A tensor activation checkpointing recomputes in backward: held until its node has run."""
        x = x.detach() if x.requires_grad else x
        parts = {ptr: n for ptr, n in _storage_bytes([x]).items() if ptr not in self.own}
        if parts:
            self.add(x, parts)
            weakref.finalize(x, self.drop, parts)
        return x

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._ctx.__enter__()
        self._patch = _count_recomputation(self)
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        ckpt._recomputation_hook = self._patch
        for h in self._hooks:
            h.remove()


def _count_recomputation(counter: SavedTensors):
    """Make torch's checkpoint recomputation report what it holds; returns the original hook class.

    Non-reentrant checkpointing recomputes a layer under its own saved-tensor hooks, innermost, which
    keep the recomputed tensors in the checkpoint frame until backward unpacks them: the outer hooks
    never see them, yet they are the peak of a checkpointed run. torch has no public hook for this,
    so the bench wraps the private class's pack hook (and fails loudly if torch renames it).
    """
    original = ckpt._recomputation_hook

    class Counting(original):
        def __init__(self, *args):
            super().__init__(*args)
            pack = self.pack_hook
            self.pack_hook = lambda x: pack(counter.recomputed(x))

    ckpt._recomputation_hook = Counting
    return original


class _Holder:
    """What autograd keeps in place of a saved tensor: the tensor, and a count the counter drops
    when autograd lets go of it."""

    __slots__ = ("counter", "tensor", "parts")

    def __init__(self, counter: SavedTensors, t: torch.Tensor, parts: dict[int, int]):
        self.counter, self.tensor, self.parts = counter, t, parts
        counter.add(t, parts)

    def __del__(self):
        self.counter.drop(self.parts)


def _named(modules):
    """Every submodule, tagged with its name for the saved tensors' report."""
    for m in modules:
        for name, sub in m.named_modules():
            sub._plan_memory_name = name or type(sub).__name__
            yield sub


def _storages(tensors) -> int:
    """Bytes of the unique storages under ``tensors`` (a DTensor's local shard; a quantized tensor's parts)."""
    return sum(_storage_bytes(tensors).values())


def _storage_bytes(tensors) -> dict[int, int]:
    """Storage address -> bytes, of the unique storages under ``tensors``."""
    seen: dict[int, int] = {}
    for t in tensors:
        for part in _parts(t):
            storage = part.untyped_storage()
            if part.device.type != "meta" and storage.nbytes():
                seen[storage.data_ptr()] = storage.nbytes()
    return seen


def _parts(t: torch.Tensor):
    if hasattr(t, "to_local"):
        t = t.to_local()
    if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        names, _ = t.__tensor_flatten__()
        for n in names:
            yield from _parts(getattr(t, n))
        return
    if isinstance(t, torch.nn.Parameter) and type(t.data) is not torch.Tensor:
        yield from _parts(t.data)
        return
    yield t


def measure(path: str, case: Case, steps: int = 2, top: int = 12) -> Held:
    """One rank's bytes in the last of ``steps`` optimizer steps of ``case`` (on CUDA the second step is the
    one measured: the first makes the AdamW state), with the ``top`` largest saved tensors at the peak."""
    from hfpipe.api import load_pipeline
    from hfpipe.train.optim import build_optimizer

    cuda = torch.cuda.is_available()
    if cuda:  # what an earlier case left is not this run's
        gc.collect()
        torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated() if cuda else 0
    pm = load_pipeline(path, **case.options())
    opt = build_optimizer(pm.modules, lr=1e-4)
    trainer = pm.trainer(opt, max_grad_norm=1.0)
    held = Held()

    def at_step(optimizer, args, kwargs):  # the gradients, whole, just before the optimizer uses them
        held.grads = _storages(p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None)

    opt.register_step_pre_hook(at_step)
    g = torch.Generator().manual_seed(0)
    vocab = pm.source.config.vocab_size
    for i in range(steps):
        ids = torch.randint(3, vocab, (case.batch, case.seq), generator=g)
        if cuda and i == steps - 1:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        # every storage the step makes, until it is freed: the saved tensors and what lives only inside a
        # backward or a loss chunk, which saved-tensor hooks cannot see (what cuda's max_memory_allocated sees)
        live = LiveBytes(_storage_bytes([*(t for m in pm.modules for t in [*m.parameters(), *m.buffers()]),
                                         *(p.grad for m in pm.modules for p in m.parameters() if p.grad is not None),
                                         *(t for s in opt.state.values() for t in s.values()
                                           if isinstance(t, torch.Tensor))]))
        with SavedTensors(pm.modules, live) as saved, live:
            trainer.step({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    held.peak = torch.cuda.max_memory_allocated() - base if cuda else 0
    # the parameters and buffers, and (FSDP2) the compute copies gathered for the forward: saved.own
    held.weights = sum(saved.own.values())
    held.optimizer = _storages(t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)
                               and t.dim() > 0)
    held.activations, held.together, held.top = saved.peak, saved.together, saved.at_peak[:top]
    held.live = live.peak
    return held


def planned(config, case: Case):
    """The plan's rank 0 for ``case``: (total, weights + grads + optimizer, activations saved for backward, what
    lives only inside a backward or a loss chunk) bytes."""
    from hfpipe.plan.report import plan_report

    r = plan_report(config, **case.plan_options()).ranks[0]
    return (r.total_bytes, r.weight_bytes + r.grad_bytes + r.optimizer_bytes + r.transient_bytes,
            r.activation_bytes - r.backward_bytes, r.backward_bytes)


def make_model(out: Path, shape: str, layers: int) -> Path:
    """A random model of ``shape`` with ``layers`` layers, saved in bf16 (initialised on the GPU if any)."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    fields = dict(SHAPES[shape])
    cfg = CONFIG_MAPPING[fields.pop("model_type", "llama")](**fields, num_hidden_layers=layers,
                                                             tie_word_embeddings=False)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out, max_shard_size="2GB")
    del model
    return out


def compare(path: str, case: Case, steps: int = 2, top: int = 12) -> dict:
    """Plan against run for ``case`` on the model at ``path`` (launched over ``case.world`` ranks)."""
    from hfpipe.parallel.launch import launch

    # one rank runs here (a process group of one); more are launched as finetune launches them
    if case.world == 1:
        mine = measure(path, case, steps, top)
    else:  # the launched ranks import this file by name, as the caller did
        here = str(Path(__file__).resolve().parent)
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
        mine = launch(measure, case.world, path, case, steps, top, threads_per_rank=1)[0]
    total, state, act, passing = planned(_config(path), case)
    return dict(case=case, plan=total, plan_state=state, plan_act=act, plan_passing=passing, run=mine.total,
                run_state=mine.weights + mine.grads + mine.optimizer, run_act=mine.activations, peak=mine.peak,
                top=mine.top, run_saved=mine.weights + mine.optimizer + max(mine.together, mine.grads))


def _config(path: str):
    from hfpipe.source.config import load_config

    return load_config(Path(path))


def _row(r: dict) -> str:
    c, gib = r["case"], 2 ** 30
    mesh = "".join(f" {k}{getattr(c, k)}" for k in ("tp", "cp", "ep") if getattr(c, k) > 1)
    out = (f"{c.mode:<5} ac={c.ac:<9} {c.dtype:<10}{mesh:<6}  plan {r['plan'] / gib:7.2f} GiB  "
           f"held {r['run'] / gib:7.2f}  plan/held {r['plan'] / r['run']:.4f}  "
           f"state {r['plan_state'] / max(1, r['run_state']):.4f}  activations {r['plan_act'] / max(1, r['run_act']):.4f} "
           f"({r['plan_act'] / gib:.2f}/{r['run_act'] / gib:.2f})  backward and loss working set "
           f"{r['plan_passing'] / gib:.3f} GiB; without it plan/saved {(r['plan'] - r['plan_passing']) / r['run_saved']:.4f}")
    if r["peak"]:
        out += f"  cuda max_allocated {r['peak'] / gib:7.2f}  plan/cuda {r['plan'] / r['peak']:.3f}"
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-shape", choices=sorted(SHAPES), default="llama3-small")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--mode", default="full,lora", help=f"comma-separated of {', '.join(MODES)}")
    p.add_argument("--ac", default="none", help="comma-separated of none, selective, full")
    p.add_argument("--dtype", default="bf16", help="comma-separated of fp32, bf16-mixed, bf16")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1, help="expert parallel (a MoE --model-shape; dp = ep)")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--block", type=int, default=None, help="--quantize-block-size of the quantized modes")
    p.add_argument("--detail", type=int, nargs="?", const=12, default=0,
                   help="the largest saved tensors at the peak, per case (how many; default 12)")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hfpipe-plan-memory-"))
    try:
        path = str(make_model(work / "model", a.model_shape, a.layers))
        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
        print(f"{device}: {a.model_shape} x {a.layers} layers, {a.batch} x {a.seq} tokens, pp1, LoRA r{a.lora_rank}")
        for mode in a.mode.split(","):
            for ac in a.ac.split(","):
                for dtype in a.dtype.split(","):
                    case = Case(mode, ac, dtype, a.seq, a.batch, a.tp, a.cp, a.ep, lora_rank=a.lora_rank, block=a.block)
                    try:
                        r = compare(path, case, top=a.detail)
                    except torch.OutOfMemoryError:  # worth a row: what did the plan say?
                        print(f"{case}: out of memory; plan {planned(_config(path), case)[0] / 2**30:.2f} GiB")
                        continue
                    print(_row(r), flush=True)
                    for nbytes, shape, dt, module in r["top"]:
                        print(f"      {nbytes / 2**20:9.2f} MiB  {dt:<9} {str(shape):<22} {module}")
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
