"""The algorithms, by collective and name, with what the Communicator and the cost model need to
know of each (UCC's components register themselves the same way).

    ALGORITHMS["alltoall"]["pairwise"] -> Algorithm(planner, full_area=...)

A planner returns a Schedule (schedule.py) for one rank; it never sends. ``full_area``: the
rooted copy collectives' work area holds every rank's block on every rank (the tree forwards
blocks of others), else only the root's does and the others work on their own block at offset 0.
``double_area``: the algorithm needs a work area twice the data (recursive doubling).
"""
from collections import namedtuple

from pyrdma.collectives.algorithms import ring, tree
from pyrdma.collectives.algorithms import exchange, rooted

Algorithm = namedtuple("Algorithm", "planner full_area double_area", defaults=(False, False))

ALGORITHMS = {
    "allreduce": {"ring": Algorithm(ring.allreduce), "halving_doubling": Algorithm(tree.halving_doubling_allreduce),
                  "recursive_doubling": Algorithm(tree.recursive_doubling_allreduce, double_area=True)},
    "broadcast": {"chain": Algorithm(ring.chain_broadcast), "binomial": Algorithm(tree.binomial_broadcast)},
    "reduce": {"chain": Algorithm(ring.chain_reduce), "binomial": Algorithm(tree.binomial_reduce)},
    "gather": {"direct": Algorithm(rooted.direct_gather), "binomial": Algorithm(rooted.binomial_gather, True)},
    "scatter": {"direct": Algorithm(rooted.direct_scatter), "binomial": Algorithm(rooted.binomial_scatter, True),
                "read": Algorithm(rooted.read_scatter)},
    "alltoall": {"pairwise": Algorithm(exchange.pairwise_alltoall)},
}


def names(collective):
    """The algorithm names of ``collective``, in the registry's order."""
    return tuple(ALGORITHMS[collective])


def planner(collective, name):
    return ALGORITHMS[collective][name].planner
