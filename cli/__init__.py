"""The hfpipe command line (installed as ``hfpipe.cli``; the ``hfpipe`` console script)."""
