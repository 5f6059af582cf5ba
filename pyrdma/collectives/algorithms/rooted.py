"""Gather and scatter: every rank's block of ``block`` bytes to or from ``root``.

- direct: the root exchanges with each rank in turn (n-1 messages through the root's link; the
  large-block choice, as MPI's linear gather/scatter). The root's work area holds the n blocks in
  rank order; every other rank's holds its own block at offset 0.
- read: a direct scatter whose blocks the other ranks RDMA READ from the root (it offers each
  rank its block, then waits for a message from each saying it has it): on a transport whose
  CPU does the copying (Soft-RoCE), the readers' CPUs share it instead of the root's alone, as
  UCX's rendezvous reads do; over TCP the offers carry the blocks.
- binomial: a binomial tree rooted at ``root`` (log2 n rounds; the small-block choice, as MPI's
  and NCCL's trees). Rank v of the tree (v = rank - root mod n) gathers or forwards the blocks of
  its subtree, ranks v .. v + 2^k - 1; every rank's work area holds n blocks in rank order (a
  subtree's blocks may wrap around the end).

The estimates for the cost model (``*_cost(model, block, n, max_message)``, in seconds) add the
copying of a software device (``model.copy`` per byte, 0 where a NIC moves the data): a direct
scatter's root starts every transfer, a gather's senders each their own; a tree's rounds of
doubling data follow one another; readers copy at once.
"""
import functools

from pyrdma.collectives.schedule import COPY, NONE, Builder

_cached = functools.lru_cache(maxsize=512)


def message_chunks(offset, nbytes, max_message):
    """The chunks (offset, length) of one message of ``nbytes`` bytes: at least one, possibly of
    zero bytes (so that a receiver expecting data from a sender with none finds out)."""
    if nbytes <= max_message:
        return [(offset, nbytes)]
    return [(offset + a, min(max_message, nbytes - a)) for a in range(0, nbytes, max_message)]


def _subtree_chunks(n, root, first, stop, block, max_message):
    """The chunks of the blocks of tree ranks [first, stop), in rank order in the work area."""
    chunks = []
    a, b = (first + root) % n, (stop + root) % n or n
    spans = [(a, b)] if a < b else [(a, n), (0, b)]
    for lo, hi in spans:
        if hi > lo:
            chunks += message_chunks(lo * block, (hi - lo) * block, max_message)
    return chunks


@_cached
def direct_gather(n, r, root, block, max_message):
    b = Builder()
    b.announce_root(n, r, root)
    if r == root:
        for k in range(1, n):
            p = (root + k) % n
            b.recv(p, message_chunks(p * block, block, max_message), COPY)
    else:
        b.send(root, message_chunks(0, block, max_message))
    b.heard_root(n, r, root)
    b.wait_sends()
    return b.build()


@_cached
def direct_scatter(n, r, root, block, max_message):
    b = Builder()
    b.greet_root(n, r, root)
    if r == root:
        for k in range(1, n):
            p = (root + k) % n
            b.send(p, message_chunks(p * block, block, max_message))
    else:
        b.recv(root, message_chunks(0, block, max_message), COPY)
    b.root_greeted(n, r, root)
    b.wait_sends()
    return b.build()


@_cached
def direct_scatter_part(n, r, root, block, max_message, peer, last):
    """The root's part of a direct scatter that sends ``peer``'s block from memory of its own (a
    work area holding that block at 0, as a list of pieces gives them): one run per peer, whose
    messages are those of direct_scatter to that peer; the ``last`` part takes the greeting."""
    b = Builder()
    b.send(peer, message_chunks(0, block, max_message))
    if last:
        b.root_greeted(n, r, root)
    b.wait_sends()
    return b.build()


@_cached
def read_scatter(n, r, root, block, max_message):
    b = Builder()
    b.greet_root(n, r, root)
    if r == root:
        for k in range(1, n):
            p = (root + k) % n
            b.offer(p, message_chunks(p * block, block, max_message))
        for k in range(1, n):                   # each has its block: the work area is free again
            b.recv((root + k) % n, ((0, 0, 0),), NONE)
    else:
        b.fetch(root, message_chunks(0, block, max_message))
        b.send(root, ((0, 0, 0),))
    b.root_greeted(n, r, root)
    b.wait_sends()
    return b.build()


@_cached
def binomial_gather(n, r, root, block, max_message):
    b = Builder()
    b.announce_root(n, r, root)
    v = (r - root) % n
    mask = 1
    while mask < n:
        if v & mask:
            b.send((v - mask + root) % n, _subtree_chunks(n, root, v, min(v + mask, n), block, max_message))
            break
        child = v + mask
        if child < n:
            b.recv((child + root) % n, _subtree_chunks(n, root, child, min(child + mask, n), block, max_message),
                   COPY)
        mask <<= 1
    b.heard_root(n, r, root)
    b.wait_sends()
    return b.build(result_offset=r * block)


@_cached
def binomial_scatter(n, r, root, block, max_message):
    b = Builder()
    v = (r - root) % n
    top = 1 << max(0, (n - 1).bit_length())       # the root's subtree: every tree rank
    low = v & -v if v else top
    b.greet_root(n, r, root)
    if v:
        b.recv((v - low + root) % n, _subtree_chunks(n, root, v, min(v + low, n), block, max_message), COPY)
    mask = low >> 1
    while mask:
        child = v + mask
        if child < n:
            b.send((child + root) % n, _subtree_chunks(n, root, child, min(child + mask, n), block, max_message))
        mask >>= 1
    b.root_greeted(n, r, root)
    b.wait_sends()
    return b.build(result_offset=r * block)


# ---- estimates ----------------------------------------------------------------------------------


def _direct_cost(model, block, n, max_message):
    """The root's n-1 messages are in flight together: one latency, then the root's handling of
    each message and the bytes through its link (measured on rxe, 4 ranks: direct 2.2 ms
    against binomial 4.0 ms at 32 KiB per rank, and no slower at 8 B)."""
    return model.alpha + (n - 1) * (model.messages(block, max_message) * model.overhead + block * model.beta)


def direct_gather_cost(model, block, n, max_message):
    return _direct_cost(model, block, n, max_message) + block * model.copy


def direct_scatter_cost(model, block, n, max_message):
    return _direct_cost(model, block, n, max_message) + (n - 1) * (block * model.copy)


def binomial_cost(model, block, n, max_message):
    """binomial_gather's and binomial_scatter's. Rounds of doubling subtrees, one after another:
    the root's link carries n-1 blocks in log2 n messages, and the inner ranks copy the blocks
    they forward out of their slots."""
    rounds = range(max(1, (n - 1).bit_length()))
    tree = sum(model.send((1 << k) * block, max_message) + ((1 << k) - 1) * block * model.gamma for k in rounds)
    return tree + (n - 1) * (block * model.copy)


def read_scatter_cost(model, block, n, max_message):
    """The root's offers, then the reads (one more round trip), then each rank's word that it has
    its block. Without RDMA READ (sockets) the offers are the sends of direct, and the root copies
    its buffer first (4 ranks, 128 MiB per rank over TCP: 157-319 ms against direct's 64-176)."""
    if not model.one_sided:
        return direct_scatter_cost(model, block, n, max_message) + 2 * model.alpha + (n - 1) * block * model.beta
    return 3 * model.alpha + 2 * (n - 1) * model.overhead + (n - 1) * block * model.beta + block * model.copy
