"""cnnpipe: a reproducible, profiler-guided image-classification training pipeline."""

__version__ = "0.1.0"
