"""Megatron-core backend: weight conversion (CPU-testable); training and generation need CUDA."""
