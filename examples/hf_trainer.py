"""A plain transformers Trainer script, pipelined: two lines differ from the one-process script.

    torchrun --nproc-per-node 2 examples/hf_trainer.py MODEL_DIR OUT_DIR
"""

import sys

from datasets import Dataset
from transformers import AutoTokenizer, DataCollatorForLanguageModeling, TrainingArguments

from hfpipe.hf import PipelineTrainer  # was: from transformers import AutoModelForCausalLM, Trainer


def main(model_dir: str, out_dir: str) -> None:
    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = [f"Example {i}: pipeline stages pass hidden states to each other." for i in range(64)]
    ds = Dataset.from_dict({"text": texts}).map(
        lambda b: tok(b["text"], truncation=True, max_length=32), batched=True, remove_columns=["text"])
    args = TrainingArguments(output_dir=out_dir, max_steps=8, per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, learning_rate=1e-3, logging_steps=2,
                             save_steps=4, save_total_limit=1, report_to=[])
    trainer = PipelineTrainer(model_dir, args=args, pp=2, microbatches=2,  # was: Trainer(model=model, args=args,
                              train_dataset=ds, processing_class=tok,
                              data_collator=DataCollatorForLanguageModeling(tok, mlm=False))
    trainer.train()  # checkpoint-4, checkpoint-8 (hfpipe's DCP checkpoint inside); resume_from_checkpoint= resumes
    trainer.save_model(f"{out_dir}/hf")  # an HF folder from_pretrained loads


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
