"""The run configuration (FinetuneConfig), its checks, and the checks of command options shared by several commands."""
