"""Test helper (no tests here): a group of rank processes that stays up across tests (one start per world).

    with World(4, "tcp") as w:
        results = w.run(fn, arg, timeout=60)    # fn(comm, arg) on every rank, results by rank

Each rank is a process (mp.rank_context's: forked from a server) holding one Communicator. ``run`` sends the function to every rank
and waits (with a timeout) for every result; a rank that raised, died or hung fails the call with
an AssertionError naming it, and the world is then unusable (``broken``). ``close`` always
terminates and joins the children. ``fn`` must be importable by the children (a module-level
function of an importable module)."""
import time
import traceback

from mp import rank_context

RANKS = rank_context()


def _rank_main(conn, rank, size, transport, timeout, comm_kwargs):
    try:
        from pyrdma.collectives import Communicator, TCPStore
        # the bootstrap waits for ranks still starting (imports take seconds in the VM), whatever
        # short timeout the collectives get (the dead-rank tests use a few seconds)
        store_timeout = max(timeout, 60.0)
        if rank == 0:
            store = TCPStore("127.0.0.1", 0, 0, size, store_timeout)
            conn.send(("port", store.port))
        else:
            if not conn.poll(timeout):
                raise TimeoutError("the parent never sent the rendezvous port")
            _, port = conn.recv()
            store = TCPStore("127.0.0.1", port, rank, size, store_timeout)
        try:
            comm = Communicator(exchange=store, transport=transport, timeout=timeout, **comm_kwargs)
        finally:
            store.close()
        conn.send(("ready", comm.transport_name))
    except BaseException as exc:
        conn.send(("error", f"rank {rank} setup: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        return
    try:
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                return
            if msg[0] == "stop":
                comm.close()
                conn.send(("closed", None))
                return
            _, fn, args = msg
            try:
                conn.send(("ok", fn(comm, *args)))
            except BaseException as exc:
                conn.send(("error", f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        conn.close()


class World:
    def __init__(self, size, transport="tcp", timeout=30.0, start_timeout=120.0, **comm_kwargs):
        self.size, self.transport = size, transport
        self.broken = False
        self.conns, self.procs = [], []
        try:
            for rank in range(size):
                parent, child = RANKS.Pipe()
                p = RANKS.Process(target=_rank_main, args=(child, rank, size, transport, timeout, comm_kwargs),
                                  name=f"rank{rank}", daemon=True)
                p.start()
                child.close()
                self.conns.append(parent)
                self.procs.append(p)
            kind, port = self._get(0, start_timeout)
            if kind != "port":
                raise AssertionError(f"rank 0 did not start: {port}")
            for conn in self.conns[1:]:
                conn.send(("port", port))
            errors = []
            for rank in range(size):
                kind, value = self._get(rank, start_timeout)
                if kind != "ready":
                    errors.append(value)
                else:
                    self.transport_name = value
            if errors:
                raise AssertionError("world setup failed:\n" + "\n".join(map(str, errors)))
        except BaseException:
            self.close()
            raise

    def _get(self, rank, timeout):
        conn = self.conns[rank]
        if not conn.poll(timeout):
            return ("missing", f"rank {rank} sent nothing within {timeout} s "
                               f"(alive: {self.procs[rank].is_alive()}, exit code {self.procs[rank].exitcode})")
        try:
            return conn.recv()
        except (EOFError, OSError):
            return ("missing", f"rank {rank} died (exit code {self.procs[rank].exitcode})")

    def run(self, fn, *args, timeout=120.0, expect_errors=False, ignore=()):
        """fn(comm, *args) on every rank; the results by rank. With expect_errors, (status, value)
        pairs instead (status "ok", "error" or "missing"). Ranks in ``ignore`` are not waited for
        (their entry is ("ignored", None)) and the world counts as broken afterwards."""
        assert not self.broken, "this world broke in an earlier test"
        for conn in self.conns:
            conn.send(("run", fn, args))
        deadline = time.monotonic() + timeout
        got = [("ignored", None) if r in ignore else self._get(r, max(0.01, deadline - time.monotonic()))
               for r in range(self.size)]
        if ignore:
            self.broken = True
        if any(kind not in ("ok", "ignored") for kind, _ in got):
            self.broken = True
            if expect_errors:
                return got
            raise AssertionError("\n".join(f"rank {r}: {kind}: {value}" for r, (kind, value) in enumerate(got)
                                           if kind != "ok"))
        return got if expect_errors else [value for _, value in got]

    def close(self):
        if not self.broken:
            for conn in self.conns:
                try:
                    conn.send(("stop",))
                except (OSError, ValueError):
                    pass
            for rank in range(len(self.conns)):
                self._get(rank, 15)
            for p in self.procs:
                p.join(timeout=5)
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for conn in self.conns:
            conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def world_params(sizes_tcp, sizes_rdma):
    """pytest parameters (transport, size): TCP worlds on the host, RDMA ones (marker device) in the VM."""
    import pytest
    return ([pytest.param("tcp", n, id=f"tcp-{n}") for n in sizes_tcp] +
            [pytest.param("rdma", n, id=f"rdma-{n}", marks=pytest.mark.device) for n in sizes_rdma])


def cached_worlds(**world_kwargs):
    """The body of a module-scoped fixture: yields get(transport, size), a World started once per
    (transport, size) and again after it broke; all are closed at the end."""
    cache = {}

    def get(transport, size):
        w = cache.get((transport, size))
        if w is None or w.broken:
            if w is not None:
                w.close()
            w = cache[(transport, size)] = World(size, transport, **world_kwargs)
        return w
    try:
        yield get
    finally:
        for w in cache.values():
            w.close()
