"""One TRL DPO script, run in one process with ``DPOTrainer`` (the oracle) or under torchrun with hfpipe's
``PipelineDPOTrainer``; ``tests/hf/test_hf_dpo.py`` compares what both write: ``log_history.json``,
``ref_logps.json`` (the reference log-probs read before training) and ``final/``.

    python train_dpo.py SPEC.json   # SPEC keys: model, out, trainer ("plain"/"pipeline"), pp, dp, tp, microbatches,
                                    # loss_type (a name or a list), loss_weights, beta, batch, ga, max_steps, lr, lora,
                                    # eval, precompute, label_smoothing, ld_alpha, f_divergence_type, pad_to
"""

import json
import sys

import hfpipe.hf  # noqa: F401 - first, as a user's script has it in place of TRL's import (a quiet start)
from datasets import Dataset
from trl import DPOConfig

from train_lm import lora_config, plain_model, train_and_record  # as the Trainer script builds, trains, records


def preference_dataset(n: int, seed: int) -> Dataset:
    rows = [{"prompt": f"Question {i}: what is {i} plus {(i + seed) % 4}?",
             "chosen": f" It is {i + (i + seed) % 4}." + " Sure." * (i % 3),
             "rejected": f" Maybe {i * 3 % 7}, or not" + " really" * ((i + seed) % 4)} for i in range(n)]
    return Dataset.from_list(rows)


def main(spec: dict) -> None:
    # DPO trains at small learning rates (TRL's default 1e-6); 1e-4 still moves every weight AdamW updates by
    # ~1e-4 a step, ten times the tolerance the weights are compared with, and keeps AdamW from turning a last-bit
    # difference of a near-zero gradient into a step of the full learning rate.
    loss_type = spec.get("loss_type", "sigmoid")
    args = DPOConfig(output_dir=spec["out"], max_steps=spec.get("max_steps", 3), logging_steps=1,
                     per_device_train_batch_size=spec.get("batch", 4), per_device_eval_batch_size=4,
                     gradient_accumulation_steps=spec.get("ga", 1), learning_rate=spec.get("lr", 1e-4), max_length=48,
                     beta=spec.get("beta", 0.1), loss_type=[loss_type] if isinstance(loss_type, str) else loss_type,
                     loss_weights=spec.get("loss_weights"), label_smoothing=spec.get("label_smoothing", 0.0),
                     ld_alpha=spec.get("ld_alpha"), f_divergence_type=spec.get("f_divergence_type", "reverse_kl"),
                     precompute_ref_log_probs=spec.get("precompute", True),
                     eval_strategy="steps" if spec.get("eval") else "no", eval_steps=2, report_to=[],
                     disable_tqdm=True, seed=7, dataloader_drop_last=True, bf16=False, save_strategy="no",
                     pad_to_multiple_of=spec.get("pad_to"))
    data = {"train_dataset": preference_dataset(spec.get("pairs", 32), 0)}
    if spec.get("eval"):
        data["eval_dataset"] = preference_dataset(8, 1)
    peft = lora_config() if spec.get("lora") else None
    if spec["trainer"] == "plain":
        from trl import DPOTrainer

        trainer = DPOTrainer(plain_model(spec["model"], peft), args=args, **data)
    else:
        from hfpipe.hf import PipelineDPOTrainer

        axes = {k: spec[k] for k in ("dp", "tp", "ep", "microbatches", "schedule") if k in spec}
        trainer = PipelineDPOTrainer(spec["model"], args=args, pp=spec.get("pp"), peft_config=peft, **axes, **data)
    ref = {k: [float(v) for v in trainer.train_dataset[k]] for k in ("ref_chosen_logps", "ref_rejected_logps")
           if k in trainer.train_dataset.column_names}
    train_and_record(trainer, spec, {"ref_logps": ref})


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        main(json.load(f))
