"""Collectives over RDMA (or TCP): allreduce (ring, halving-doubling, recursive doubling), reduce,
broadcast, allgather, reduce_scatter and barrier on numpy and buffer-protocol arrays, blocking and
non-blocking. Start with ``Communicator`` or ``init_from_env()``.

Layers, gloo-style: ``communicator`` (the API) runs algorithms (``algorithms``: ``ring``,
``tree``, ``rooted``, ``exchange``, each registered with its cost function and wire id, picked by
``costmodel``) that talk only to a transport (``transport``: RdmaTransport, TcpTransport);
``bootstrap`` does the rendezvous; ``pyrdma._reduce`` holds the C reduction kernels.
"""
from pyrdma.collectives.bootstrap import MPIExchange, TCPStore, env_config
from pyrdma.collectives.communicator import (ALGORITHMS, OPS, TRANSPORTS, Communicator, Handle, init_from_env,
                                             init_from_mpi, rdma_available)
from pyrdma.collectives.costmodel import CostModel
from pyrdma.collectives.pieces import segment_bounds
from pyrdma.collectives.transport import RdmaTransport, TcpTransport

__all__ = ["Communicator", "Handle", "init_from_env", "init_from_mpi", "rdma_available", "CostModel",
           "TCPStore", "MPIExchange", "env_config", "RdmaTransport", "TcpTransport", "segment_bounds",
           "OPS", "ALGORITHMS", "TRANSPORTS"]
