"""Command-line jobs: ``dpkern finetune`` (the main job) and ``dpkern compare``."""
