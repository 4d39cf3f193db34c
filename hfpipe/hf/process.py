"""What a Trainer script's process needs before transformers sets it up: imported with ``hfpipe.hf``.

A script under ``torchrun`` on machines without an accelerator would otherwise open with lines that do
not apply to it: transformers' ``TrainingArguments`` takes the launched CPU world for one process per rank
and warns on every rank that the process group "is initialized, but parallel_mode !=
ParallelMode.DISTRIBUTED ... launch your script with torch.distributed.launch" (it was launched so), and
torchao (which transformers and PEFT import when it is installed) logs that its CUDA kernels do not load.
"""

from __future__ import annotations

import os

from hfpipe.progress.logs import quiet_import_noise

__all__ = ["prepare_process"]


def prepare_process() -> None:
    """Quiet the import noise (:data:`hfpipe.progress.logs.IMPORT_NOISE`) and, in a launched world without an
    accelerator, tell transformers and accelerate it is a CPU world (``ACCELERATE_USE_CPU``, which both read),
    as :func:`hfpipe.hf.options.see_the_world` would make them see it later anyway."""
    quiet_import_noise(os.environ.get("HFPIPE_LOG_LEVEL") or "INFO")
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1 and "ACCELERATE_USE_CPU" not in os.environ:
        import torch  # here: `import hfpipe.hf` alone stays light where no world was launched

        if not torch.accelerator.is_available():
            os.environ["ACCELERATE_USE_CPU"] = "true"
