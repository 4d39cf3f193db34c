"""Memory alive only inside a backward, or inside one chunk of the loss: the working set on top of what is saved.

The activations column prices what autograd keeps from a forward to its backward (saved-tensor hooks
count it). A backward also makes tensors that live only while it runs: the gradient flowing in, the
gradients of a layer's intermediates (an MLP's gate and up outputs while down, gate and up run their
backward: about ``3 x intermediate`` per token) and the input gradient it hands down. The loss does the
same per chunk: logits, their fp32 log-softmax and its gradient, freed before the next chunk. On one H200
these put a LoRA run of Llama-3.1-8B (4096 x 2 tokens, bf16) at 88.4 GiB where the activations and
gradients summed to 87.8 (20.6 against 19.8 under full checkpointing). Saved-tensor hooks cannot see them,
so they are measured here by a dispatch mode that follows every storage an op makes until it is freed
(:class:`LiveBytes`): one layer of each kind runs forward and then backward to its input, as
:mod:`hfpipe.plan.activations` runs it (zero-stride weights, matmuls skipped), and the backward's peak above
what the forward left is the layer's transient. Only one backward runs at a time on a rank, so a rank adds
the largest layer's (or the loss chunk's) once (:func:`hfpipe.plan.peak.rank_peak`).

Per token, from two token counts (64 and 128): what does not grow with tokens is not an activation.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import weakref

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hfpipe.errors import HfpipeError
from hfpipe.plan.dispatch import dispatch_experts
from hfpipe.plan.layer_run import _DTYPES, _TOKENS, _SkipMatmuls, _add_lora, _materialise, _signature

__all__ = ["LiveBytes", "backward_bytes_per_token", "loss_chunk_bytes_per_token", "rank_transient"]

log = logging.getLogger(__name__)


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages the ops under it made that are still alive (``now``) and their most (``peak``).

    torch has a tracker of this kind (``torch.distributed._tools.mem_tracker.MemTracker``) but it sorts
    bytes by module and optimizer and needs a device; this one only sums. A storage's Python object is
    preserved while the storage lives, so a finalizer on it fires when its memory is freed, whichever
    tensor (or autograd's own copy of one) held it last. ``skip``: storage addresses not counted (weights).
    """

    def __init__(self, skip=()):
        super().__init__()
        self.skip = set(skip)
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.track(t)
        return out

    def track(self, t: torch.Tensor) -> None:
        if t.device.type == "meta" or type(t) is not torch.Tensor:  # a wrapper's parts come by their own ops
            return
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if not nbytes or ptr in self.skip or ptr in self.live:
            return
        self.live[ptr] = nbytes
        self.now += nbytes
        self.peak = max(self.peak, self.now)
        weakref.finalize(storage, self._free, ptr)

    def forget(self, ptrs) -> None:
        """Count these storages no more (from now: the peak so far stays)."""
        for ptr in ptrs:
            self.skip.add(ptr)
            self.now -= self.live.pop(ptr, 0)

    def _free(self, ptr: int) -> None:
        self.now -= self.live.pop(ptr, 0)

    def restart(self) -> int:
        """Start a new peak from now; returns now."""
        self.peak = self.now
        return self.now


