"""Pipeline parallelism in an ordinary transformers training script.

    torchrun --nproc-per-node 2 examples/finetune_api.py MODEL_DIR OUT_DIR
"""

import sys

import torch
from datasets import Dataset
from transformers import AutoTokenizer, DataCollatorForLanguageModeling, get_linear_schedule_with_warmup

from hfpipe import load_pipeline


def main(model_dir: str, out_dir: str) -> None:
    pm = load_pipeline(model_dir, schedule="1f1b", microbatches=4)  # pp = WORLD_SIZE
    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = [f"Example {i}: pipeline stages pass hidden states to each other." for i in range(70)]
    ds = Dataset.from_dict({"text": texts}).map(
        lambda b: tok(b["text"], padding="max_length", max_length=32, truncation=True),
        batched=True, remove_columns=["text"])
    train, held_out = ds.select(range(62)), ds.select(range(62, 70))  # evaluate on rows never trained on
    collate = DataCollatorForLanguageModeling(tok, mlm=False)  # labels = ids, -100 on padding
    # same order on all ranks; the last batch holds 6 rows, which hfpipe trains exactly too
    loader = torch.utils.data.DataLoader(train, batch_size=8, collate_fn=collate)

    optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-3)  # your own optimizer and scheduler
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=len(loader))
    trainer = pm.trainer(optimizer, scheduler=scheduler, max_grad_norm=1.0)
    for step, batch in enumerate(loader):
        out = trainer.step(batch)  # loss and grad norm, identical on every rank
        if pm.dist.rank == 0:
            print(f"step {step} loss {out.loss:.4f} grad_norm {out.grad_norm:.3f}", flush=True)
    eval_loss = trainer.eval_loss(list(torch.utils.data.DataLoader(held_out, batch_size=4, collate_fn=collate)))
    if pm.dist.rank == 0:
        print(f"eval loss {eval_loss:.4f}", flush=True)
    pm.save_checkpoint(f"{out_dir}/checkpoints", step=len(loader), optimizer=optimizer, scheduler=scheduler)
    pm.save_pretrained(f"{out_dir}/hf", overwrite=True)  # replaces the export of an earlier run


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
