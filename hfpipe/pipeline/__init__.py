"""The pipeline: stage modules built from transformers classes, their shard-by-shard load, the schedules that run them, and the last stage's loss."""
