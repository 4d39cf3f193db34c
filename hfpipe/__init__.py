"""hfpipe: pipeline-parallel fine-tuning of Hugging Face decoder models."""

__version__ = "0.1.0"
