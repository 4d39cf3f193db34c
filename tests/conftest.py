import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # spawned workers import helpers from here too
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
