"""LoRA under the pipeline: PEFT's own adapters on each stage module (:mod:`hfpipe.lora.adapters`) and
PEFT adapter folders for generate and verify (:mod:`hfpipe.lora.folder`)."""
