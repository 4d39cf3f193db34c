"""hfpipe: pipeline-parallel fine-tuning of Hugging Face decoder models, exactly equal to transformers."""

__version__ = "0.1.0"

__all__ = ["__version__", "load_pipeline", "plan_pipeline", "PipelineModel"]


def __getattr__(name):
    # Lazy: `import hfpipe` (and the CLI's --help) stays fast; torch loads on first use.
    if name in ("load_pipeline", "PipelineModel"):
        import os

        from hfpipe.progress.logs import quiet_import_noise

        quiet_import_noise(os.environ.get("HFPIPE_LOG_LEVEL") or "INFO")  # before transformers imports torchao
        from hfpipe import api

        return getattr(api, name)
    if name == "plan_pipeline":
        from hfpipe.plan.split import plan_pipeline

        return plan_pipeline
    raise AttributeError(f"module 'hfpipe' has no attribute {name!r}")
