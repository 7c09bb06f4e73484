"""moe-eval: accuracy-regression harness for BF16 Mixture-of-Experts kernels."""

__version__ = "0.1.0"
