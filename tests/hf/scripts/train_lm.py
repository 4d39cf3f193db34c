"""One Trainer script, run in one process with transformers' Trainer (the oracle) or under torchrun with
hfpipe's PipelineTrainer; ``tests/hf/test_hf_trainer.py`` compares the two.

    python train_lm.py SPEC.json            # {"trainer": "plain", ...}
    torchrun --nproc-per-node 2 train_lm.py SPEC.json   # {"trainer": "pipeline", "pp": 2, ...}

SPEC keys: model, out, trainer, pp, dp, tp, ep, cp, microbatches, batch, eval_batch, ga, max_steps, clip, lora,
eval, save_steps, save_total_limit, resume, stop_at, checkpointing (with the input tokens counted), bf16,
logging_steps, fp8 (PipelineTrainer's keyword), accelerate_fp8 (ACCELERATE_MIXED_PRECISION=fp8, as
``accelerate launch --mixed_precision fp8`` sets it), count_syncs (what the steps after the first convert to Python
and which collectives they call:
``out/syncs.json``, see :class:`CountSyncs`).
It writes ``out/log_history.json`` (world rank 0) and ``save_model()`` into ``out/final``.
With ``train`` false it only evaluates the model as loaded (``eval`` set) and saves nothing.
"""

import json
import os
import sys

import hfpipe.hf  # noqa: F401 - first, as a user's script has it in place of the Trainer's import (a quiet start)
from datasets import Dataset
from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, TrainerCallback,
                          TrainingArguments)


def dataset(tok, n: int, seed: int) -> Dataset:
    texts = [f"Sample {i} {'of the pipeline ' * (1 + (i * 7 + seed) % 5)}end." for i in range(n)]
    return Dataset.from_dict({"text": texts}).map(
        lambda b: tok(b["text"], truncation=True, max_length=40), batched=True, remove_columns=["text"])


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def main(spec: dict) -> None:
    tok = AutoTokenizer.from_pretrained(spec["model"])
    if spec.get("accelerate_fp8"):
        os.environ["ACCELERATE_MIXED_PRECISION"] = "fp8"  # read by TrainingArguments
    args = TrainingArguments(
        output_dir=spec["out"], max_steps=spec.get("max_steps", 3), logging_steps=spec.get("logging_steps", 1),
        per_device_train_batch_size=spec.get("batch", 4), per_device_eval_batch_size=spec.get("eval_batch", 4),
        gradient_accumulation_steps=spec.get("ga", 1), learning_rate=1e-3, max_grad_norm=spec.get("clip", 1.0),
        eval_strategy="steps" if spec.get("eval") else "no", eval_steps=2,
        save_strategy="steps" if spec.get("save_steps") else "no", save_steps=spec.get("save_steps") or 500,
        save_total_limit=spec.get("save_total_limit"),
        activation_checkpointing=spec.get("checkpointing", False),
        include_num_input_tokens_seen="all" if spec.get("checkpointing") else "no",
        bf16=spec.get("bf16", False), use_cpu=spec.get("bf16") or spec.get("accelerate_fp8", False),  # bf16 on CPU
        torch_compile_backend=spec.get("compile_backend"),  # set: torch_compile=True
        report_to=[], disable_tqdm=True, dataloader_drop_last=True, seed=7)
    collator = DataCollatorForLanguageModeling(tok, mlm=False, pad_to_multiple_of=spec.get("pad_to", 8))
    data = {"train_dataset": dataset(tok, 64, 0), "data_collator": collator, "processing_class": tok}
    if spec.get("eval"):
        data["eval_dataset"] = dataset(tok, 8, 3)
    peft = lora_config() if spec.get("lora") else None
    if spec["trainer"] == "plain":
        from transformers import Trainer

        trainer = Trainer(model=plain_model(spec["model"], peft), args=args, **data)
    else:
        from hfpipe.hf import PipelineTrainer

        if spec.get("fsdp2_at_one_replica"):  # the oracle of tests/hf/test_hf_trainer_one_replica.py
            import hfpipe.parallel.fsdp

            hfpipe.parallel.fsdp._FSDP2_AT_ONE_REPLICA = True
        axes = {k: spec[k] for k in ("dp", "tp", "ep", "cp") if k in spec}
        trainer = PipelineTrainer(spec["model"], args=args, pp=spec.get("pp"), microbatches=spec.get("microbatches"),
                                  peft_config=peft, fp8=spec.get("fp8"), **axes, **data)
    if spec.get("stop_at"):
        from transformers import TrainerCallback

        class Stop(TrainerCallback):  # an interrupted run: stops after step N, its checkpoint-N written
            def on_step_end(self, args, state, control, **kw):
                control.should_training_stop = state.global_step >= spec["stop_at"]

        trainer.add_callback(Stop())
    if spec.get("count_syncs"):
        trainer.add_callback(CountSyncs(f"{spec['out']}/syncs.json", trainer))
    train_and_record(trainer, spec)


