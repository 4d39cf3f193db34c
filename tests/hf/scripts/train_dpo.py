"""One TRL DPO script, run in one process with ``DPOTrainer`` (the oracle) or under torchrun with hfpipe's
``PipelineDPOTrainer``; ``tests/hf/test_hf_dpo.py`` compares the two.

    python train_dpo.py SPEC.json   # SPEC keys: model, out, trainer ("plain"/"pipeline"), pp, dp, tp, microbatches,
                                    # loss_type (a name or a list), loss_weights, beta, batch, ga, max_steps, lora,
                                    # eval, precompute, label_smoothing, ld_alpha, f_divergence_type
"""

import json
import sys

import hfpipe.hf  # noqa: F401 - first, as a user's script has it in place of TRL's import (a quiet start)
from datasets import Dataset
from trl import DPOConfig


def preference_dataset(n: int, seed: int) -> Dataset:
    rows = [{"prompt": f"Question {i}: what is {i} plus {(i + seed) % 4}?",
             "chosen": f" It is {i + (i + seed) % 4}." + " Sure." * (i % 3),
             "rejected": f" Maybe {i * 3 % 7}, or not" + " really" * ((i + seed) % 4)} for i in range(n)]
    return Dataset.from_list(rows)


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def main(spec: dict) -> None:
    loss_type = spec.get("loss_type", "sigmoid")
    args = DPOConfig(output_dir=spec["out"], max_steps=spec.get("max_steps", 3), logging_steps=1,
                     per_device_train_batch_size=spec.get("batch", 4), per_device_eval_batch_size=4,
                     gradient_accumulation_steps=spec.get("ga", 1), learning_rate=1e-3, max_length=48,
                     beta=spec.get("beta", 0.1), loss_type=[loss_type] if isinstance(loss_type, str) else loss_type,
                     loss_weights=spec.get("loss_weights"), label_smoothing=spec.get("label_smoothing", 0.0),
                     ld_alpha=spec.get("ld_alpha"), f_divergence_type=spec.get("f_divergence_type", "reverse_kl"),
                     precompute_ref_log_probs=spec.get("precompute", True),
                     eval_strategy="steps" if spec.get("eval") else "no", eval_steps=2, report_to=[],
                     disable_tqdm=True, seed=7, dataloader_drop_last=True, bf16=False, save_strategy="no")
    data = {"train_dataset": preference_dataset(32, 0)}
    if spec.get("eval"):
        data["eval_dataset"] = preference_dataset(8, 1)
    peft = lora_config() if spec.get("lora") else None
    if spec["trainer"] == "plain":
        from transformers import AutoModelForCausalLM
        from trl import DPOTrainer

        model = AutoModelForCausalLM.from_pretrained(spec["model"])
        if peft is not None:
            from peft import get_peft_model

            from train_lm import seed_like_hfpipe

            model = get_peft_model(model, peft)
            seed_like_hfpipe(model, peft)
        trainer = DPOTrainer(model, args=args, **data)
    else:
        from hfpipe.hf import PipelineDPOTrainer

        axes = {k: spec[k] for k in ("dp", "tp", "ep", "microbatches", "schedule") if k in spec}
        trainer = PipelineDPOTrainer(spec["model"], args=args, pp=spec.get("pp"), peft_config=peft, **axes, **data)
    trainer.train()
    history = trainer.state.log_history
    if spec.get("eval"):
        history = history + [trainer.evaluate()]
    trainer.save_model(f"{spec['out']}/final")
    if trainer.is_world_process_zero():
        with open(f"{spec['out']}/log_history.json", "w") as f:
            json.dump(history, f)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        main(json.load(f))
