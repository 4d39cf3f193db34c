#!/usr/bin/env bash
# The CUDA checks issues #34 and #36 name, as one call on one GPU (an H200: the LoRA 8B case holds ~90 GiB).
# Run from the repository root with the wheels the device image lacks in .whl/ (see bench/README or the note):
#   bash bench/cuda_check.sh            (results and logs under $OUT, else /tmp/hfpipe-cuda-check)
# Part 1 (slice): the 8-layer Llama-3-8B slice (speed of eager / compiled / float8, the Trainer against PipelineTrainer,
# the plan against the peak; bf16-mixed at one replica against FSDP2's one-rank path it replaced).
# Part 2 (fp8base): LoRA on an FP8 base of the 8B shape, dequantized against --fp8-recipe blockwise.
# Part 3 (lora): LoRA r16 all-linear on the full 8B shape. Profiles of the compiled cases. PARTS="slice lora" picks.
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
# Parts in order of what is still to measure; each bounded by its budget (all three: ~560 s of a 600 s call)
for part in ${PARTS:-slice fp8base lora}; do
  case $part in
  slice) run slice "${SLICE_BUDGET:-260}" \
    plain,hfpipe-compile,hfpipe-compile-fsdp2,plain-compile,hfpipe-compile-fp8,hfpipe-compile-fp8-tensorwise,trainer,pipeline-trainer,hfpipe \
    hfpipe-compile,hfpipe-compile-fp8 ;;
  # LoRA on an FP8 base (128 x 128 tiles quantized at load): dequantized per matmul, and multiplied in float8
  fp8base) run fp8base "${FP8BASE_BUDGET:-130}" \
    lora-hfpipe-fp8base,lora-hfpipe-fp8base-blockwise,lora-hfpipe-fp8base-blockwise-compile lora-hfpipe-fp8base-blockwise ;;
  lora) run lora "${LORA_BUDGET:-170}" \
    lora-hfpipe-mixed-compile-fp8,lora-hfpipe-mixed,lora-plain,lora-hfpipe-compile-fp8,lora-hfpipe,lora-hfpipe-ac \
    lora-hfpipe-mixed-compile-fp8 ;;
  esac
done
