"""Tensor parallelism across the GPUs of one host (gloo on the CPU): process groups,
collectives as registered ops, and the NCCL watchdog drain the capture flow needs."""