def train_and_record(trainer, spec: dict, more: dict | None = None) -> None:
    """Train (resuming from ``spec["resume"]``), evaluate at the end under ``spec["eval"]``, ``save_model()``
    into ``out/final``; world rank 0 writes ``out/log_history.json`` and ``out/<name>.json`` of ``more``.
    ``spec["train"]`` false: ``evaluate()`` the model as loaded, and nothing else."""
    if spec.get("train", True):
        trainer.train(resume_from_checkpoint=spec.get("resume"))
    history = trainer.state.log_history
    if spec.get("eval"):
        history = history + [trainer.evaluate()]
    if spec.get("train", True):
        trainer.save_model(f"{spec['out']}/final")
    if trainer.is_world_process_zero():
        for name, value in {"log_history": history, **(more or {})}.items():
            with open(f"{spec['out']}/{name}.json", "w") as f:
                json.dump(value, f)


class CountSyncs(TrainerCallback):
    """Counts, from the end of step 1 to the end of the last step, what a GPU would wait for: a tensor's value
    read on the host (``item``, ``bool``, ``float``, ``int``, ``tolist``, ``cpu``), split into model values
    (floating point: losses, norms) and integer/bool values (token ids and counts), each also counted apart
    while the step's batches are fetched (``get_batch_samples``, before the step's first forward), and the
    torch.distributed collectives called."""

    READS = ("item", "__bool__", "__float__", "__int__", "tolist", "cpu")
    COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
                   "barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv", "all_to_all_single")

    def __init__(self, path: str, trainer) -> None:
        self.path, self.counts, self.steps, self.fetching = path, None, 0, False
        self._patch()
        fetch = trainer.get_batch_samples

        def get_batch_samples(*args, **kwargs):
            self.fetching = True
            try:
                return fetch(*args, **kwargs)
            finally:
                self.fetching = False

        trainer.get_batch_samples = get_batch_samples

    def _patch(self) -> None:
        import torch
        import torch.distributed as dist

        def counted(owner, name, key):
            original = getattr(owner, name)

            def wrapper(*args, **kwargs):
                if self.counts is not None:
                    kind = key(args) + (" fetching the batches" if self.fetching else "")
                    self.counts[kind] = self.counts.get(kind, 0) + 1
                return original(*args, **kwargs)

            setattr(owner, name, wrapper)

        for name in self.READS:
            counted(torch.Tensor, name, lambda a: "float reads" if a[0].is_floating_point() else "integer reads")
        for name in self.COLLECTIVES:
            if hasattr(dist, name):
                counted(dist, name, lambda a: "collectives")

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            self.counts = {}
        elif self.counts is not None:
            self.steps += 1
        if state.global_step == state.max_steps:
            counts, self.counts = self.counts, None
            with open(self.path, "w") as f:
                json.dump({**counts, "steps": self.steps}, f)


def plain_model(path: str, peft=None):
    """The oracle's model: transformers' from the folder, PEFT's LoRA on it as hfpipe seeds it (``peft``)."""
    model = AutoModelForCausalLM.from_pretrained(path)
    if peft is not None:
        from peft import get_peft_model

        model = get_peft_model(model, peft)
        seed_like_hfpipe(model, peft)
    return model


def seed_like_hfpipe(model, peft, seed: int = 7) -> None:
    """The oracle's adapters initialised as hfpipe initialises them: each from the run seed and its
    module name (hfpipe.lora.adapters.add_adapters), so that they do not depend on the pipeline size."""
    import torch
    from peft.tuners.tuners_utils import BaseTunerLayer

    from hfpipe.lora.adapters import _name_seed

    for name, layer in model.named_modules():
        if isinstance(layer, BaseTunerLayer) and "default" in layer.lora_A:
            torch.manual_seed(_name_seed(seed, name.removeprefix("base_model.model.")))
            layer.reset_lora_parameters("default", peft.init_lora_weights)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        main(json.load(f))
