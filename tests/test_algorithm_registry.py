"""The algorithm registry (pyrdma.collectives.algorithms) is the one place an algorithm is known:
every entry's planner plans a schedule that runs to its end on every rank, its cost function is the
estimate the cost model and the specs choose by, and its wire id is the byte the descriptions carry.
Everything is read from the registry, so an entry added to a collective is checked here as it is.
(The choices themselves, over a grid: test_collectives_bootstrap.py; the wire ids pinned: ditto.)"""
import types

import pytest

from pyrdma.collectives import algorithms, specs
from pyrdma.collectives.costmodel import CostModel
from pyrdma.collectives.pieces import segment_bounds
from pyrdma.collectives.schedule import ASK, EXCHANGE, FETCH, LANDED, NOTICE, OFFER, PUT, SPREAD, WAIT_SENDS
from pyrdma.collectives.transport import describe, explain
from pyrdma.errors import UsageError

# ---- every planner: a schedule that pairs its messages and runs to its end ---------------------

_REDUCING = ("allreduce", "reduce", "reduce_scatter")


def _uneven(n, count):
    """An all-to-all's (send bounds, receive bounds) per rank, in bytes: rank s sends rank d
    (s + 2d + count) % 5 bytes, zeros included."""
    size = [[(s + 2 * d + count) % 5 for d in range(n)] for s in range(n)]

    def bounds(row):
        out = [0]
        for b in row:
            out.append(out[-1] + b)
        return tuple(out)
    return [(bounds(size[r]), bounds([size[s][r] for s in range(n)])) for r in range(n)]


