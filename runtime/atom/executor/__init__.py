"""Tensor-parallel execution: rank 0 (the engine core) runs the scheduler and its model runner,
and ranks 1..N-1 are worker processes that run the same forward in lock-step.

protocol.py: `ModelExecutor`, the lock-step calls the engine makes on its runner (a plain
ModelRunner is the one-rank executor); executor.py: the rank-0 side of N ranks
(`MultiprocExecutor.start`); worker.py: a worker's loop; messages.py: the typed commands
between them; ranks.py: spawning and watching the workers; checks.py: which configurations
support N > 1 (torch-free, so the CLI checks before spawning).
Kept import-light: nothing but protocol.py is imported for tensor_parallel_size 1.
"""
