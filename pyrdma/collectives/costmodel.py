"""Alpha-beta(-gamma) cost model that picks a collective algorithm by message size and rank count.

    time = messages * alpha + bytes on the busiest link * beta + bytes reduced * gamma

Each algorithm's estimate is its registry entry's cost function (pyrdma.collectives.algorithms,
beside its planner); this model holds the constants and picks the cheapest (``cheapest``).

``alpha`` is the cost of one message (latency plus per-message software overhead), ``beta`` the
inverse bandwidth, ``gamma`` the inverse reduction throughput, ``overhead`` the part of alpha a rank
pays for each of several messages in flight at once (LogP's o: a direct gather's root handles
n-1 messages whose latencies overlap), ``copy`` the CPU time per byte of the rank that starts
an RDMA operation where its CPU moves the data (a software device: Soft-RoCE copies at both
ends in the poster's context; 0 where a NIC does it), all in seconds; ``one_sided``: the link
has RDMA READ (not the socket link, which sends what a read would fetch); ``lend_bytes``: the
size of a caller's buffer from which an all-to-all, gather or scatter works in it, where that is
below the Communicator's zero_copy_bytes (None: zero_copy_bytes decides; LEND_BYTES on a software
device and over TCP). Messages larger
than ``max_message`` are split, and each piece pays alpha. The estimates only need to rank the
algorithms, not predict time exactly.

Override: pass ``algorithm=`` to a collective; give the Communicator ``cost_model=CostModel(...)``
with measured constants, or a subclass with another ``choose_*``; or set the environment variable
PYRDMA_ALLREDUCE_ALGORITHM (ring, halving_doubling, recursive_doubling) for every allreduce (read
when the model is made).

choose_allreduce remembers its answer per (bytes, ranks, max_message, alpha, beta, gamma), so a
subclass whose estimates depend on anything else overrides choose_allreduce itself.
"""
import math
import os

from pyrdma.collectives import algorithms
from pyrdma.collectives.algorithms import exchange

# Per-transport defaults: (alpha, beta, gamma). Soft-RoCE and TCP on one host are latency-heavy
# (tens of microseconds per message including the Python step); a hardware NIC is ~5 us.
DEFAULTS = {
    "rdma": (10e-6, 1 / 5e9, 1 / 4e9),
    "tcp": (40e-6, 1 / 2e9, 1 / 4e9),
}
OVERHEAD_SHARE = 1 / 8         # overhead's default, a share of alpha
# copy's default on a software RDMA device: ~1.3 GB/s per core. It puts the switch of a scatter
# to the receivers' reads at ~16 KiB per rank for 4 ranks, ~32 KiB for 3, where the A/B on rxe
# found it (4 ranks: read 2.2 ms against direct 3.7-4.2 ms at 32 KiB, a tie at 4 KiB).
SOFTWARE_COPY = 0.75e-9
# On a software RDMA device an all-to-all with counts writes a pair's block from this size on, not
# from the estimate's ~40 KB: the A/B on rxe (write/pairwise, counts within 10% of the size per
# peer, median of 2 alternating rounds of 15 calls) found 2 ranks 1.05 at 48 KiB, 1.04 at 96 KiB,
# 0.98 at 128 KiB, 0.93 at 192 KiB, 0.87 at 256 KiB; 4 ranks 1.06, 1.07, 1.02, 1.01, 0.98.
SOFTWARE_WRITTEN_FROM = 192 << 10
# lend_bytes's default on a software RDMA device and over TCP: an all-to-all, gather or scatter works
# in a caller's buffer of this many bytes or more, not only from zero_copy_bytes (1 MiB), since each
# copy through the transport's buffer is CPU work beside the transport's own. Measured on rxe, 2
# ranks, per peer 32 KiB / 128 KiB, lending against copying: 0.71-0.84x the time with the same
# buffers every call, and with fresh ones (a registration per buffer and call) 1.7-2.0x at 32 KiB,
# 0.90-1.07x from 128 KiB: from there a registration pays for itself even when it is not reused.
# Over TCP (no registration), 2 ranks, one Communicator, 6 alternating rounds: 0.62-0.92x from 64
# KiB to 768 KiB per peer (all-to-all 1.0x from 256 KiB), but a 32 KiB scatter 1.12x, and on
# another machine a 64 KiB one 1.5-2x (two levels, not traced): the same 128 KiB there.
LEND_BYTES = 128 << 10


def _msgs(nbytes, max_message):
    return max(1, math.ceil(nbytes / max_message))