def rank_transient(stages, config, dtype: str, lora: tuple[int, str] | None, fsdp: bool, tokens: int, tp: int,
                   head_kept: int, head_trains: bool, recompute: int = 0, dispatched: bool = False,
                   split: bool = False) -> int:
    """The most a rank holding ``stages`` adds, once, above its activations for a microbatch of ``tokens``
    tokens (a cp rank's): its largest layer's backward, or its loss (one chunk's, or the whole microbatch's
    beyond the ``head_kept`` bytes priced as the head's activations). Under tp a layer's is priced whole
    (an upper bound: tp splits its MLP's part), the loss's over the vocabulary's ``1 / tp``. Under activation
    checkpointing (``recompute``: the bytes the plan prices for the largest layer recomputed), a checkpointed
    layer's backward, measured recompute and all, beyond ``recompute``.

    Through a stage's whole backward the schedule holds its output and the gradient it received (``h`` per
    token each), which no layer saves; and where the schedule ``split``s the backward (input gradients first,
    retaining the graph: the zero-bubble ones), the chunked loss keeps the gradients it made in forward (the
    hidden states', and the head's where it trains) while its backward hands on scaled copies of them
    (:func:`hfpipe.loss.linear_head.hand_on`): on the last stage those stay beside every layer's backward.
    ``dispatched``: the routed experts are reached by ``--ep``'s dispatch (:mod:`hfpipe.plan.dispatch`)."""
    from hfpipe.loss.budget import chunk_tokens
    from hfpipe.models.registry import adapter_for
    from hfpipe.plan.memory import ACT_BYTES

    act = ACT_BYTES[dtype]
    hidden = math.prod(adapter_for(config).hidden_shape(config, 1, 1)[2:]) * act
    chunk = chunk_tokens(config.vocab_size)
    chunked = 0 < chunk < tokens
    most = 0
    if any(s.layers for s in stages):
        most = tokens * backward_bytes_per_token(config, dtype, lora, fsdp, dispatched=dispatched)
        if recompute:
            most = max(most, tokens * backward_bytes_per_token(config, dtype, lora, fsdp, ac=True,
                                                               dispatched=dispatched) - recompute)
        most += tokens * 2 * hidden
        if chunked and split and any(s.head for s in stages):
            most += tokens * hidden + config.vocab_size * config.hidden_size * act // tp * head_trains
    if any(s.head for s in stages):
        n = chunk if chunked else tokens
        most = max(most, n * loss_chunk_bytes_per_token(config, dtype, lora, fsdp) // tp - head_kept)
    return int(most)


def backward_bytes_per_token(config, dtype: str, lora: tuple[int, str] | None = None, fsdp: bool = False,
                             ac: bool = False, dispatched: bool = False) -> int:
    """The most bytes per token any decoder layer's backward holds above what its forward saved (see the module).

    ``ac``: the layer is checkpointed; then what its recompute saves is included (the caller prices the
    largest layer's saved bytes once as the recompute, and takes the larger of the two); ``dispatched``: the routed
    experts behind ``--ep``'s dispatch, as :func:`hfpipe.plan.activations.layer_layouts` measures them."""
    key = json.dumps(config.to_dict(), sort_keys=True, default=str)
    lora = (*lora, fsdp or dtype == "bf16-mixed") if lora is not None else None
    return _measure(key, type(config), dtype, lora, head=False, ac=ac, dispatched=dispatched)


def loss_chunk_bytes_per_token(config, dtype: str, lora: tuple[int, str] | None = None, fsdp: bool = False) -> int:
    """Bytes per token the head and its loss hold at their most over forward and backward together: per chunk
    of the chunked loss (:mod:`hfpipe.loss.chunked`), or the whole microbatch when it is not chunked (then
    what it saves is priced already; the caller subtracts it)."""
    key = json.dumps(config.to_dict(), sort_keys=True, default=str)
    lora = (*lora, fsdp or dtype == "bf16-mixed") if lora is not None else None
    return _measure(key, type(config), dtype, lora, head=True)


@functools.lru_cache(maxsize=32)
def _measure(key: str, config_cls, dtype: str, lora, head: bool, ac: bool = False, dispatched: bool = False) -> int:
    from hfpipe.models.meta import build_meta_model, model_config

    fields = json.loads(key)
    try:
        config = model_config(config_cls.from_dict(fields))
        full = build_meta_model(config, _DTYPES[dtype])
        if head:
            return _per_token(lambda t: _head_peak(config, dtype, lora, t))
        kinds, most = set(), 0
        for i, layer in enumerate(full.model.layers):
            kind = _signature(config, i, layer)
            if kind not in kinds:
                kinds.add(kind)
                most = max(most, _per_token(lambda t: _layer_peak(config, i, dtype, lora, t, ac, dispatched)))
        return most
    except HfpipeError:
        raise
    except Exception as e:  # noqa: BLE001 - by formula: the gradient in, out, and an MLP's three intermediates
        log.info("backward memory of %s by formula (measuring failed: %s: %s)", fields.get("model_type"),
                 type(e).__name__, (str(e).splitlines() or [""])[0][:200])
        act = 4 if dtype == "fp32" else 2
        if head:
            return 3 * 4 * fields["vocab_size"] + 2 * fields["vocab_size"]
        return act * (2 * fields["hidden_size"] + 3 * fields.get("intermediate_size", 4 * fields["hidden_size"]))


def _per_token(peak) -> int:
    """The growth of ``peak(tokens)`` per token, between 64 and 128 tokens (constants drop out)."""
    return max(0, -(-(peak(2 * _TOKENS) - peak(_TOKENS)) // _TOKENS))


def _stage(config, spec, dtype: str, lora, dispatched: bool = False):
    from hfpipe.models.meta import build_meta_model
    from hfpipe.models.registry import adapter_for
    from hfpipe.models.stage import PipelineStageModule

    full = build_meta_model(config, _DTYPES[dtype])  # fresh: the adapters go into the modules the stage takes
    adapter = adapter_for(config)
    stage = PipelineStageModule(spec, config, full, adapter)
    _materialise(stage, _DTYPES[dtype])
    if dispatched:
        dispatch_experts(stage)
    if lora is not None:
        _add_lora(stage, full, lora, experts=dispatched)
    return stage, adapter


def _layer_peak(config, index: int, dtype: str, lora, tokens: int, ac: bool = False, dispatched: bool = False) -> int:
    """Bytes layer ``index``'s backward holds at its most above what its forward left (its output included in
    both), with the gradient flowing in; weight gradients are not taken (they are the gradients column).
    ``ac``: the layer checkpointed, so its backward recomputes it first (what it saves included)."""
    from hfpipe.models.spec import StageSpec

    stage, adapter = _stage(config, StageSpec(0, (index,), embed=False, head=False), dtype, lora, dispatched)
    stage.activation_checkpointing = "full" if ac else "none"
    rng = torch.Generator().manual_seed(0)
    x = torch.randn(adapter.hidden_shape(config, 1, tokens), generator=rng, dtype=_DTYPES[dtype], requires_grad=True)
    extra = {"input_ids": torch.zeros(1, tokens, dtype=torch.long)} if adapter.layer_inputs else {}
    live = LiveBytes(p.untyped_storage().data_ptr() for p in stage.parameters())
    with live, _SkipMatmuls():  # the tracker below: it sees the zeros the skipped matmuls make
        out = stage(x, **extra)
        out = out[0] if isinstance(out, tuple) else out
        after = live.restart()
        torch.autograd.grad(out, [x], torch.zeros_like(out))
    return live.peak - after


def _head_peak(config, dtype: str, lora, tokens: int) -> int:
    """Bytes the final norm, the head and a cross-entropy in fp32 hold at their most over ``tokens`` tokens,
    forward and backward to the hidden states (as one chunk of :mod:`hfpipe.loss.chunked` runs)."""
    from hfpipe.models.spec import StageSpec

    stage, adapter = _stage(config, StageSpec(0, (), embed=False, head=True), dtype, lora)
    targets = torch.zeros(tokens, dtype=torch.long)
    live = LiveBytes(p.untyped_storage().data_ptr() for p in stage.parameters())
    with live, _SkipMatmuls():
        before = live.restart()
        # made under the tracker: the caller subtracts what the head saves, which in fp32 is this input itself
        x = torch.zeros(adapter.hidden_shape(config, 1, tokens), dtype=_DTYPES[dtype], requires_grad=True)
        logits = stage.logits(x)
        # the logits stay alive through the backward: a chunk's in its loop, a whole microbatch's as the
        # stage's output, which the schedule keeps for the stage's backward
        loss = F.cross_entropy(logits.flatten(0, -2).float(), targets, reduction="sum")
        torch.autograd.grad(loss, [x])
    return live.peak - before
