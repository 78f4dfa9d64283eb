"""Attention kernels over the paged KV cache: a torch reference and Triton kernels for CUDA."""