def _plans(collective, entry, n, count, itemsize, max_message):
    """[(label, [(schedule, work area bytes) of each rank])] of ``entry``'s planner, called as the
    specs call it for ``collective``."""
    plan, nbytes = entry.planner, count * itemsize
    if collective == "allreduce":
        area = (2 if entry.double_area else 1) * nbytes
        return [("", [(plan(n, r, count, itemsize, max_message), area) for r in range(n)])]
    roots = sorted({0, n // 2, n - 1})
    if collective in ("broadcast", "reduce"):
        return [(f"root={root}", [(plan(n, r, count, itemsize, max_message, root=root), nbytes) for r in range(n)])
                for root in roots]
    if collective in ("allgather", "reduce_scatter"):
        bounds = tuple(segment_bounds(count, n))
        return [("", [(plan(n, r, count, itemsize, max_message, bounds=bounds), nbytes) for r in range(n)])]
    if collective == "barrier":
        return [("", [(plan(n, r), 0) for r in range(n)])]
    if collective in ("gather", "scatter"):          # ``nbytes``: the block of each rank
        return [(f"root={root}", [(plan(n, r, root, nbytes, max_message),
                                   n * nbytes if entry.full_area or r == root else nbytes) for r in range(n)])
                for root in roots]
    if collective == "alltoall":
        even = tuple(i * nbytes for i in range(n + 1))
        out = [("even", [(plan(n, r, even, even, even[-1], max_message), 2 * even[-1]) for r in range(n)])]
        out += [("uneven", [(plan(n, r, sb, rb, sb[-1], max_message), sb[-1] + rb[-1])
                            for r, (sb, rb) in enumerate(_uneven(n, count))])]
        if entry.name == "write":        # with counts: the blocks from 3 bytes written, the others sent
            out += [(f"mixed {slots}", [(plan(n, r, sb, rb, sb[-1], max_message, written_from=3, slots=slots),
                                         sb[-1] + rb[-1]) for r, (sb, rb) in enumerate(_uneven(n, count))])
                    for slots in (EXCHANGE, SPREAD)]
        return out
    raise AssertionError(f"no test calls {collective}'s planners: add how the specs call them to _plans")


def _messages(step, chunks):
    """(send peer, [messages sent], receive peer, [messages received], receive first?) of a step
    that is not WAIT_SENDS, a message its size: an offer stands for its chunks (as on sockets), an
    ask is ("ask", the span it asks for), which the put takes (it must be of its own span), a
    notice ("notice", 0) is what a landing takes (the engine's placed descriptions: neither is
    taken for a block's message of the same size, nor one for them)."""
    kind, sp, rp, s0, ns, r0, nr, _ = (int(v) for v in step)
    sizes = [int(n) for n in chunks[s0:s0 + ns, 1]], [int(n) for n in chunks[r0:r0 + nr, 1]]
    if kind == ASK:
        return rp, [("ask", sum(sizes[1]))], -1, [], False
    if kind == PUT:
        return -1, [], sp, [("ask", sum(sizes[0]))], False
    if kind == NOTICE:
        return sp, [("notice", 0)], -1, [], False
    if kind == LANDED:
        return -1, [], rp, [("notice", 0)], False
    assert kind in (EXCHANGE, OFFER, FETCH, SPREAD), kind   # (a spread step by step: the strictest order)
    return sp, sizes[0], rp, sizes[1], False


def _run(schedules):
    """Run one schedule per rank against each other, sends eager (a put's once it has the ask), a
    wait for sends done only once their receivers took them (the strictest the engine may be); a
    receive takes the next message from its peer, which must be of its size. Returns None, or why
    the ranks got stuck."""
    n = len(schedules)
    queues = {}                                  # (sender, receiver): [sizes in flight]
    taken = {}                                   # (sender, receiver): messages received so far
    sent = {}                                    # (sender, receiver): messages sent so far
    pos, posted, got = [0] * n, [False] * n, [0] * n
    while True:
        moved = False
        for r, s in enumerate(schedules):
            while pos[r] < len(s.steps):
                kind, sp, rp, s0, ns, r0, nr, _ = (int(v) for v in s.steps[pos[r]])
                if kind == WAIT_SENDS:
                    peers = range(n) if sp < 0 else (sp,)
                    if any(taken.get((r, p), 0) < sent.get((r, p), 0) for p in peers):
                        break
                else:
                    sp, out, rp, wanted, recv_first = _messages(s.steps[pos[r]], s.chunks)
                    if not posted[r] and sp >= 0 and not recv_first:
                        queues.setdefault((r, sp), []).extend(out)
                        sent[(r, sp)] = sent.get((r, sp), 0) + len(out)
                        moved = True
                    posted[r] = True
                    if rp >= 0:
                        q = queues.get((rp, r), [])
                        while got[r] < len(wanted) and q:
                            want = wanted[got[r]]
                            if q[0] != want:
                                return f"rank {r} receives {want} bytes from rank {rp}, which sent {q[0]}"
                            q.pop(0)
                            taken[(rp, r)] = taken.get((rp, r), 0) + 1
                            got[r] += 1
                            moved = True
                        if got[r] < len(wanted):
                            break
                    if recv_first:
                        queues.setdefault((r, sp), []).extend(out)
                        sent[(r, sp)] = sent.get((r, sp), 0) + len(out)
                pos[r] += 1
                posted[r], got[r] = False, 0
                moved = True
        if all(p == len(s.steps) for p, s in zip(pos, schedules)):
            left = {k: q for k, q in queues.items() if q}
            return f"messages never received: {left}" if left else None
        if not moved:
            return f"stuck at steps {pos} of {[len(s.steps) for s in schedules]}"


def _entries():
    return [(c, e) for c in algorithms.ALGORITHMS for e in algorithms.entries(c)]


@pytest.mark.parametrize("collective,entry", _entries(), ids=lambda v: v if isinstance(v, str) else v.name)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_every_planner_runs_to_its_end_on_every_rank(collective, entry, n):
    for count, itemsize, max_message in ((0, 4, 64), (1, 8, 64), (77, 4, 64), (33, 8, 4096), (5, 1, 2)):
        for label, ranks in _plans(collective, entry, n, count, itemsize, max_message):
            where = (collective, entry.name, n, count, itemsize, max_message, label)
            schedules = [s for s, _ in ranks]
            assert _run(schedules) is None, (where, _run(schedules))
            for r, (s, area) in enumerate(ranks):
                c = s.chunks
                assert (c[:, 0] >= 0).all() and (c[:, 1] <= max_message).all(), (where, r)
                assert (c[:, 0] + c[:, 1] <= area).all(), (where, r, "outside the work area")
                if collective in _REDUCING:
                    assert (c[:, 1] % itemsize == 0).all(), (where, r, "an element cut in two")
                assert not len(s.steps) or s.steps[-1, 0] == WAIT_SENDS, (where, r, "ends before its sends are done")
                assert r not in s.steps[:, 1:3], (where, r, "talks to itself")


# ---- every cost function: the one the cost model and the specs choose by ---------------------


def _comm(n, model):
    """What the specs' choices read of a Communicator."""
    return types.SimpleNamespace(size=n, cost_model=model, transport=types.SimpleNamespace(max_message=65536))


def _choose(collective, n):
    """The algorithm every path of a call of ``collective`` with algorithm="auto" takes."""
    comm = _comm(n, CostModel())
    if collective == "allreduce":
        got = {specs.chosen_allreduce(comm, "auto", 1000), comm.cost_model.choose_allreduce(1000, n, 65536)}
    elif collective in ("broadcast", "reduce"):
        got = {specs.rooted_algorithm(comm, "auto", 1000), comm.cost_model.choose_rooted(1000, n, 65536)}
    else:
        got = {specs.copy_algorithm(comm, collective, "auto", 1000),
               comm.cost_model.choose_copy(collective, 1000, n, 65536)}
    got.add(comm.cost_model.cheapest(collective, 1000, n, 65536))
    assert len(got) == 1, (collective, n, got)
    return got.pop()


@pytest.mark.parametrize("collective", [c for c in algorithms.ALGORITHMS if len(algorithms.names(c)) > 1])
def test_the_choice_is_the_registry_cost_functions(collective, monkeypatch):
    monkeypatch.delenv("PYRDMA_ALLREDUCE_ALGORITHM", raising=False)
    # broadcast and reduce choose by broadcast's entries: they must be reduce's too
    watched = ("broadcast", "reduce") if collective in ("broadcast", "reduce") else (collective,)
    for winner in algorithms.names(collective):
        with monkeypatch.context() as patch:      # the winner's estimate 0, every other one's 1
            for c in watched:
                for entry in algorithms.entries(c):
                    cost = (lambda *a: 0.0) if entry.name == winner else (lambda *a: 1.0)
                    patch.setitem(algorithms.ALGORITHMS[c], entry.name, entry._replace(cost=cost))
            entry = algorithms.ALGORITHMS[collective][winner]
            for n in range(1, 7):
                chosen = _choose(collective, n)
                if n >= entry.min_ranks:
                    assert chosen == winner, (collective, n, winner)
                else:          # below its min_ranks the first entry runs, whatever the estimates
                    assert chosen == algorithms.names(collective)[0], (collective, n, winner)
    m = CostModel()
    for n in (2, 4, 5):
        assert m.costs(collective, 1000, n, 65536) == \
            {e.name: e.cost(m, 1000, n, 65536) for e in algorithms.entries(collective)}


def test_broadcast_and_reduce_have_the_same_algorithms():
    # choose_rooted and the specs' check of a reduce's algorithm= read broadcast's entries
    keep = ("name", "cost", "wire_id", "aliases", "min_ranks", "preferred_within")
    assert [[getattr(e, f) for f in keep] for e in algorithms.entries("broadcast")] == \
        [[getattr(e, f) for f in keep] for e in algorithms.entries("reduce")]


# ---- names, aliases and wire ids -------------------------------------------------------------


def test_one_wire_id_per_name_and_the_descriptions_carry_it():
    ids = {}
    for collective, entry in _entries():
        assert entry.wire_id >= 0 and entry.wire_name in (entry.name, "")
        if entry.wire_id:
            assert algorithms.WIRE_NAMES[entry.wire_id] == entry.name, (collective, entry.name)
            assert ids.setdefault(entry.name, entry.wire_id) == entry.wire_id, (collective, entry.name)
            desc = describe(7, collective, root=0, algorithm=entry.wire_name)
            assert desc[40] == entry.wire_id and f"algorithm={entry.name}" in explain(desc)
    assert len(set(ids.values())) == len(ids) == len(algorithms.WIRE_NAMES) - 1
    for collective in ("allgather", "reduce_scatter"):         # their descriptions never named one
        assert describe(7, collective, algorithm=algorithms.only(collective).wire_name)[40] == 0


def test_names_aliases_and_the_errors_of_unknown_ones():
    for collective in algorithms.ALGORITHMS:
        names, aliases = algorithms.names(collective), algorithms.aliases(collective)
        assert len(set(names)) == len(names) and not set(aliases) & set(names) and "auto" not in names
        assert set(aliases.values()) <= set(names)
    assert specs.check_algorithm("rd") == "recursive_doubling" and specs.check_algorithm("auto") == "auto"
    unknown = {
        lambda: specs.check_algorithm("bogus"):
            "unknown algorithm 'bogus'; use one of auto, ring, halving_doubling, recursive_doubling, tree, hd, rd",
        lambda: specs.rooted_algorithm(None, "ring", 8):
            "unknown algorithm 'ring' for reduce/broadcast; use auto, chain, binomial",
        lambda: specs.copy_algorithm(None, "gather", "read", 8):
            "unknown algorithm 'read' for gather; use auto, direct, binomial",
        lambda: specs.copy_algorithm(None, "scatter", "x", 8):
            "unknown algorithm 'x' for scatter; use auto, direct, binomial, read",
    }
    for call, message in unknown.items():
        with pytest.raises(UsageError) as err:
            call()
        assert str(err.value) == message
