"""The algorithms, by collective and name: everything the specs, the cost model and the wire need
to know of each, in one entry (UCC's components register themselves the same way).

    ALGORITHMS["alltoall"]["pairwise"] -> Algorithm(name, planner, cost, wire_id, ...)

Adding an algorithm is a planner and its cost function in a module here and one entry below;
tests/test_algorithm_registry.py then runs its schedules against each other and checks that the
cost model and the specs choose by its cost function.

An entry carries:

- ``name`` and ``aliases`` (other names a caller may pass: ``algorithm="tree"``);
- ``planner``: returns a Schedule (schedule.py) for one rank; it never sends;
- ``cost(model, nbytes, n, max_message)``: the estimate in seconds that the cost model
  (costmodel.CostModel, whose alpha, beta, gamma, overhead, copy, ``send`` and ``messages`` it
  reads) compares among the collective's algorithms; ``nbytes`` is what the collective's choice is
  made on (a gather's or scatter's: the block of one rank);
- ``wire_id``: the byte every message's description carries for it (transport.describe), so ranks
  that picked different algorithms find out. Fixed: never renumbered or reused, or ranks of two
  versions would misread each other. 0: the description names no algorithm (allgather and
  reduce_scatter, whose one algorithm it never named). One name, one id, across collectives;
- properties: ``full_area``: the rooted copy collectives' work area holds every rank's block on
  every rank (the tree forwards blocks of others), else only the root's does and the others work
  on their own block at offset 0. ``double_area``: the algorithm needs a work area twice the data
  (recursive doubling); ``in_place_instead`` names the algorithm that runs where the caller's
  memory is the work area. ``min_ranks``: the cost model considers it from that many ranks on
  (below, the first entry does the same or better). ``preferred_within``: the cost model still
  picks it while its estimate is within that factor of the cheapest (the ring's neighbour-only
  traffic pipelines more steadily on real fabrics than the estimates say). ``rdma_only``: its
  schedule writes into peers' memory (RDMA WRITE), which the socket link cannot: the cost model
  never picks it over TCP, and the engine refuses it there.

The order within a collective is the registry's: names() lists it, and the cost model gives a tie
to the earlier entry.
"""
from collections import namedtuple

from pyrdma.collectives.algorithms import exchange, ring, rooted, tree

_FIELDS = "name planner cost wire_id aliases full_area double_area in_place_instead min_ranks preferred_within " \
    "rdma_only"


class Algorithm(namedtuple("Algorithm", _FIELDS, defaults=((), False, False, None, 1, 1.0, False))):
    __slots__ = ()

    @property
    def wire_name(self):
        """The algorithm as transport.describe takes it: the name, or "" where the wire names none."""
        return self.name if self.wire_id else ""


def _by_name(*entries):
    return {a.name: a for a in entries}


ALGORITHMS = {
    "allreduce": _by_name(
        Algorithm("ring", ring.allreduce, ring.allreduce_cost, 1, preferred_within=1.05),
        Algorithm("halving_doubling", tree.halving_doubling_allreduce, tree.halving_doubling_cost, 2,
                  aliases=("tree", "hd"), min_ranks=2),
        Algorithm("recursive_doubling", tree.recursive_doubling_allreduce, tree.recursive_doubling_cost, 3,
                  aliases=("rd",), double_area=True, in_place_instead="halving_doubling", min_ranks=2)),
    "broadcast": _by_name(Algorithm("chain", ring.chain_broadcast, ring.chain_cost, 4),
                          Algorithm("binomial", tree.binomial_broadcast, tree.binomial_cost, 5, min_ranks=3)),
    "reduce": _by_name(Algorithm("chain", ring.chain_reduce, ring.chain_cost, 4),
                       Algorithm("binomial", tree.binomial_reduce, tree.binomial_cost, 5, min_ranks=3)),
    "allgather": _by_name(Algorithm("ring", ring.allgather, ring.allgather_cost, 0)),
    "reduce_scatter": _by_name(Algorithm("ring", ring.reduce_scatter, ring.reduce_scatter_cost, 0)),
    "barrier": _by_name(Algorithm("dissemination", tree.dissemination_barrier, tree.dissemination_cost, 6)),
    "gather": _by_name(Algorithm("direct", rooted.direct_gather, rooted.direct_gather_cost, 7),
                       Algorithm("binomial", rooted.binomial_gather, rooted.binomial_cost, 5, full_area=True,
                                 min_ranks=3)),
    "scatter": _by_name(Algorithm("direct", rooted.direct_scatter, rooted.direct_scatter_cost, 7),
                        Algorithm("binomial", rooted.binomial_scatter, rooted.binomial_cost, 5, full_area=True,
                                  min_ranks=3),
                        Algorithm("read", rooted.read_scatter, rooted.read_scatter_cost, 9, min_ranks=3)),
    "alltoall": _by_name(Algorithm("pairwise", exchange.pairwise_alltoall, exchange.pairwise_alltoall_cost, 8),
                         Algorithm("spread", exchange.spread_alltoall, exchange.spread_alltoall_cost, 10,
                                   min_ranks=3),
                         Algorithm("write", exchange.write_alltoall, exchange.write_alltoall_cost, 11,
                                   rdma_only=True)),
}


def _wire_names():
    """The names by wire id ("" for 0), checked: one id per name, no id left out."""
    by_id = {}
    for collective, entries in ALGORITHMS.items():
        for a in entries.values():
            if a.wire_id and by_id.setdefault(a.wire_id, a.name) != a.name:
                raise RuntimeError(f"wire id {a.wire_id} of {collective}'s {a.name!r} is {by_id[a.wire_id]!r}'s")
    table = ("",) + tuple(by_id.get(i) for i in range(1, max(by_id) + 1))
    if None in table or len(set(table)) != len(table):
        raise RuntimeError(f"the wire ids leave gaps or give a name two ids: {table}")
    return table


WIRE_NAMES = _wire_names()       # transport.describe's table: index = wire id


def entries(collective):
    """The Algorithms of ``collective``, in the registry's order."""
    return tuple(ALGORITHMS[collective].values())


def names(collective):
    """The algorithm names of ``collective``, in the registry's order."""
    return tuple(ALGORITHMS[collective])


_ALIASES = {collective: {alias: a.name for a in entries.values() for alias in a.aliases}
            for collective, entries in ALGORITHMS.items()}


def aliases(collective):
    """{alias: name} of ``collective``'s algorithms."""
    return dict(_ALIASES[collective])


def canonical(collective, name):
    """The name ``name`` stands for among ``collective``'s algorithms (an alias's algorithm), or
    ``name`` itself (checked by the caller)."""
    return _ALIASES[collective].get(name, name)


def only(collective):
    """The one Algorithm of a collective that has one (allgather, reduce_scatter, barrier)."""
    algorithm, = ALGORITHMS[collective].values()
    return algorithm
