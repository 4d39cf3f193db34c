"""One TRL SFT script on a chat dataset (the tokenizer's own chat template, completion_only_loss), run in
one process with ``SFTTrainer`` (the oracle) or under torchrun with hfpipe's ``PipelineSFTTrainer``.

    python train_sft.py SPEC.json   # SPEC keys: model, out, trainer ("plain"/"pipeline"), pp, cp, pad_to, lora
"""

import json
import sys

from datasets import Dataset
from trl import SFTConfig


def chat_dataset(n: int) -> Dataset:
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} plus {i % 3}?"}],
             "completion": [{"role": "assistant", "content": f"{i} plus {i % 3} is {i + i % 3}." * (1 + i % 2)}]}
            for i in range(n)]
    return Dataset.from_list(rows)


def main(spec: dict) -> None:
    args = SFTConfig(output_dir=spec["out"], max_steps=3, logging_steps=1, per_device_train_batch_size=4,
                     per_device_eval_batch_size=4, learning_rate=1e-3, max_length=64, completion_only_loss=True,
                     eval_strategy="steps", eval_steps=2, report_to=[], disable_tqdm=True, seed=7,
                     dataloader_drop_last=True, bf16=False, pad_to_multiple_of=spec.get("pad_to"))
    data = {"train_dataset": chat_dataset(32), "eval_dataset": chat_dataset(8)}
    if spec["trainer"] == "plain":
        from trl import SFTTrainer

        trainer = SFTTrainer(spec["model"], args=args, **data)
    else:
        from hfpipe.hf import PipelineSFTTrainer

        trainer = PipelineSFTTrainer(spec["model"], args=args, pp=spec.get("pp"), cp=spec.get("cp", 1), **data)
    trainer.train()
    history = trainer.state.log_history + [trainer.evaluate()]
    trainer.save_model(f"{spec['out']}/final")
    if trainer.is_world_process_zero():
        with open(f"{spec['out']}/log_history.json", "w") as f:
            json.dump(history, f)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        main(json.load(f))
