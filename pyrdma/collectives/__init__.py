"""Collectives over RDMA: pipelined ring and tree allreduce, reduce, broadcast, allgather,
reduce_scatter and barrier on numpy (and CuPy) buffers. See Communicator."""
from pyrdma.collectives.algorithms import CostModel
from pyrdma.collectives.communicator import ALGORITHMS, OPS, Communicator, Handle, init_from_env

__all__ = ["Communicator", "Handle", "CostModel", "init_from_env", "OPS", "ALGORITHMS"]
