"""ckptd: transparent checkpoint/restart for long-running training jobs."""

__version__ = "0.1.0"
