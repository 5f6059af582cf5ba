"""Alpha-beta(-gamma) cost model that picks a collective algorithm by message size and rank count.

    time = messages * alpha + bytes on the busiest link * beta + bytes reduced * gamma

``alpha`` is the cost of one message (latency plus per-message software overhead), ``beta`` the
inverse bandwidth, ``gamma`` the inverse reduction throughput, ``overhead`` the part of alpha a rank
pays for each of several messages in flight at once (LogP's o: a direct gather's root handles
n-1 messages whose latencies overlap), ``copy`` the CPU time per byte of the rank that starts
an RDMA operation where its CPU moves the data (a software device: Soft-RoCE copies at both
ends in the poster's context; 0 where a NIC does it), all in seconds. Messages larger
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

ALLREDUCE_ALGORITHMS = algorithms.names("allreduce")
ROOTED_ALGORITHMS = algorithms.names("broadcast")          # broadcast and reduce
ALIASES = {"tree": "halving_doubling", "hd": "halving_doubling", "rd": "recursive_doubling"}

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


def _msgs(nbytes, max_message):
    return max(1, math.ceil(nbytes / max_message))


class CostModel:
    def __init__(self, alpha=None, beta=None, gamma=None, transport="rdma", overhead=None, copy=None,
                 software=False):
        a, b, g = DEFAULTS.get(transport, DEFAULTS["rdma"])
        self.alpha = a if alpha is None else alpha
        self.beta = b if beta is None else beta
        self.gamma = g if gamma is None else gamma
        self.overhead = self.alpha * OVERHEAD_SHARE if overhead is None else overhead
        self.copy = (SOFTWARE_COPY if software else 0.0) if copy is None else copy
        self._chosen = {}      # the allreduce choices made so far: the same sizes come back every step
        # read once: looking the environment up costs more than the choice itself
        self.forced_allreduce = os.environ.get("PYRDMA_ALLREDUCE_ALGORITHM") or None

    def __repr__(self):
        return (f"CostModel(alpha={self.alpha:g}, beta={self.beta:g}, gamma={self.gamma:g}, "
                f"overhead={self.overhead:g}, copy={self.copy:g})")

    def _send(self, nbytes, max_message):
        return _msgs(nbytes, max_message) * self.alpha + nbytes * self.beta

    def _fold(self, nbytes, n, max_message):
        """Extra cost of a non-power-of-two rank count: fold in, and hand the result back."""
        p = 1 << (n.bit_length() - 1)
        return 0.0 if p == n else 2 * self._send(nbytes, max_message) + nbytes * self.gamma

    # ---- allreduce ----------------------------------------------------------------------------

    def ring(self, nbytes, n, max_message):
        seg = nbytes / n
        return 2 * (n - 1) * self._send(seg, max_message) + (n - 1) * seg * self.gamma

    def halving_doubling(self, nbytes, n, max_message):
        p = 1 << (n.bit_length() - 1)
        steps = p.bit_length() - 1
        t, part = 0.0, nbytes
        for _ in range(steps):
            part /= 2
            t += 2 * self._send(part, max_message) + part * self.gamma
        return t + self._fold(nbytes, n, max_message)

    def recursive_doubling(self, nbytes, n, max_message):
        p = 1 << (n.bit_length() - 1)
        steps = p.bit_length() - 1
        return steps * (self._send(nbytes, max_message) + nbytes * self.gamma) + self._fold(nbytes, n, max_message)

    def allreduce_costs(self, nbytes, n, max_message):
        return {name: getattr(self, name)(nbytes, n, max_message) for name in ALLREDUCE_ALGORITHMS}

    def choose_allreduce(self, nbytes, n, max_message):
        forced = self.forced_allreduce
        if forced:
            return ALIASES.get(forced, forced)
        key = (nbytes, n, max_message, self.alpha, self.beta, self.gamma)
        chosen = self._chosen.get(key)
        if chosen is None:
            if len(self._chosen) >= 4096:
                self._chosen.clear()
            chosen = self._chosen[key] = self._cheapest_allreduce(nbytes, n, max_message)
        return chosen

    def _cheapest_allreduce(self, nbytes, n, max_message):
        if n <= 1:
            return "ring"
        costs = self.allreduce_costs(nbytes, n, max_message)
        best = min(ALLREDUCE_ALGORITHMS, key=lambda a: costs[a])
        # near-ties go to the ring: neighbour-only traffic, steadier pipelining on real fabrics
        return "ring" if costs["ring"] <= 1.05 * costs[best] else best

    def choose(self, nbytes, n, max_message):
        """Coarse form of choose_allreduce: "ring" or "tree" (any of the logarithmic algorithms)."""
        return "ring" if self.choose_allreduce(nbytes, n, max_message) == "ring" else "tree"

    # ---- broadcast and reduce -----------------------------------------------------------------

    def chain(self, nbytes, n, max_message):
        k = _msgs(nbytes, max_message)
        return (n - 1 + k - 1) * self._send(nbytes / k, max_message)

    def binomial(self, nbytes, n, max_message):
        # depth d = ceil(log2 n) rounds for one chunk; pipelined, the root sends each of the k
        # chunks to up to d children, so its link carries d copies of the data.
        depth = max(1, math.ceil(math.log2(n)))
        k = _msgs(nbytes, max_message)
        return k * depth * self._send(nbytes / k, max_message)

    def choose_rooted(self, nbytes, n, max_message):
        if n <= 2:
            return "chain"
        return "binomial" if self.binomial(nbytes, n, max_message) < self.chain(nbytes, n, max_message) else "chain"

    # ---- gather and scatter ---------------------------------------------------------------------

    def direct(self, block, n, max_message):
        """The root's n-1 messages are in flight together: one latency, then the root's handling of
        each message and the bytes through its link (measured on rxe, 4 ranks: direct 2.2 ms
        against binomial 4.0 ms at 32 KiB per rank, and no slower at 8 B)."""
        return self.alpha + (n - 1) * (_msgs(block, max_message) * self.overhead + block * self.beta)

    def binomial_tree(self, block, n, max_message):
        """Rounds of doubling subtrees, one after another: the root's link carries n-1 blocks in
        log2 n messages, and the inner ranks copy the blocks they forward out of their slots."""
        rounds = range(max(1, (n - 1).bit_length()))
        return sum(self._send((1 << k) * block, max_message) + ((1 << k) - 1) * block * self.gamma for k in rounds)

    def read(self, block, n, max_message):
        """A scatter whose ranks read their blocks: the root's offers, then the reads (one more
        round trip), then each rank's word that it has its block."""
        return 3 * self.alpha + 2 * (n - 1) * self.overhead + (n - 1) * block * self.beta

    def copy_costs(self, kind, block, n, max_message):
        """{algorithm: estimate} of a gather or scatter of ``block`` bytes per rank, with the
        copying of a software device: a direct scatter's root starts every transfer, a gather's
        senders each their own; a tree's rounds of doubling data follow one another; readers copy
        at once."""
        c = block * self.copy
        costs = {"direct": self.direct(block, n, max_message) + ((n - 1) * c if kind == "scatter" else c),
                 "binomial": self.binomial_tree(block, n, max_message) + (n - 1) * c}
        if kind == "scatter":
            costs["read"] = self.read(block, n, max_message) + c
        return costs

    def choose_copy(self, kind, block, n, max_message):
        """The algorithm of a gather ("direct" or "binomial") or scatter (those or "read") of
        ``block`` bytes per rank; all-to-all has one ("pairwise")."""
        if kind == "alltoall":
            return "pairwise"
        if n <= 2:
            return "direct"
        costs = self.copy_costs(kind, block, n, max_message)
        return min(costs, key=costs.get)          # a tie goes to the first, direct
