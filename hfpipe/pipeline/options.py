"""What a pipeline is built from, as two objects: :class:`PipelineLayout` (how the model is split over
the ranks and scheduled) and :class:`StageOptions` (how each rank's stages are built and run).

Their fields are the one declaration of the pipeline's settings. :func:`hfpipe.api.load_pipeline`'s
keywords are these fields (its signature and argument list are made from them, and
:func:`from_keywords` refuses any other keyword, naming the closest field); a run's
:class:`~hfpipe.config.run.FinetuneConfig` becomes them in :func:`from_config`; the Trainer faces take
the layout's fields. A new setting is one field here, and reaches every face from it.

Each object is checked when it is made, with the one-line errors ``load_pipeline`` raises, in the same
order: the degrees, the counts (``load_pipeline(vpp=0): vpp must be an integer >= 1 ...``), the
checkpointing, the quantized base, the dtype. A message that names a flag (``--dtype``) is turned into
the argument's name by the face that catches it (:func:`hfpipe.api.load_pipeline`).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
import typing
from dataclasses import dataclass

import torch

from hfpipe.config.names import check_fp8
from hfpipe.lora.adapters import check_lora_config, from_finetune_config
from hfpipe.models.compile import CompileSpec
from hfpipe.parallel.dims import ParallelDims, check_degrees
from hfpipe.pipeline.schedule import PipelineError
from hfpipe.plan.memory import frozen_dtype
from hfpipe.quant.linear import QuantSpec

__all__ = ["CHECKPOINTING", "PRECISIONS", "PipelineLayout", "StageOptions", "from_config", "from_keywords",
           "keyword_docs", "keyword_parameters"]

#: ``dtype``'s values: (the dtype parameters are stored in, the dtype the compute runs in).
PRECISIONS = {
    "fp32": (torch.float32, torch.float32),
    "bf16-mixed": (torch.float32, torch.bfloat16),
    "bf16": (torch.bfloat16, torch.bfloat16),
    "fp64": (torch.float64, torch.float64),  # for checking numerics: summation order's noise near 1e-16
}
#: ``activation_checkpointing``'s values.
CHECKPOINTING = ("none", "full", "selective")
#: The checks name ``load_pipeline``'s arguments: the call users make (the CLI checked its flags already).
_CALL = "load_pipeline"
#: Counts: (lowest value, whether None means "the default"). The degrees are checked by hfpipe.parallel.dims.
_COUNTS = {"vpp": (1, True), "microbatches": (1, True), "seed": (0, False), "loss_chunk_tokens": (0, True)}


def _check_counts(**counts) -> None:
    for name, value in counts.items():
        low, optional = _COUNTS[name]
        if value is None and optional:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise PipelineError(f"{_CALL}({name}={value!r}): {name} must be an integer >= {low}"
                                + (" (or None for the default)" if optional else ""))


@dataclass(frozen=True)
class PipelineLayout:
    """How the model is split over the ranks and scheduled.

    Attributes:
        pp: Pipeline ranks (default: WORLD_SIZE / (dp * cp * tp)).
        dp: Data-parallel replicas (FSDP2 over the dp dimension).
        ep: Expert-parallel degree: MoE routed experts sharded over ep ranks of the dp group.
        tp: Tensor-parallel degree: each stage's matrices, embedding and head split over tp ranks
            (:mod:`hfpipe.parallel.tensor`); the world is pp * dp * cp * tp processes.
        cp: Context-parallel degree: each microbatch's sequence split over cp ranks (head-tail balanced),
            attention over K and V gathered from them (:mod:`hfpipe.parallel.context`); every cp rank of a
            replica is handed the same whole rows. The world is pp * dp * cp * tp processes.
        vpp: Stages per rank (default 1, or 2 for multi-stage schedules).
        schedule: A name from :data:`hfpipe.parallel.rules.SCHEDULES`.
        microbatches: Microbatches per step (default: the number of stages).
        method: How to split the layers when no ``layout`` is given (see
            :func:`hfpipe.plan.split.plan_pipeline`).
        layout: An explicit split of the layers (see :func:`hfpipe.plan.split.plan_pipeline`).
    """

    pp: int | None = None
    dp: int = 1
    ep: int = 1
    tp: int = 1
    cp: int = 1
    vpp: int | None = None
    schedule: str = "1f1b"
    microbatches: int | None = None
    method: str = "balanced"
    layout: str | None = None

    def __post_init__(self) -> None:
        degrees = {"dp": self.dp, "ep": self.ep, "tp": self.tp, "cp": self.cp}
        check_degrees(_CALL, **({} if self.pp is None else {"pp": self.pp}), **degrees)
        _check_counts(vpp=self.vpp, microbatches=self.microbatches)

    def dims(self, dist=None) -> ParallelDims:
        """The degrees; pp by default what the world (``dist``'s, else ``WORLD_SIZE``) leaves to it."""
        others = self.dp * self.cp * self.tp
        pp = self.pp or (dist.pp if dist else max(1, int(os.environ.get("WORLD_SIZE", "1")) // others))
        return ParallelDims(pp=pp, dp=self.dp, cp=self.cp, tp=self.tp, ep=self.ep)


@dataclass(frozen=True)
class StageOptions:
    """How each rank's stages are built and run.

    Attributes:
        dtype: ``fp32``, ``bf16-mixed`` (fp32 master weights, bf16 compute), ``bf16`` or ``fp64``.
        activation_checkpointing: ``none``, ``full`` (every layer) or ``selective`` (every other layer).
        sequence_parallel: With tp > 1, also split the norms and the activations between layers by
            sequence (default on).
        reshard_per_microbatch: With dp > 1, FSDP2 shards weights and gradients under the pipeline too:
            reshard after every microbatch's forward and backward, reduce-scatter every microbatch
            (:mod:`hfpipe.pipeline.stage_sync`).
        lora: A ``peft.LoraConfig``: inject PEFT's LoRA adapters and freeze the base weights;
            ``parameters()`` then yields only the adapters.
        seed: Seeds the LoRA adapters' initialisation (per adapter, whatever the pipeline size).
        loss_chunk_tokens: Tokens per chunk of the last stage's loss (default: sized so that one
            chunk's fp32 logits stay near 256 MiB; 0: full logits). See :mod:`hfpipe.loss.chunked`.
        quantize_base: ``nf4`` or ``fp8``: keep a LoRA run's frozen base quantized on the device
            (:mod:`hfpipe.quant`); every decoder-layer linear dequantizes just in time.
        quantize_block_size: Values per NF4 scale (default 64), or the FP8 tile edge (default: the
            checkpoint's own tiles, else 128).
        compile: ``torch.compile`` each decoder layer in place (:mod:`hfpipe.models.compile`); names, checkpoints
            and exports are unchanged. The zero-bubble schedules are refused with it.
        compile_backend: torch's compile backend (default ``inductor``).
        compile_mode: torch's compile mode (default: torch's).
        fp8: Float8 training: ``rowwise`` or ``tensorwise`` (torchao's recipes), or ``None``: the decoder
            layers' linears multiply in float8 (:mod:`hfpipe.quant.float8`); needs a bf16 compute dtype.
            ``blockwise``: a ``quantize_base="fp8"`` base multiplies its own FP8 tiles in float8
            (:mod:`hfpipe.quant.fp8_matmul`), in any dtype.
    """

    dtype: str = "fp32"
    activation_checkpointing: str = "none"
    sequence_parallel: bool = True
    reshard_per_microbatch: bool = False
    lora: object = None
    seed: int = 0
    loss_chunk_tokens: int | None = None
    quantize_base: str | None = None
    quantize_block_size: int | None = None
    compile: bool = False
    compile_backend: str | None = None
    compile_mode: str | None = None
    fp8: str | None = None

    def __post_init__(self) -> None:
        _check_counts(seed=self.seed, loss_chunk_tokens=self.loss_chunk_tokens)
        if self.activation_checkpointing not in CHECKPOINTING:
            raise PipelineError(f"{_CALL}(activation_checkpointing={self.activation_checkpointing!r}): "
                                f"choose one of {', '.join(CHECKPOINTING)}")
        self._check_quantize()
        if self.dtype not in PRECISIONS:
            raise PipelineError(f"--dtype {self.dtype!r} is unknown; choose one of {', '.join(PRECISIONS)}")
        self._check_compile()
        check_fp8(self.fp8, self.dtype, self.quantize_base)
        for switch in ("sequence_parallel", "reshard_per_microbatch", "compile"):  # a switch given as 1 or 0 is one
            value = getattr(self, switch)
            if value not in (True, False):  # a string such as "no" would read as True
                raise PipelineError(f"{_CALL}({switch}={value!r}): {switch} must be True or False")
            object.__setattr__(self, switch, bool(value))
        if self.lora is not None:
            check_lora_config(self.lora)  # before anything loads, not in PEFT's words when it builds adapters

    def _check_quantize(self) -> None:
        block = self.quantize_block_size
        if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 1):
            raise PipelineError(f"{_CALL}(quantize_block_size={block!r}): quantize_block_size must be an "
                                "integer >= 1 (or None for the default)")
        if self.quantize_base is None:
            if block is not None:
                raise PipelineError("--quantize-block-size applies with --quantize-base nf4|fp8 only")
            return
        if self.lora is None:
            raise PipelineError("--quantize-base trains LoRA adapters on a frozen base; add --lora-rank R (e.g. 16)")
        QuantSpec(self.quantize_base, block)  # its kind, named as the flag

    def _check_compile(self) -> None:
        if not self.compile:
            if self.compile_backend is not None or self.compile_mode is not None:
                raise PipelineError(f"{_CALL}(compile_backend=..., compile_mode=...) apply with compile=True only")
            return
        try:
            self.compile_spec.check()
        except ValueError as e:
            raise PipelineError(f"{_CALL}(compile=True): {e}") from None

    @property
    def compile_spec(self) -> CompileSpec | None:
        """How the decoder layers are compiled (``compile``), or ``None``."""
        return CompileSpec(self.compile_backend or "inductor", self.compile_mode) if self.compile else None

    @property
    def param_dtype(self) -> torch.dtype:
        """The dtype parameters are stored in."""
        return PRECISIONS[self.dtype][0]

    @property
    def base_dtype(self) -> torch.dtype:
        """The dtype the stage modules are built and loaded in: :attr:`param_dtype`, except a LoRA run's
        unquantized base under bf16-mixed, which nothing trains: held in the compute dtype, it is the compute
        copy bf16-mixed would cast it to (the same values), without an fp32 master beside it (an 8B base: 16 GB,
        not 32 + 16). Its adapters stay fp32 masters (PEFT's ``autocast_adapter_dtype``), cast for compute."""
        if self.lora is not None:  # the rule is the plan's too: one place
            return PRECISIONS[frozen_dtype(self.dtype, self.quantize_base is not None)][0]
        return self.param_dtype

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the forward runs in (bf16-mixed casts to it: FSDP2, or hfpipe.parallel.one_replica)."""
        return PRECISIONS[self.dtype][1]

    @property
    def quantize(self) -> QuantSpec | None:
        """The quantized base asked for, its weights cast to :attr:`param_dtype` before quantizing, or ``None``."""
        if self.quantize_base is None:
            return None
        return QuantSpec(self.quantize_base, self.quantize_block_size, str(self.param_dtype).removeprefix("torch."))


def from_config(cfg) -> tuple[PipelineLayout, StageOptions]:
    """The pipeline options of a run's :class:`~hfpipe.config.run.FinetuneConfig`."""
    layout = PipelineLayout(pp=cfg.pp, dp=cfg.dp, ep=cfg.ep, tp=cfg.tp, cp=cfg.cp, vpp=cfg.vpp, schedule=cfg.schedule,
                            microbatches=cfg.num_microbatches, method=cfg.plan_method, layout=cfg.layout)
    stages = StageOptions(dtype=cfg.dtype, activation_checkpointing=cfg.activation_checkpointing,
                          sequence_parallel=cfg.sequence_parallel, reshard_per_microbatch=cfg.reshard_per_microbatch,
                          lora=from_finetune_config(cfg), seed=cfg.seed, quantize_base=cfg.quantize_base,
                          quantize_block_size=cfg.quantize_block_size, compile=cfg.compile,
                          fp8=cfg.fp8_recipe if cfg.fp8 else None)
    return layout, stages


#: The objects a face's keywords make, in the order their checks run (the degrees first, the dtype last).
_OPTIONS = (PipelineLayout, StageOptions)


def from_keywords(call: str, keywords: dict) -> tuple[PipelineLayout, StageOptions]:
    """The two objects made from ``call``'s keyword arguments (each a field of one of them).

    Raises:
        TypeError: a keyword that is no field, as Python says it, with the closest field.
    """
    names = [f.name for cls in _OPTIONS for f in dataclasses.fields(cls)]
    for key in keywords:
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            raise TypeError(f"{call}() got an unexpected keyword argument {key!r}"
                            + (f" (did you mean {close[0]}?)" if close else ""))
    return tuple(cls(**{f.name: keywords[f.name] for f in dataclasses.fields(cls) if f.name in keywords})
                 for cls in _OPTIONS)


def keyword_parameters() -> list[inspect.Parameter]:
    """Every field of the options as a keyword-only parameter (its type and default): a face's signature."""
    return [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                              annotation=typing.get_type_hints(cls)[f.name])
            for cls in _OPTIONS for f in dataclasses.fields(cls)]


def keyword_docs() -> str:
    """The fields' descriptions (the classes' ``Attributes:`` sections), for a face's ``Args:``."""
    lines = []
    for cls in _OPTIONS:
        doc = inspect.cleandoc(cls.__doc__)
        lines += doc.split("Attributes:\n", 1)[1].splitlines()
    return "\n".join(lines)
