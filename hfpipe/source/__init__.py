"""Where a model comes from: the local folder or hub cache, and the safetensors files in it."""
