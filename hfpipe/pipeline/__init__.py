"""The pipeline: stage modules built from transformers classes, their shard-by-shard load, and the schedules that run them (handed the last stage's loss by hfpipe.loss)."""
