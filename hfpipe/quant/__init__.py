"""A LoRA run's frozen base kept quantized on the device (``--quantize-base nf4|fp8``)."""
