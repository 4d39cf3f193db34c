"""A TRL SFT script on a chat dataset, pipelined: two lines differ from the one-process script.

    torchrun --nproc-per-node 2 examples/trl_sft.py MODEL_DIR OUT_DIR
"""

import sys

from datasets import Dataset
from peft import LoraConfig
from trl import SFTConfig

from hfpipe.hf import PipelineSFTTrainer  # was: from trl import SFTTrainer


def main(model_dir: str, out_dir: str) -> None:
    ds = Dataset.from_list([
        {"prompt": [{"role": "user", "content": f"What is {i} plus {i}?"}],
         "completion": [{"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}]} for i in range(64)])
    # bf16=False: SFTConfig defaults to bf16, which TRL refuses on a machine without a GPU (drop it on one)
    args = SFTConfig(output_dir=out_dir, max_steps=8, per_device_train_batch_size=4, learning_rate=1e-3,
                     logging_steps=2, max_length=64, completion_only_loss=True, bf16=False, report_to=[])
    trainer = PipelineSFTTrainer(model_dir, args=args, pp=2,  # was: SFTTrainer(model_dir, args=args,
                                 train_dataset=ds, peft_config=LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    trainer.train()
    trainer.save_model(f"{out_dir}/adapter")  # a PEFT adapter folder


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
