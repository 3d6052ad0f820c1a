"""Tensor parallelism across processes on one machine.

comm.py: the rank group (gloo process group, shared-memory all-reduce); sharding.py: which
slice of each checkpoint tensor a rank reads; executor.py: rank 0's worker processes and the
worker loop.
"""
