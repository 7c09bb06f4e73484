"""Bundled BF16 fused-MoE kernels: Triton, FlashInfer CUTLASS adapter, torch CPU path, and the oracle."""
