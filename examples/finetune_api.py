"""Pipeline parallelism in an ordinary transformers training script.

    torchrun --nproc-per-node 2 examples/finetune_api.py MODEL_DIR OUT_DIR
"""

import sys

import torch
from datasets import Dataset
from transformers import AutoTokenizer, DataCollatorForLanguageModeling

from hfpipe import load_pipeline


def main(model_dir: str, out_dir: str) -> None:
    pm = load_pipeline(model_dir, schedule="1f1b", microbatches=4)  # pp = WORLD_SIZE
    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = [f"Example {i}: pipeline stages pass hidden states to each other." for i in range(64)]
    ds = Dataset.from_dict({"text": texts}).map(
        lambda b: tok(b["text"], padding="max_length", max_length=32, truncation=True),
        batched=True, remove_columns=["text"])
    collate = DataCollatorForLanguageModeling(tok, mlm=False)  # labels = ids, -100 on padding
    loader = torch.utils.data.DataLoader(ds, batch_size=8, collate_fn=collate)  # same order on all ranks

    optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-3)  # your own optimizer
    trainer = pm.trainer(optimizer, max_grad_norm=1.0)
    for step, batch in enumerate(loader):
        out = trainer.step(batch)  # loss and grad norm, identical on every rank
        if pm.dist.rank == 0:
            print(f"step {step} loss {out.loss:.4f} grad_norm {out.grad_norm:.3f}", flush=True)
    eval_loss = trainer.eval_loss(batch)
    if pm.dist.rank == 0:
        print(f"eval loss {eval_loss:.4f}", flush=True)
    pm.save_checkpoint(f"{out_dir}/checkpoints", step=len(loader), optimizer=optimizer)
    pm.save_pretrained(f"{out_dir}/hf")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
