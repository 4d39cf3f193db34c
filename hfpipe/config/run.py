"""The run configuration: one dataclass, read strictly from YAML, checked when it is built.

A recipe file (``hfpipe/recipes/*.yaml``) holds ``FinetuneConfig`` fields and nothing else; the
``hfpipe finetune`` flags are the same fields spelled ``--batch-size``. Every check runs in
``__post_init__`` (they live in :mod:`hfpipe.config.checks`), so a config built from a file, from
flags or with ``dataclasses.replace`` is checked the same way, and each message names the flag.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hfpipe.source.config import bundled_config_dir
from hfpipe.config.checks import check, check_keys, load_yaml
from hfpipe.config.names import INTERLEAVED_SCHEDULES, SCHEDULES, V_SCHEDULES, ConfigError, check_other_names
from hfpipe.parallel.rules import schedule_style

__all__ = [
    "ConfigError",
    "FinetuneConfig",
    "SCHEDULES",
    "INTERLEAVED_SCHEDULES",
    "V_SCHEDULES",
    "bundled_config_dir",
    "field_help",
]

@dataclass
class FinetuneConfig:
    """Everything one fine-tuning run needs; a recipe file holds exactly these keys."""

    model: str
    """Hub id (``meta-llama/Llama-3.1-8B``) or local folder with config.json and safetensors."""
    output_dir: str = "out"
    """Folder for checkpoints, logs and the exported model."""

    # -- parallelism --
    pp: int = 1
    """Pipeline-parallel degree: ranks per pipeline."""
    dp: int = 1
    """Data-parallel degree: pipelines side by side; world size is pp * dp * cp * tp."""
    ep: int = 1
    """Expert-parallel degree: each MoE layer's routed experts are sharded over ep ranks of the
    data-parallel group (ep divides dp); tokens reach their experts by all-to-all."""
    tp: int = 1
    """Tensor-parallel degree: each decoder layer's matrices, the embedding and the head are split
    over tp consecutive ranks (inside one node); world size is pp * dp * cp * tp."""
    cp: int = 1
    """Context-parallel degree: each microbatch's sequence is split over cp ranks (head-tail
    balanced), and attention gathers K and V over them; world size is pp * dp * cp * tp."""
    sequence_parallel: bool = True
    """With tp > 1, also split the norms' and residual activations over the tp ranks along the
    sequence (all-gather + reduce-scatter instead of all-reduce)."""
    reshard_per_microbatch: bool = False
    """FSDP under the pipeline: reshard each stage's weights after every microbatch's forward and
    reduce-scatter its gradients after every backward, so that weights and gradients divide by dp
    too, at the price of an all-gather and reduce-scatter per microbatch (default: once per step)."""
    vpp: int = 1
    """Stages per rank. Left at 1, it becomes 2 for the interleaved and V schedules."""
    schedule: str = "1f1b"
    """gpipe | 1f1b (one stage per rank); interleaved-1f1b | looped-bfs | interleaved-zb
    (vpp >= 2 stages per rank); zbv | dualpipev (two stages per rank in a V)."""
    layout: str | None = None
    """Megatron pipeline layout (``"Et*3|(tt|)*29,m|L"``): one ``|``-separated group per stage,
    E embedding, t decoder layer, m MTP layer, L norm + head. Overrides plan_method."""
    plan_method: str = "balanced"
    """How layers are split into stages: even (equal layer counts), weighted (embedding and head
    count as layers), balanced (by estimated compute and memory per layer)."""
    microbatches: int | None = None
    """Microbatches per schedule step; batch_size must be a multiple of it. Default pp * vpp,
    the number of stages: the fewest that keeps every schedule legal (V schedules need 2 * pp)."""

    # -- data --
    dataset: str = "builtin:tiny-chat"
    """Hub dataset id, local file or folder (json, jsonl, parquet), or ``builtin:<name>``."""
    dataset_config: str | None = None
    """Dataset configuration (subset) name, for hub datasets that have several."""
    split: str = "train"
    """Dataset split to train on."""
    format: str = "auto"
    """auto | alpaca | sharegpt | chat | instruction | text; auto picks the format from the
    columns (see "Bring your own data" in the README)."""
    seq_len: int = 512
    """Tokens per sequence; longer samples are cut, shorter ones packed or padded."""
    packing: bool = True
    """Pack several samples into each sequence instead of padding."""

    # -- method --
    method: str = "sft"
    """sft (supervised fine-tuning) | dpo (preference pairs in TRL's formats, TRL's DPO losses against a
    reference pass run before training and stored with the run; needs the trl extra)."""
    beta: float = 0.1
    """With --method dpo: TRL's beta, how far the trained model may move from the reference."""
    dpo_loss: str = "sigmoid"
    """With --method dpo: TRL's loss_type (sigmoid, ipo, hinge, ...), or several weighted, sigmoid=1,sft=0.5."""

    # -- optimisation --
    batch_size: int = 8
    """Sequences per data-parallel rank per schedule step, split into `microbatches` (pairs of two
    sequences under --method dpo). Sequences per optimizer step: batch_size * grad_accum * dp."""
    grad_accum: int = 1
    """Schedule steps whose gradients add up before each optimizer step."""
    lr: float = 2e-5
    """Peak learning rate (AdamW)."""
    min_lr: float = 0.0
    """Learning rate at the end of the cosine or linear decay."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW (beta1, beta2); a two-item list in YAML."""
    eps: float = 1e-8
    """AdamW epsilon."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to lr."""
    lr_schedule: str = "cosine"
    """cosine | linear (decay to min_lr after warmup) | constant (lr after warmup)."""
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm to this; null turns clipping off."""
    max_steps: int | None = None
    """Stop after this many optimizer steps; null trains for `epochs` epochs."""
    epochs: int = 1
    """Passes over the dataset, used when max_steps is null."""
    dtype: str = "fp32"
    """fp32 | bf16-mixed (fp32 weights and optimizer, bf16 autocast) | bf16 (all bf16) | fp64 (all fp64, to
    check numerics; exports keep the source's dtype unless export --dtype fp64)."""
    activation_checkpointing: str = "none"
    """none | full (recompute every decoder layer) | selective (recompute every other layer)."""
    compile: bool = False
    """torch.compile each decoder layer (inductor): faster steps after a slow first one; names,
    checkpoints and exports are unchanged. Not with the zero-bubble schedules."""
    fp8: bool = False
    """Float8 training (torchao): the decoder layers' linears whose dims divide by 16 multiply in
    float8; weights, optimizer state, checkpoints and exports keep --dtype's (bf16-mixed or bf16)."""
    fp8_recipe: str = "rowwise"
    """With --fp8: rowwise (a scale per row, torchtitan's default) | tensorwise (one per tensor) |
    blockwise (with --quantize-base fp8: the base multiplies its own FP8 tiles in float8)."""
    seed: int = 0
    """Seed for data order and any random initialisation."""

    # -- checkpointing --
    save_every: int | None = None
    """Save a resumable checkpoint every this many optimizer steps; null saves only at the end."""
    keep: int = 2
    """Resumable checkpoints to keep; older ones are deleted."""
    async_save: bool = False
    """Write checkpoints in the background while training continues."""
    resume: str | None = None
    """auto or latest (newest checkpoint in output_dir, if any), or a checkpoint folder."""
    save_hf_at_end: bool = False
    """Also export a transformers-loadable folder (config + safetensors) when training ends."""

    # -- misc --
    trust_remote_code: bool = False
    """Allow transformers to run code from the model repository."""
    threads_per_rank: int | None = None
    """torch intra-op threads per rank; null divides the CPU cores among local ranks."""
    log_every: int = 1
    """Write a metrics row and a log line every this many optimizer steps (the loss is the mean
    over those steps' tokens)."""

    # --- data formats, evaluation, logging ---
    columns: dict[str, str] | None = None
    """Rename columns before the format is detected, COLUMN=FIELD pairs (a mapping in a
    recipe): e.g. question=prompt,answer=response."""
    roles: dict[str, str] | None = None
    """Map chat roles onto system, user, assistant, tool, ROLE=ROLE pairs (a mapping in a
    recipe): e.g. bot=assistant. ShareGPT's human and gpt are built in."""
    chat_template: str | None = None
    """A Jinja chat template file used instead of the tokenizer's own."""
    train_on_prompt: bool = False
    """Put loss on prompts and user turns too (default: only on responses)."""
    allow_dropped_records: bool = False
    """Go on when more than half of the records carry no loss (e.g. chats without an assistant
    turn) and are dropped; without it such data is refused. How many were dropped, and why, is
    always said."""
    eval_dataset: str | None = None
    """Evaluation data: hub id, local file or folder, in the training data's format."""
    eval_split: str | None = None
    """Split of the evaluation data (default: --split); alone, evaluates on that split of --dataset."""
    eval_fraction: float | None = None
    """Hold out this fraction of the training records (0 < f < 1) for evaluation instead."""
    eval_every: int | None = None
    """Evaluate every this many optimizer steps (and always at the end); null: only at the end."""
    eval_batches: int | None = None
    """Evaluate on at most this many global batches; null: the whole evaluation set."""
    keep_best: bool = False
    """Also keep the checkpoint with the lowest evaluation loss in output_dir/best."""
    report_to: str = "jsonl,tensorboard"
    """Where metrics go, comma-separated: jsonl (metrics.jsonl), tensorboard (tb/), wandb
    (needs the wandb extra; WANDB_MODE=offline works), or none."""

    # --- LoRA ---
    lora_rank: int | None = None
    """Train PEFT LoRA adapters of this rank on frozen base weights; null trains every weight."""
    lora_alpha: float | None = None
    """LoRA scale numerator (adapters are scaled by lora_alpha / lora_rank); null means 2 * lora_rank."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input; 0 keeps the run exactly reproducible."""
    lora_targets: str = "all-linear"
    """Modules that get adapters: all-linear (every linear layer but the output head) or a comma
    list of module names such as q_proj,k_proj,v_proj,o_proj."""

    quantize_base: str | None = None
    """nf4 | fp8: keep the frozen base weights quantized on the device and dequantize each layer
    just in time (LoRA runs only); null keeps them in the run's dtype."""
    quantize_block_size: int | None = None
    """With --quantize-base: values per NF4 scale (default 64; must divide each weight's rows),
    or the FP8 tile edge (default: a block-FP8 checkpoint's own tiles, else 128)."""

    # --- trust ---
    timeout: float = 600.0
    """Seconds a rank waits for its peers in one collective before the run stops, naming the rank
    that did not answer (a hung or dead rank)."""

    def __post_init__(self) -> None:
        check(self)

    @property
    def dims(self):
        """The parallel degrees (:class:`hfpipe.parallel.dims.ParallelDims`)."""
        from hfpipe.parallel.dims import ParallelDims

        return ParallelDims(pp=self.pp, dp=self.dp, cp=self.cp, tp=self.tp, ep=self.ep)

    @property
    def num_microbatches(self) -> int:
        """`microbatches`, or its default pp * vpp."""
        return self.microbatches or self.pp * self.vpp

    @property
    def evaluates(self) -> bool:
        """Whether the run has an evaluation set."""
        return bool(self.eval_dataset or self.eval_split or self.eval_fraction)

    @property
    def pipeline_style(self) -> str:
        """How stages sit on ranks: "v" for zbv and dualpipev, "loop" otherwise."""
        return schedule_style(self.schedule)

    def to_dict(self) -> dict[str, Any]:
        """Plain YAML-ready values; ``from_dict(c.to_dict())`` gives back an equal config."""
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "<dict>") -> FinetuneConfig:
        """Build a config from option -> value; unknown keys and bad values name `source`."""
        if not isinstance(d, Mapping):
            raise ConfigError(f"{source}: expected a mapping of option: value, got {type(d).__name__}")
        check_other_names(d, source)
        check_keys(d, source, [f.name for f in dataclasses.fields(cls)])
        if "model" not in d:
            raise ConfigError(f"{source}: the model is required (set `model:` in the recipe, or give MODEL on the command line)")
        try:
            return cls(**d)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> FinetuneConfig:
        """Read a recipe file; `overrides` (the CLI flags) win over it, None ones are ignored."""
        path = Path(path)
        data = load_yaml(path)
        data = {} if data is None else data
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of option: value, got {type(data).__name__}")
        given = {k: v for k, v in overrides.items() if v is not None}
        check_other_names(given, "command-line overrides")
        check_keys(given, "command-line overrides", [f.name for f in dataclasses.fields(cls)])
        return cls.from_dict({**data, **given}, source=str(path))


def field_help() -> dict[str, str]:
    """Each FinetuneConfig field's docstring, by field name (for ``--help`` and docs)."""
    body = ast.parse(inspect.getsource(FinetuneConfig)).body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr):
            if isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs
