#!/usr/bin/env bash
# The CUDA checks issues #34 and #36 name, as one call on one GPU (an H200: the LoRA 8B case holds ~90 GiB).
# Run from the repository root with the wheels the device image lacks in .whl/ (see bench/README or the note):
#   bash bench/cuda_check.sh            (results and logs under $OUT, else /tmp/hfpipe-cuda-check)
# Part 1: the 8-layer Llama-3-8B slice (speed of eager / compiled / float8, the Trainer against PipelineTrainer,
# the plan against the peak; bf16-mixed at one replica against FSDP2's one-rank path it replaced).
# Part 2: LoRA r16 all-linear on the full 8B shape. Profiles of the compiled cases.
set -o pipefail
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
O=${OUT:-/tmp/hfpipe-cuda-check}; mkdir -p "$O/prof"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
python3 -c "import torch, transformers, torchao, peft; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'torchao', torchao.__version__, 'peft', peft.__version__)"
run() {  # PART BUDGET CASES PROFILED
  python3 bench/cuda.py --cases "$3" --budget "$2" --results "$O/$1.jsonl" --profile-dir "$O/prof" \
    --profile-cases "$4" 2>&1 | grep -v -e Warning -e "warnings.warn" -e register_constant | tee "$O/$1.log"
}
run slice "${SLICE_BUDGET:-275}" \
  plain,hfpipe-compile,hfpipe-compile-fsdp2,plain-compile,hfpipe-compile-fp8,hfpipe-compile-fp8-tensorwise,trainer,pipeline-trainer,hfpipe \
  hfpipe-compile,hfpipe-compile-fp8
run lora "${LORA_BUDGET:-235}" lora-hfpipe-mixed-compile-fp8,lora-hfpipe-mixed,lora-plain,lora-hfpipe-compile-fp8,lora-hfpipe,lora-hfpipe-ac \
  lora-hfpipe-mixed-compile-fp8