class CostModel:
    def __init__(self, alpha=None, beta=None, gamma=None, transport="rdma", overhead=None, copy=None,
                 software=False, lend_bytes=None):
        a, b, g = DEFAULTS.get(transport, DEFAULTS["rdma"])
        self.alpha = a if alpha is None else alpha
        self.beta = b if beta is None else beta
        self.gamma = g if gamma is None else gamma
        self.overhead = self.alpha * OVERHEAD_SHARE if overhead is None else overhead
        self.copy = (SOFTWARE_COPY if software else 0.0) if copy is None else copy
        # RDMA READ: over sockets a read is the holder's send, so a scheme of reads only adds rounds
        self.one_sided = transport != "tcp"
        self.lend_bytes = LEND_BYTES if lend_bytes is None and (software or not self.one_sided) else lend_bytes
        self._chosen = {}      # the allreduce choices made so far: the same sizes come back every step
        self._written_from = (None, None)
        # read once: looking the environment up costs more than the choice itself
        self.forced_allreduce = os.environ.get("PYRDMA_ALLREDUCE_ALGORITHM") or None

    def __repr__(self):
        return (f"CostModel(alpha={self.alpha:g}, beta={self.beta:g}, gamma={self.gamma:g}, "
                f"overhead={self.overhead:g}, copy={self.copy:g})")

    # ---- what the registry's cost functions read (algorithms/: cost(model, nbytes, n, max_message)) ----

    def messages(self, nbytes, max_message):
        """How many messages carry ``nbytes`` (at least one; each pays alpha)."""
        return _msgs(nbytes, max_message)

    def send(self, nbytes, max_message):
        """One message of ``nbytes`` to a peer: alpha for each of its pieces, beta for each byte."""
        return _msgs(nbytes, max_message) * self.alpha + nbytes * self.beta

    def copy_out(self, nbytes):
        """A receiver's copy of ``nbytes`` out of its slot into place: a memcpy, at a software
        device's copy rate (which its emulated or kernel copies share), else at about the rate of
        a reduction (gamma: as bound by memory)."""
        return nbytes * (self.copy or self.gamma)

    # ---- the choice among a collective's algorithms -------------------------------------------

    def costs(self, collective, nbytes, n, max_message):
        """{algorithm: estimate} of every algorithm of ``collective`` (its registry cost function)."""
        return {a.name: a.cost(self, nbytes, n, max_message) for a in algorithms.entries(collective)}

    def cheapest(self, collective, nbytes, n, max_message):
        """The algorithm of ``collective`` with the lowest estimate among those the registry lets
        run on ``n`` ranks (min_ranks) and this link (rdma_only), a tie to the earlier entry; one
        preferred within a factor (preferred_within: the ring) wins while its estimate stays within
        that factor."""
        entries = [a for a in algorithms.entries(collective)
                   if n >= a.min_ranks and (self.one_sided or not a.rdma_only)]
        if len(entries) == 1:
            return entries[0].name
        costs = {a.name: a.cost(self, nbytes, n, max_message) for a in entries}
        best = min(costs, key=costs.get)
        for a in entries:
            if a.preferred_within > 1 and costs[a.name] <= a.preferred_within * costs[best]:
                return a.name
        return best

    # ---- allreduce ----------------------------------------------------------------------------

    def choose_allreduce(self, nbytes, n, max_message):
        forced = self.forced_allreduce
        if forced:
            return algorithms.canonical("allreduce", forced)
        key = (nbytes, n, max_message, self.alpha, self.beta, self.gamma)
        chosen = self._chosen.get(key)
        if chosen is None:
            if len(self._chosen) >= 4096:
                self._chosen.clear()
            chosen = self._chosen[key] = self.cheapest("allreduce", nbytes, n, max_message)
        return chosen

    def choose(self, nbytes, n, max_message):
        """Coarse form of choose_allreduce: "ring" or "tree" (any of the logarithmic algorithms)."""
        return "ring" if self.choose_allreduce(nbytes, n, max_message) == "ring" else "tree"

    # ---- broadcast and reduce (the same algorithms and estimates: broadcast's entries answer) ----

    def choose_rooted(self, nbytes, n, max_message):
        return self.cheapest("broadcast", nbytes, n, max_message)

    # ---- gather, scatter and all-to-all ---------------------------------------------------------

    def choose_copy(self, kind, block, n, max_message):
        """The algorithm of a gather ("direct" or "binomial") or scatter (those or "read") of
        ``block`` bytes per rank, or of an all-to-all ("pairwise", "spread" or "write"). ``block``
        None: an all-to-all with counts, whose blocks differ per pair: "write" where the link
        writes (it writes the pairs' blocks from written_from() on and sends the others through the
        slots, as the cheapest for a small block would), else the cheapest for a small block."""
        if block is None:
            if kind == "alltoall" and self.written_from(max_message) is not None:
                return "write"
            block = 0
        return self.cheapest(kind, block, n, max_message)

    def written_from(self, max_message):
        """The smallest block an all-to-all with counts writes straight into its receiver's memory
        (exchange.written_from, on a software device from SOFTWARE_WRITTEN_FROM; None: none, as
        over TCP)."""
        key = (max_message, self.alpha, self.beta, self.gamma, self.copy, self.one_sided)
        if self._written_from[0] != key:
            least = exchange.written_from(self, max_message)
            if least is not None and self.copy:
                least = max(least, SOFTWARE_WRITTEN_FROM)
            self._written_from = (key, least)
        return self._written_from[1]
