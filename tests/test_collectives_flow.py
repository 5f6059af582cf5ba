"""Flow control of the collective algorithms, on the host: an in-process transport that counts
credits exactly like RdmaTransport (``slots`` receive slots per peer, a send waits for a free one)
runs every algorithm with one rank per thread. A credit cycle shows up here as a timeout, in
seconds and without a VM."""
import threading

import numpy as np
import pytest

from flowmodel import execute

from pyrdma.collectives.algorithms import ring, tree
from pyrdma.collectives.schedule import consumer
from pyrdma.errors import RDMATimeoutError

TIMEOUT = 10.0


class _World:
    def __init__(self, size, slots):
        self.size, self.slots = size, slots
        self.cond = threading.Condition()
        self.queues = {(a, b): [] for a in range(size) for b in range(size) if a != b}   # a -> b
        self.credits = {(a, b): slots for a in range(size) for b in range(size) if a != b}


class CreditTransport:
    """Messages are copied on send; a slot is returned (a credit) on release."""

    def __init__(self, world, rank, max_message, send_window=1):
        self.w, self.rank, self.size, self.max_message = world, rank, world.size, max_message
        self.send_window = send_window
        self.work = np.zeros(0, np.uint8)
        self.held = {}
        self.events = []         # "send" and "release", in order

    def buffer(self, nbytes):
        if self.work.nbytes < nbytes:
            self.work = np.zeros(max(64, nbytes), np.uint8)
        return self.work

    def set_tag(self, tag):
        pass

    def _wait(self, ready, what):
        if not self.w.cond.wait_for(ready, timeout=TIMEOUT):
            raise RDMATimeoutError(f"rank {self.rank} waited {TIMEOUT} s for {what}")

    def can_send(self, peer):
        with self.w.cond:
            return self.w.credits[(self.rank, peer)] > 0

    def send(self, peer, offset, nbytes):
        assert nbytes <= self.max_message
        key = (self.rank, peer)
        with self.w.cond:
            self._wait(lambda: self.w.credits[key] > 0, f"a credit from rank {peer}")
            self.w.credits[key] -= 1
            self.w.queues[key].append(self.work[offset:offset + nbytes].copy())
            self.w.cond.notify_all()
        self.events.append("send")

    def recv(self, peer, nbytes):
        q = self.w.queues[(peer, self.rank)]
        with self.w.cond:
            self._wait(lambda: len(q) > 0, f"a message from rank {peer}")
            data = q.pop(0)
        assert data.nbytes == nbytes, (data.nbytes, nbytes)
        self.held[peer] = data
        return data

    def release(self, peer):
        self.events.append("release")
        del self.held[peer]
        with self.w.cond:
            self.w.credits[(peer, self.rank)] += 1
            self.w.cond.notify_all()

    def wait_sends(self, peer=None):
        pass


def _add(dst, a, b):
    np.add(a.view(np.int64), b.view(np.int64), out=dst.view(np.int64))


def _run(size, slots, max_message, count, body, send_window=1, events=None):
    world = _World(size, slots)
    results, errors = [None] * size, []

    def rank_main(r):
        t = CreditTransport(world, r, max_message, send_window)
        work = t.buffer(2 * count * 8)
        work[:count * 8] = (np.arange(count, dtype=np.int64) * (r + 1)).view(np.uint8)
        try:
            at = body(t, count) or 0      # an allreduce may leave its result further in the buffer
            results[r] = t.buffer(0)[at:at + count * 8].view(np.int64).copy()
            if events is not None:
                events[r] = t.events
        except Exception as exc:   # noqa: BLE001 - reported below with the rank
            errors.append((r, exc))
    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(size)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(TIMEOUT * 3)
    assert not any(th.is_alive() for th in threads), "a rank is still running"
    assert not errors, errors
    return results


def _execute(t, plan):
    """Run a schedule with the Python model of the engine; returns where the result lies."""
    execute(t, plan, consumer(t.buffer(0), _add))
    return plan.result_offset


ALLREDUCES = {
    name: (lambda t, count, planner=planner: _execute(t, planner(t.size, t.rank, count, 8, t.max_message)))
    for name, planner in [("ring", ring.allreduce), ("halving_doubling", tree.halving_doubling_allreduce),
                          ("recursive_doubling", tree.recursive_doubling_allreduce)]
}


@pytest.mark.parametrize("algorithm", sorted(ALLREDUCES))
@pytest.mark.parametrize("slots,window", [(1, 1), (2, 1), (3, 1), (3, 3), (8, 8)])
@pytest.mark.parametrize("size", [2, 3, 4, 5])
def test_allreduce_flows_with_few_receive_slots(algorithm, slots, window, size):
    # A send copies the chunk when posted: one that ran ahead of a reduction it depends on would
    # carry stale data and show here as a wrong sum.
    count = 1001                       # 64-byte messages: many chunks per step
    results = _run(size, slots, 64, count, ALLREDUCES[algorithm], send_window=window)
    expected = np.arange(count, dtype=np.int64) * (size * (size + 1) // 2)
    for r, got in enumerate(results):
        assert np.array_equal(got, expected), (algorithm, slots, window, size, r)


@pytest.mark.parametrize("window,ahead", [(1, 2), (2, 3), (4, 4), (8, 4)])
def test_sends_run_ahead_of_the_reduction_up_to_the_window(window, ahead):
    # 2 ranks, 4 chunks per segment, 4 credits: before its first reduction a rank has posted
    # chunk 0 and up to ``window`` more of the 4 it has to send
    events = [None, None]
    count = 64                          # 2 x 32 elements = 256 bytes per segment, 64-byte messages
    _run(2, 4, 64, count, ALLREDUCES["ring"], send_window=window, events=events)
    for ev in events:
        assert ev.index("release") == ahead, ev
        assert ev.count("send") == 8 and ev.count("release") == 8


@pytest.mark.parametrize("slots", [1, 2])
def test_rooted_and_barrier_flow_with_one_slot(slots):
    size, count = 4, 333

    def body(t, count):
        n, r, m = t.size, t.rank, t.max_message
        for planner, root in [(tree.binomial_broadcast, 1), (ring.chain_broadcast, 2), (ring.chain_reduce, 3),
                              (ring.chain_broadcast, 3), (tree.binomial_reduce, 0), (tree.binomial_broadcast, 0)]:
            _execute(t, planner(n, r, count, 8, m, root))
        _execute(t, tree.dissemination_barrier(n, r))
        _execute(t, tree.dissemination_barrier(n, r))
    results = _run(size, slots, 64, count, body)
    # rank 1's data (2x) goes to all, two reductions of 4 copies each make it 2 * 4 * 4
    for got in results:
        assert np.array_equal(got, np.arange(count, dtype=np.int64) * 32)


@pytest.mark.parametrize("algorithm", sorted(ALLREDUCES))
@pytest.mark.parametrize("size", [3, 4])
def test_repeated_sizes_reuse_the_cached_steps_correctly(algorithm, size):
    # Chunks and steps are computed once per (size, count, max_message) and reused: alternating
    # shapes, each seen again later, must still give every rank the exact sum.
    for count, max_message in [(1001, 64), (1001, 128), (3, 64), (1001, 64), (40, 8), (3, 64), (1001, 128)]:
        results = _run(size, 2, max_message, count, ALLREDUCES[algorithm], send_window=2)
        expected = np.arange(count, dtype=np.int64) * (size * (size + 1) // 2)
        for r, got in enumerate(results):
            assert np.array_equal(got, expected), (algorithm, size, count, max_message, r)
