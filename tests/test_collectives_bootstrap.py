"""Rendezvous (TCP store, environment, MPI), transport agreement, wire validation and the cost
model. Ranks run as threads here: the TCP store and TcpTransport need no separate processes."""
import functools
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import types

import numpy as np
import pytest

import pyrdma
from pyrdma.collectives import Communicator, CostModel, MPIExchange, TCPStore, env_config, init_from_env
from pyrdma import wire
from pyrdma.testing import free_port
from pyrdma.collectives import algorithms, bootstrap, segment_bounds, specs
from pyrdma.collectives.work import HostMemory


def in_threads(size, fn, timeout=60):
    """fn(rank) in ``size`` threads; results (or raised exceptions) by rank."""
    results = [None] * size

    def run(rank):
        try:
            results[rank] = fn(rank)
        except BaseException as exc:   # returned to the test
            results[rank] = exc
    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a rank thread hung"
    return results


def test_env_config():
    env = {"MASTER_ADDR": "node0", "MASTER_PORT": "29500", "RANK": "1", "WORLD_SIZE": "4"}
    assert env_config(env) == ("node0", 29500, 1, 4)
    with pytest.raises(pyrdma.UsageError, match="MASTER_PORT, RANK, WORLD_SIZE"):
        env_config({"MASTER_ADDR": "h"})
    with pytest.raises(pyrdma.UsageError, match="integers"):
        env_config(dict(env, RANK="one"))
    with pytest.raises(pyrdma.UsageError, match="not within"):
        env_config(dict(env, RANK="4"))
    for bad in ("nohost", ":80", "h:", "h:99999"):
        with pytest.raises(pyrdma.UsageError, match="host:port"):
            bootstrap.parse_address(bad)
    assert bootstrap.parse_address("[::1]:5") == ("::1", 5)


def test_store_allgather_rounds_and_barrier():
    port = free_port()

    def rank_fn(rank):
        with TCPStore("127.0.0.1", port, rank, 3, timeout=20) as store:
            first = store.allgather(f"r{rank}".encode())
            store.barrier()
            second = store.allgather(bytes(rank * 1000))   # records of different lengths
            return first, [len(r) for r in second], store.advertise_host
    for first, lengths, host in in_threads(3, rank_fn):
        assert first == [b"r0", b"r1", b"r2"]
        assert lengths == [0, 1000, 2000]
        assert host == "127.0.0.1"


def test_store_on_anyfree_port():
    store = TCPStore("127.0.0.1", 0, 0, 2, timeout=10)
    port = store.port
    assert port != 0
    other = threading.Thread(target=lambda: TCPStore("127.0.0.1", port, 1, 2, timeout=10).allgather(b"b"))
    other.start()
    assert store.allgather(b"a") == [b"a", b"b"]
    other.join(10)
    store.close()


def test_store_drops_foreign_data_and_goes_on():
    store = TCPStore("127.0.0.1", 0, 0, 2, timeout=10)
    done = threading.Event()

    def intruder_then_rank1():
        with socket.create_connection(("127.0.0.1", store.port), timeout=5) as s:
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(20))
            s.settimeout(5)
            while s.recv(4096):      # rank 0 answers with its refusal and closes
                pass
        TCPStore("127.0.0.1", store.port, 1, 2, timeout=10).allgather(b"rank1")
        done.set()
    threading.Thread(target=intruder_then_rank1, daemon=True).start()
    assert store.allgather(b"rank0") == [b"rank0", b"rank1"]
    assert done.wait(10)
    assert any("not a pyrdma rendezvous peer" in why for why in store.refused)
    store.close()


def _fake_server(reply, greet=True):
    """A one-shot TCP server that greets like rank 0, reads the join and answers ``reply``."""
    srv = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = srv.accept()
        with conn:
            if greet:
                conn.sendall(wire.Session(bootstrap.FRAMING, b"L").greeting())
                conn.recv(4096)
            conn.sendall(reply)
            try:
                conn.recv(4096)
            except OSError:     # the client may reset the connection once it refused the reply
                pass
        srv.close()
    threading.Thread(target=serve, daemon=True).start()
    return srv.getsockname()[1]


def test_client_rejects_foreign_or_newer_rank0():
    port = _fake_server(b"HTTP/1.1 400 Bad Request\r\n\r\n" + bytes(64), greet=False)
    with pytest.raises(pyrdma.WireFormatError, match="not a pyrdma rendezvous peer"):
        TCPStore("127.0.0.1", port, 1, 2, timeout=5).allgather(b"x")
    newer = bootstrap.FRAMING.header.pack(bootstrap.MAGIC, bootstrap.VERSION + 1, bootstrap.TABLE, 0, 2, 1, 0)
    port = _fake_server(newer)
    with pytest.raises(pyrdma.WireFormatError, match="version 3"):
        TCPStore("127.0.0.1", port, 1, 2, timeout=5).allgather(b"x")
    truncated = bootstrap.FRAMING.pack(bootstrap.TABLE, struct.pack("!Q", 100) + b"short", (0, 2, 1))
    port = _fake_server(truncated)
    with pytest.raises(pyrdma.WireFormatError, match="truncated"):
        TCPStore("127.0.0.1", port, 1, 2, timeout=5).allgather(b"x")


def test_world_size_disagreement_and_duplicate_ranks():
    port = free_port()

    def rank_fn(rank):
        size = 3 if rank == 1 else 2
        with TCPStore("127.0.0.1", port, rank, size, timeout=3) as store:
            return store.allgather(b"x")
    results = in_threads(2, rank_fn)
    # without a secret the mismatched rank is refused (it might be a stranger) and named on timeout
    assert isinstance(results[0], pyrdma.RDMATimeoutError) and "world of 3 ranks" in str(results[0])
    assert isinstance(results[1], pyrdma.PeerError) and "rank 0 was told 2" in str(results[1])
    # with a secret it is an authenticated member: a misconfigured job fails at once
    port = free_port()

    def rank_fn_secret(rank):
        size = 3 if rank == 1 else 2
        with TCPStore("127.0.0.1", port, rank, size, timeout=20, secret="s3") as store:
            return store.allgather(b"x")
    start = time.monotonic()
    results = in_threads(2, rank_fn_secret)
    assert time.monotonic() - start < 10
    assert isinstance(results[0], pyrdma.UsageError) and "believes the world has 3 ranks" in str(results[0])
    assert isinstance(results[1], pyrdma.PeerError)


def test_rendezvous_timeout_names_the_missing_ranks_everywhere():
    port = free_port()
    start = time.monotonic()

    def rank_fn(rank):
        with TCPStore("127.0.0.1", port, rank, 4, timeout=1.0) as store:   # ranks 2 and 3 never come
            return store.allgather(b"x")
    results = in_threads(2, rank_fn)
    assert time.monotonic() - start < 1.0 + bootstrap.CLIENT_GRACE + 2
    assert isinstance(results[0], pyrdma.RDMATimeoutError) and "ranks [2, 3] did not join" in str(results[0])
    # rank 1 joined and is told why the rendezvous failed
    assert isinstance(results[1], pyrdma.PeerError) and "ranks [2, 3] did not join" in str(results[1])


def test_unreachable_rank0_is_named():
    start = time.monotonic()
    with pytest.raises(pyrdma.PeerError, match="rank 0 at 127.0.0.1:.* not reachable") as info:
        TCPStore("127.0.0.1", free_port(), 2, 3, timeout=0.5).allgather(b"x")
    assert info.value.peer == 0
    assert time.monotonic() - start < 0.5 + bootstrap.CLIENT_GRACE + 2


def test_mpi_exchange_with_a_plain_allgather():
    class FakeComm:   # only what an mpi4py communicator without non-blocking collectives has
        def Get_rank(self):
            return 1

        def Get_size(self):
            return 2

        def allgather(self, obj):
            return [b"zero", obj]
    ex = MPIExchange(FakeComm())
    assert (ex.rank, ex.size) == (1, 2)
    assert ex.allgather(b"one") == [b"zero", b"one"]


def _mpi4py_path():
    """A PYTHONPATH under which this interpreter imports mpi4py, or None."""
    try:
        import mpi4py  # noqa: F401
        return ""
    except ImportError:
        pass
    system = "/usr/lib/python3/dist-packages/mpi4py"
    if not os.path.isdir(system):
        return None
    # Debian's python3-mpi4py, for the system Python; expose only mpi4py, not all of dist-packages.
    tmp = tempfile.mkdtemp(prefix="pyrdma-mpi4py-")
    os.symlink(system, os.path.join(tmp, "mpi4py"))
    probe = subprocess.run([sys.executable, "-c", "from mpi4py import MPI"], env=dict(os.environ, PYTHONPATH=tmp),
                           capture_output=True, timeout=60)
    return tmp if probe.returncode == 0 else None


MPI_SCRIPT = """
import numpy as np
from mpi4py import MPI
from pyrdma.collectives import init_from_mpi
with init_from_mpi(MPI.COMM_WORLD, transport="tcp", timeout=30) as comm:
    x = np.full(7, comm.rank + 1, np.int64)
    comm.allreduce(x)
    everyone = comm.allgather(np.array([comm.rank, comm.size, x[0]], np.int64))
    if comm.rank == 0:   # one line: mpirun may interleave the ranks' output
        print("RESULT", everyone.tolist(), flush=True)
"""


def test_rendezvous_over_real_mpi():
    mpirun = shutil.which("mpirun")
    path = _mpi4py_path() if mpirun else None
    if path is None:
        pytest.skip("mpirun or mpi4py not available")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (path, root) if p))
    proc = subprocess.run([mpirun, "--allow-run-as-root", "--oversubscribe", "-n", "3", sys.executable, "-c",
                           MPI_SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    expected = "RESULT " + str([v for r in range(3) for v in (r, 3, 6)])
    assert proc.returncode == 0 and expected in proc.stdout.splitlines(), proc.stdout + proc.stderr


def test_init_from_env_torchrun_style():
    port = free_port()

    def rank_fn(rank):
        env = {"MASTER_ADDR": "localhost", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": "3"}
        with init_from_env(environ=env, transport="tcp", timeout=20) as comm:
            x = np.full(3, rank + 1.0)
            comm.allreduce(x)
            return comm.transport_name, x
    for name, x in in_threads(3, rank_fn):
        assert name == "tcp" and (x == 6.0).all()


def test_transport_choice_is_agreed_by_all_ranks():
    port = free_port()

    def auto(rank):
        with Communicator(rank, 2, f"127.0.0.1:{port}", transport="auto", timeout=20) as comm:
            return comm.transport_name
    names = in_threads(2, auto)
    assert names[0] == names[1] and names[0] in ("tcp", "rdma")
    port = free_port()

    def mixed(rank):
        return Communicator(rank, 2, f"127.0.0.1:{port}", transport=("tcp", "rdma")[rank], timeout=20)
    results = in_threads(2, mixed)
    for r in results:
        assert isinstance(r, pyrdma.UsageError) and "different transports" in str(r)


def test_tcp_transport_rejects_foreign_connections():
    from pyrdma.collectives.transport import TcpTransport

    class Exchange:   # rank 1 of 2 whose "rank 0" is someone else entirely
        advertise_host = "127.0.0.1"

        def __init__(self):
            self.rank, self.size = 1, 2

        def allgather(self, record):
            port = int(record.decode().split(" ")[1].rsplit(":", 1)[1])   # "max_message host:port token"

            def intrude():
                with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                    s.sendall(b"SSH-2.0-OpenSSH_9.2\r\n" + bytes(20))
                    time.sleep(1)
            threading.Thread(target=intrude, daemon=True).start()
            return [record, record]
    with pytest.raises((pyrdma.WireFormatError, pyrdma.PeerError)):
        TcpTransport(0, 2, Exchange(), timeout=3)


def test_communicator_arguments():
    with pytest.raises(pyrdma.UsageError, match="host:port"):
        Communicator(0, 2, "nowhere")
    with pytest.raises(pyrdma.UsageError, match="master="):
        Communicator(0, 2)
    with pytest.raises(pyrdma.UsageError, match="unknown transport"):
        Communicator(0, 1, "127.0.0.1:1", transport="carrier-pigeon")
    with pytest.raises(pyrdma.UsageError, match="not within"):
        Communicator(3, 2, "127.0.0.1:1")


def test_single_rank_communicator():
    with Communicator(0, 1, "127.0.0.1:0", transport="tcp") as comm:
        x = np.arange(5, dtype=np.float32)
        assert comm.allreduce(x, op="avg") is x and (x == np.arange(5)).all()
        assert (comm.allgather(x) == x).all()
        assert (comm.reduce_scatter(x) == x).all()
        comm.barrier()
        assert comm.ibroadcast(x).wait(1) is x
    assert "closed" in repr(comm)
    with pytest.raises(pyrdma.UsageError, match="closed"):
        comm.allreduce(x)


def test_segment_bounds():
    assert segment_bounds(10, 3) == [0, 4, 7, 10]
    assert segment_bounds(2, 4) == [0, 1, 2, 2, 2]
    assert segment_bounds(0, 2) == [0, 0, 0]


def test_cost_model_choices_and_overrides(monkeypatch):
    m = CostModel(alpha=5e-6, beta=1e-10)
    assert m.choose_allreduce(64, 8, 256 * 1024) == "recursive_doubling"
    assert m.choose_allreduce(64 << 20, 8, 256 * 1024) == "ring"
    assert m.choose_allreduce(256 << 10, 8, 256 * 1024) == "halving_doubling"
    assert m.choose(64, 8, 256 * 1024) == "tree" and m.choose(64 << 20, 8, 256 * 1024) == "ring"
    assert m.choose_rooted(64, 8, 256 * 1024) == "binomial"
    assert m.choose_rooted(64 << 20, 8, 256 * 1024) == "chain"
    # gather/scatter: the root's messages fly together, so direct up to many ranks; the tree's fewer
    # rounds win for small blocks over 64 ranks, and lose again once forwarding copies count
    assert all(CostModel().choose_copy(k, b, n, 1 << 20) == "direct"
               for k in ("gather", "scatter") for b in (8, 4096, 1 << 20) for n in (3, 4, 8, 16))
    assert CostModel().choose_copy("gather", 8, 64, 1 << 20) == "binomial"
    assert CostModel().choose_copy("scatter", 1 << 20, 64, 1 << 20) == "direct"
    assert CostModel(overhead=CostModel().alpha).choose_copy("gather", 8, 4, 1 << 20) == "binomial"
    # where a NIC moves the bytes a scatter's reads only add a round trip; on a software device
    # (Soft-RoCE) they share the copying among the readers, which pays from ~16 KiB at 4 ranks
    assert "read" not in {CostModel().choose_copy("scatter", b, n, 1 << 20) for b in (8, 1 << 20) for n in (3, 4, 64)}
    soft = CostModel(software=True)
    assert soft.copy > 0 and CostModel().copy == 0 and CostModel(copy=1e-9).copy == 1e-9
    # there and over TCP an all-to-all, gather or scatter works in a caller's buffer from 128 KiB
    # (the CPU's copies cost more than a registration), on a NIC from zero_copy_bytes; 0 turns it off
    assert soft.lend_bytes == 128 << 10 and CostModel().lend_bytes is None
    assert CostModel(transport="tcp").lend_bytes == CostModel(transport="tcp", software=True).lend_bytes == 128 << 10
    lends = [specs.lends_blocks(types.SimpleNamespace(zero_copy_bytes=z, cost_model=m), b)
             for m, z in ((soft, 1 << 20), (CostModel(), 1 << 20), (soft, 0), (soft, 4096))
             for b in (4096, 128 << 10, 1 << 20)]
    assert lends == [False, True, True, False, False, True, False, False, False, True, True, True]
    # a lone send or receive: over RDMA from zero_copy_bytes (a rendezvous), over TCP at any size
    # (nothing to register); 0 turns it off
    links = {s: types.SimpleNamespace(engine=types.SimpleNamespace(sockets=s)) for s in (True, False)}
    lends = [specs.lends_message(types.SimpleNamespace(zero_copy_bytes=z, transport=links[s]), b)
             for s, z in ((True, 1 << 20), (False, 1 << 20), (True, 0)) for b in (0, 8, 1 << 20)]
    assert lends == [False, True, True, False, False, True, False, False, False]
    # an exchange (sendrecv, a step of a batch) over TCP sends from and receives into the caller's
    # arrays where they do not overlap; over RDMA through the transport's buffer

    def exchange_lent(sockets, send, recv):
        comm = types.SimpleNamespace(size=2, rank=0, zero_copy_bytes=1 << 20, transport=links[sockets],
                                     _exec=types.SimpleNamespace(sent=[0, 0], received=[0, 0]))
        return specs.p2p(comm, (send, recv), 1, 1, 0).runs[0].layout.lent
    a = np.arange(8.0)
    assert [exchange_lent(True, a[:4], a[4:]), exchange_lent(False, a[:4], a[4:]), exchange_lent(True, a[:6], a[2:]),
            exchange_lent(True, a[:0], a[4:])] == ["both", None, None, None]
    assert [soft.choose_copy("scatter", b, 4, 1 << 20) for b in (8, 4096, 32768, 1 << 20)] == \
        ["direct", "direct", "read", "read"]
    assert soft.choose_copy("scatter", 1 << 20, 2, 1 << 20) == "direct"      # one block: nothing to share
    assert {soft.choose_copy("gather", b, 4, 1 << 20) for b in (8, 32768, 1 << 20)} == {"direct"}
    # over sockets a read is the root's send after a copy of its buffer: never chosen (it is at 4
    # ranks from 16 MiB over RDMA, where fewer, larger messages pay less per-message overhead)
    assert CostModel().choose_copy("scatter", 64 << 20, 4, 1 << 20) == "read"
    assert "read" not in {CostModel(transport="tcp", software=s).choose_copy("scatter", b, n, 1 << 20)
                          for s in (False, True) for b in (8, 32768, 1 << 20, 64 << 20) for n in (3, 4, 64)}
    # every estimate grows with the size (each algorithm's, from the registry)
    for collective in algorithms.ALGORITHMS:
        for entry in algorithms.entries(collective):
            costs = [entry.cost(m, n, 5, 65536) for n in (1, 1 << 10, 1 << 20, 1 << 26)]
            assert costs == sorted(costs), (collective, entry.name)
    monkeypatch.setenv("PYRDMA_ALLREDUCE_ALGORITHM", "tree")
    assert CostModel().choose_allreduce(64 << 20, 8, 256 * 1024) == "halving_doubling"   # read when made


def test_cost_model_choices_follow_changed_constants():
    # choices are remembered per size, but a model whose constants change answers anew
    m = CostModel(alpha=5e-6, beta=1e-10)
    assert m.choose_allreduce(256 << 10, 8, 256 * 1024) == "halving_doubling"
    m.alpha = 0.0                     # messages are free: the ring's bandwidth wins at every size
    assert m.choose_allreduce(256 << 10, 8, 256 * 1024) == "ring"
    m.alpha = 1.0                     # messages are all that counts: fewest steps
    assert m.choose_allreduce(256 << 10, 8, 256 * 1024) == "recursive_doubling"


# The choices of the cost model before its estimates moved into the registry (costs were CostModel
# methods looked up by name), the old code's answers pasted: per model, max_message and collective, one
# word per rank count of _CHOICE_RANKS, one letter (_CHOICE_LETTERS) per size of _CHOICE_SIZES. One
# change since, on purpose: over TCP a scatter no longer "reads" (CostModel.one_sided), direct instead.
_CHOICE_SIZES = (0, 1, 8, 100, 1000, 4096, 10000, 32768, 65536, 100000, 262144, 1 << 20, 3 << 20, 1 << 23,
                 1 << 26)
_CHOICE_RANKS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 33, 64)
_CHOICE_LETTERS = {"R": "ring", "H": "halving_doubling", "D": "recursive_doubling", "C": "chain", "B": "binomial",
                   "d": "direct", "r": "read"}
_CHOICE_MODELS = {"rdma": {}, "tcp": {"transport": "tcp"}, "soft": {"software": True},
                  "custom": {"alpha": 5e-6, "beta": 1e-10}}
_CHOICES = {
    ("rdma", 65536, "allreduce"):
        "RRRRRRRRRRRRRRR DDDDDDDDRRRRRRR DDDDDDDRRRRRRRR DDDDDDDDHHRRRRR DDDDDDDDRRRRRRR DDDDDDDDRRRRRRR "
        "DDDDDDDDHRRRRRR DDDDDDDDHHHRRRR DDDDDDDDHHRRRRR DDDDDDDDHHHRRRR DDDDDDDHHHHRRRR DDDDDDDHHHHHHRR",
    ("rdma", 65536, "rooted"):
        "CCCCCCCCCCCCCCC CCCCCCCCCCCCCCC CCCCCCCCCCCCCCC BBBBBBBBBCCCCCC BBBBBBBBBCCCCCC BBBBBBBBBCCCCCC "
        "BBBBBBBBBBCCCCC BBBBBBBBBBCCCCC BBBBBBBBBBCCCCC BBBBBBBBBBBCCCC BBBBBBBBBBBCCCC BBBBBBBBBBBCCCC",
    ("rdma", 65536, "gather"):
        "ddddddddddddddd ddddddddddddddd ddddddddddddddd ddddddddddddddd ddddddddddddddd ddddddddddddddd "
        "ddddddddddddddd ddddddddddddddd ddddddddddddddd ddddddddddddddd ddddddddddddddd BBBBBdddddddddd",
    ("rdma", 65536, "scatter"):
        "ddddddddddddddd ddddddddddddddd dddddddddddrrrr dddddddddddrrrr dddddddddddrrrr dddddddddddrrrr "
        "dddddddddddrrrr dddddddddddrrrr ddddddddddrrrrr ddddddddddrrrrr ddddddddddrrrrr BBBBBdddddrrrrr",
    ("rdma", 1048576, "allreduce"):
        "RRRRRRRRRRRRRRR DDDDDDDDRRRRRRR DDDDDDDRRRRRRRR DDDDDDDDHHHRRRR DDDDDDDDRRRRRRR DDDDDDDDRRRRRRR "
        "DDDDDDDDHRRRRRR DDDDDDDDHHHHRRR DDDDDDDDHHRRRRR DDDDDDDDHHHHHRR DDDDDDDHHHHRRRR DDDDDDDHHHHHHHR",
    ("rdma", 1048576, "rooted"):
        "CCCCCCCCCCCCCCC CCCCCCCCCCCCCCC CCCCCCCCCCCCCCC BBBBBBBBBBBBCCC BBBBBBBBBBBBCCC BBBBBBBBBBBBCCC "
        "BBBBBBBBBBBBCCC BBBBBBBBBBBBCCC BBBBBBBBBBBBBCC BBBBBBBBBBBBBCC BBBBBBBBBBBBBCC BBBBBBBBBBBBBBC",
    ("rdma", 1048576, "gather"):
        "ddddddddddddddd ddddddddddddddd ddddddddddddddd ddddddddddddddd ddddddddddddddd ddddddddddddddd "
        "ddddddddddddddd ddddddddddddddd ddddddddddddddd ddddddddddddddd ddddddddddddddd BBBBBdddddddddd",
    ("rdma", 1048576, "scatter"):
        "ddddddddddddddd ddddddddddddddd ddddddddddddddr dddddddddddddrr dddddddddddddrr dddddddddddddrr "
        "dddddddddddddrr dddddddddddddrr dddddddddddddrr dddddddddddddrr ddddddddddddrrr BBBBBdddddddrrr",
    ("tcp", 65536, "allreduce"):
        "RRRRRRRRRRRRRRR DDDDDDDDDRRRRRR DDDDDDDRRRRRRRR DDDDDDDDDHRRRRR DDDDDDDDDRRRRRR DDDDDDDDDRRRRRR "
        "DDDDDDDDDHRRRRR DDDDDDDDDHHRRRR DDDDDDDDDHRRRRR DDDDDDDDDHHRRRR DDDDDDDDDHHRRRR DDDDDDDDDHHHHRR",
    ("tcp", 65536, "rooted"):
        "CCCCCCCCCCCCCCC CCCCCCCCCCCCCCC CCCCCCCCCCCCCCC BBBBBBBBBCCCCCC BBBBBBBBBCCCCCC BBBBBBBBBCCCCCC "
        "BBBBBBBBBBCCCCC BBBBBBBBBBCCCCC BBBBBBBBBBCCCCC BBBBBBBBBBBCCCC BBBBBBBBBBBCCCC BBBBBBBBBBBCCCC",
    ("tcp", 65536, "gather"):
        "ddddddddddddddd ddddddddddddddd ddddddddddddddd ddddddddddddddd ddddddddddddddd ddddddddddddddd "
        "ddddddddddddddd ddddddddddddddd ddddddddddddddd ddddddddddddddd ddddddddddddddd BBBBBBddddddddd",
    ("tcp", 65536, "scatter"):
        "ddddddddddddddd ddddddddddddddd ddddddddddddddd ddddddddddddddd ddddddddddddddd ddddddddddddddd "
        "ddddddddddddddd ddddddddddddddd ddddddddddddddd ddddddddddddddd ddddddddddddddd BBBBBBddddddddd",
    ("tcp", 1048576, "allreduce"):
        "RRRRRRRRRRRRRRR DDDDDDDDDDRRRRR DDDDDDDRRRRRRRR DDDDDDDDDDHHRRR DDDDDDDDDRRRRRR DDDDDDDDDDRRRRR "
        "DDDDDDDDDDRRRRR DDDDDDDDDDHHHRR DDDDDDDDDDHRRRR DDDDDDDDDHHHHHR DDDDDDDDDHHHRRR DDDDDDDDDHHHHHR",
    ("tcp", 1048576, "rooted"):
        "CCCCCCCCCCCCCCC CCCCCCCCCCCCCCC CCCCCCCCCCCCCCC BBBBBBBBBBBBCCC BBBBBBBBBBBBCCC BBBBBBBBBBBBCCC "
        "BBBBBBBBBBBBCCC BBBBBBBBBBBBCCC BBBBBBBBBBBBBCC BBBBBBBBBBBBBCC BBBBBBBBBBBBBCC BBBBBBBBBBBBBBC",
    ("tcp", 1048576, "gather"):
        "ddddddddddddddd ddddddddddddddd ddddddddddddddd ddddddddddddddd ddddddddddddddd ddddddddddddddd "
        "ddddddddddddddd ddddddddddddddd ddddddddddddddd ddddddddddddddd ddddddddddddddd BBBBBBddddddddd",
    ("tcp", 1048576, "scatter"):
        "ddddddddddddddd ddddddddddddddd ddddddddddddddd ddddddddddddddd ddddddddddddddd ddddddddddddddd "
        "ddddddddddddddd ddddddddddddddd ddddddddddddddd ddddddddddddddd ddddddddddddddd BBBBBBddddddddd",
    ("soft", 65536, "allreduce"):
        "RRRRRRRRRRRRRRR DDDDDDDDRRRRRRR DDDDDDDRRRRRRRR DDDDDDDDHHRRRRR DDDDDDDDRRRRRRR DDDDDDDDRRRRRRR "
        "DDDDDDDDHRRRRRR DDDDDDDDHHHRRRR DDDDDDDDHHRRRRR DDDDDDDDHHHRRRR DDDDDDDHHHHRRRR DDDDDDDHHHHHHRR",
    ("soft", 65536, "rooted"):
        "CCCCCCCCCCCCCCC CCCCCCCCCCCCCCC CCCCCCCCCCCCCCC BBBBBBBBBCCCCCC BBBBBBBBBCCCCCC BBBBBBBBBCCCCCC "
        "BBBBBBBBBBCCCCC BBBBBBBBBBCCCCC BBBBBBBBBBCCCCC BBBBBBBBBBBCCCC BBBBBBBBBBBCCCC BBBBBBBBBBBCCCC",
    ("soft", 65536, "gather"):
        "ddddddddddddddd ddddddddddddddd ddddddddddddddd ddddddddddddddd ddddddddddddddd ddddddddddddddd "
        "ddddddddddddddd ddddddddddddddd ddddddddddddddd ddddddddddddddd ddddddddddddddd BBBBddddddddddd",
    ("soft", 65536, "scatter"):
        "ddddddddddddddd ddddddddddddddd dddddddrrrrrrrr dddddddrrrrrrrr dddddddrrrrrrrr ddddddrrrrrrrrr "
        "ddddddrrrrrrrrr ddddddrrrrrrrrr ddddddrrrrrrrrr dddddrrrrrrrrrr dddddrrrrrrrrrr BBBBBrrrrrrrrrr",
    ("soft", 1048576, "allreduce"):
        "RRRRRRRRRRRRRRR DDDDDDDDRRRRRRR DDDDDDDRRRRRRRR DDDDDDDDHHHRRRR DDDDDDDDRRRRRRR DDDDDDDDRRRRRRR "
        "DDDDDDDDHRRRRRR DDDDDDDDHHHHRRR DDDDDDDDHHRRRRR DDDDDDDDHHHHHRR DDDDDDDHHHHRRRR DDDDDDDHHHHHHHR",
    ("soft", 1048576, "rooted"):
        "CCCCCCCCCCCCCCC CCCCCCCCCCCCCCC CCCCCCCCCCCCCCC BBBBBBBBBBBBCCC BBBBBBBBBBBBCCC BBBBBBBBBBBBCCC "
        "BBBBBBBBBBBBCCC BBBBBBBBBBBBCCC BBBBBBBBBBBBBCC BBBBBBBBBBBBBCC BBBBBBBBBBBBBCC BBBBBBBBBBBBBBC",
    ("soft", 1048576, "gather"):
        "ddddddddddddddd ddddddddddddddd ddddddddddddddd ddddddddddddddd ddddddddddddddd ddddddddddddddd "
        "ddddddddddddddd ddddddddddddddd ddddddddddddddd ddddddddddddddd ddddddddddddddd BBBBddddddddddd",
    ("soft", 1048576, "scatter"):
        "ddddddddddddddd ddddddddddddddd dddddddrrrrrrrr dddddddrrrrrrrr dddddddrrrrrrrr ddddddrrrrrrrrr "
        "ddddddrrrrrrrrr ddddddrrrrrrrrr ddddddrrrrrrrrr dddddrrrrrrrrrr dddddrrrrrrrrrr BBBBBrrrrrrrrrr",
    ("custom", 65536, "allreduce"):
        "RRRRRRRRRRRRRRR DDDDDDDDRRRRRRR DDDDDDRRRRRRRRR DDDDDDDHHHRRRRR DDDDDDDRRRRRRRR DDDDDDDHRRRRRRR "
        "DDDDDDDHRRRRRRR DDDDDDDHHHHRRRR DDDDDDDHHHRRRRR DDDDDDDHHHHRRRR DDDDDDDHHHHRRRR DDDDDDDHHHHHHRR",
    ("custom", 65536, "rooted"):
        "CCCCCCCCCCCCCCC CCCCCCCCCCCCCCC CCCCCCCCCCCCCCC BBBBBBBBBCCCCCC BBBBBBBBBCCCCCC BBBBBBBBBCCCCCC "
        "BBBBBBBBBBCCCCC BBBBBBBBBBCCCCC BBBBBBBBBBCCCCC BBBBBBBBBBBCCCC BBBBBBBBBBBCCCC BBBBBBBBBBBCCCC",
    ("custom", 65536, "gather"):
        "ddddddddddddddd ddddddddddddddd ddddddddddddddd ddddddddddddddd ddddddddddddddd ddddddddddddddd "
        "ddddddddddddddd ddddddddddddddd ddddddddddddddd ddddddddddddddd ddddddddddddddd BBBBBdddddddddd",
    ("custom", 65536, "scatter"):
        "ddddddddddddddd ddddddddddddddd dddddddddddrrrr dddddddddddrrrr dddddddddddrrrr dddddddddddrrrr "
        "dddddddddddrrrr dddddddddddrrrr ddddddddddrrrrr ddddddddddrrrrr ddddddddddrrrrr BBBBBdddddrrrrr",
    ("custom", 1048576, "allreduce"):
        "RRRRRRRRRRRRRRR DDDDDDDDRRRRRRR DDDDDDRRRRRRRRR DDDDDDDHHHHRRRR DDDDDDDRRRRRRRR DDDDDDDHRRRRRRR "
        "DDDDDDDHRRRRRRR DDDDDDDHHHHHRRR DDDDDDDHHHRRRRR DDDDDDDHHHHHHRR DDDDDDDHHHHRRRR DDDDDDDHHHHHHHR",
    ("custom", 1048576, "rooted"):
        "CCCCCCCCCCCCCCC CCCCCCCCCCCCCCC CCCCCCCCCCCCCCC BBBBBBBBBBBBCCC BBBBBBBBBBBBCCC BBBBBBBBBBBBCCC "
        "BBBBBBBBBBBBCCC BBBBBBBBBBBBCCC BBBBBBBBBBBBBCC BBBBBBBBBBBBBCC BBBBBBBBBBBBBCC BBBBBBBBBBBBBBC",
    ("custom", 1048576, "gather"):
        "ddddddddddddddd ddddddddddddddd ddddddddddddddd ddddddddddddddd ddddddddddddddd ddddddddddddddd "
        "ddddddddddddddd ddddddddddddddd ddddddddddddddd ddddddddddddddd ddddddddddddddd BBBBBdddddddddd",
    ("custom", 1048576, "scatter"):
        "ddddddddddddddd ddddddddddddddd ddddddddddddddr dddddddddddddrr dddddddddddddrr dddddddddddddrr "
        "dddddddddddddrr dddddddddddddrr dddddddddddddrr dddddddddddddrr ddddddddddddrrr BBBBBdddddddrrr",
}


# All-to-all came after, and its write algorithm after that (p pairwise, s spread, w write): pairwise
# on 2 ranks and where the CPU moves the bytes (TCP, Soft-RoCE), else from 3 ranks on its exchanges
# together (spread); over RDMA from the size where a block's two more messages cost less than its
# copy out of a slot, the write (Soft-RoCE: 32 KiB, where the A/B on rxe put it), never over TCP.
_ALLTOALL_CHOICES = {
    ("rdma", 65536):
        "ppppppppppppppp pppppppppwwwwww ssssssssswwwwww ssssssssswwwwww sssssssssswwwww sssssssssswwwww "
        "sssssssssswwwww sssssssssswwwww sssssssssswwwww sssssssssswwwww sssssssssswwwww sssssssssswwwww",
    ("rdma", 1048576):
        "ppppppppppppppp pppppppppwwwwww ssssssssswwwwww sssssssssswwwww sssssssssswwwww sssssssssswwwww "
        "sssssssssswwwww sssssssssswwwww sssssssssswwwww sssssssssswwwww sssssssssswwwww sssssssssswwwww",
    ("tcp", 65536):
        "ppppppppppppppp ppppppppppppppp ppppppppppppppp ppppppppppppppp ppppppppppppppp ppppppppppppppp "
        "ppppppppppppppp ppppppppppppppp ppppppppppppppp ppppppppppppppp ppppppppppppppp ppppppppppppppp",
    ("tcp", 1048576):
        "ppppppppppppppp ppppppppppppppp ppppppppppppppp ppppppppppppppp ppppppppppppppp ppppppppppppppp "
        "ppppppppppppppp ppppppppppppppp ppppppppppppppp ppppppppppppppp ppppppppppppppp ppppppppppppppp",
    ("soft", 65536):
        "ppppppppppppppp pppppppwwwwwwww pppppppwwwwwwww pppppppwwwwwwww pppppppwwwwwwww pppppppwwwwwwww "
        "pppppppwwwwwwww pppppppwwwwwwww pppppppwwwwwwww pppppppwwwwwwww pppppppwwwwwwww pppppppwwwwwwww",
    ("soft", 1048576):
        "ppppppppppppppp pppppppwwwwwwww pppppppwwwwwwww pppppppwwwwwwww pppppppwwwwwwww pppppppwwwwwwww "
        "pppppppwwwwwwww pppppppwwwwwwww pppppppwwwwwwww pppppppwwwwwwww pppppppwwwwwwww pppppppwwwwwwww",
    ("custom", 65536):
        "ppppppppppppppp ppppppppwwwwwww sssssssswwwwwww sssssssswwwwwww sssssssswwwwwww sssssssswwwwwww "
        "sssssssswwwwwww sssssssswwwwwww sssssssswwwwwww sssssssswwwwwww sssssssswwwwwww sssssssswwwwwww",
    ("custom", 1048576):
        "ppppppppppppppp ppppppppwwwwwww sssssssswwwwwww sssssssswwwwwww sssssssswwwwwww sssssssswwwwwww "
        "sssssssswwwwwww sssssssswwwwwww sssssssswwwwwww sssssssswwwwwww sssssssswwwwwww sssssssswwwwwww",
}


def test_cost_model_choices_are_the_ones_before_the_registry():
    for (model, max_message, what), words in _CHOICES.items():
        m = CostModel(**_CHOICE_MODELS[model])
        choose = {"allreduce": m.choose_allreduce, "rooted": m.choose_rooted,
                  "gather": functools.partial(m.choose_copy, "gather"),
                  "scatter": functools.partial(m.choose_copy, "scatter")}[what]
        for n, word in zip(_CHOICE_RANKS, words.split(), strict=True):
            got = [choose(nbytes, n, max_message) for nbytes in _CHOICE_SIZES]
            assert got == [_CHOICE_LETTERS[c] for c in word], (model, max_message, what, n)
    for (model, max_message), words in _ALLTOALL_CHOICES.items():
        m = CostModel(**_CHOICE_MODELS[model])
        for n, word in zip(_CHOICE_RANKS, words.split(), strict=True):
            got = [m.choose_copy("alltoall", nbytes, n, max_message) for nbytes in _CHOICE_SIZES]
            assert got == [{"p": "pairwise", "s": "spread", "w": "write"}[c] for c in word], (model, max_message, n)


def test_an_alltoall_with_counts_writes_its_large_blocks_where_the_link_writes():
    """Counts differ per rank, so the choice is made without them (every rank's alike): the write
    algorithm where the link writes, whose blocks from written_from on are written and the others
    sent as the cheapest for a small block sends them (spread from 3 ranks with a NIC); over TCP
    the cheapest for a small block. The sizes: where a block's three more messages cost less than its
    copy out of a slot (a NIC's defaults, max_message 64 KiB: ~80 KB); on Soft-RoCE where the A/B found it (192 KiB)."""
    from pyrdma.collectives.algorithms import exchange
    from pyrdma.collectives.schedule import ASK, EXCHANGE, LANDED, NOTICE, PUT, SPREAD, WAIT_SENDS
    written = {model: CostModel(**_CHOICE_MODELS[model]).written_from(65536) for model in _CHOICE_MODELS}
    assert written == {"rdma": 80001, "tcp": None, "soft": 196608, "custom": 60001}, written
    for model in _CHOICE_MODELS:
        m = CostModel(**_CHOICE_MODELS[model])
        assert {m.choose_copy("alltoall", None, n, 65536) for n in (2, 3, 8)} == \
            {"pairwise" if model == "tcp" else "write"}, model
        if written[model] and not m.copy:      # the first size where its estimate is the lower
            w = written[model]
            for b, cheaper in ((w, True), (w - 1, False)):     # (a written block's notice ahead: alpha)
                assert (exchange.write_alltoall_cost(m, b, 2, 65536) + m.alpha <
                        exchange.pairwise_alltoall_cost(m, b, 2, 65536)) == cheaper, (model, b)
    # as the specs plan it, on rank 0 of 3: 8 bytes to rank 1 and 1 MiB to rank 2, 1 MiB from rank 1
    # and 8 bytes from rank 2. Step 1: 8 bytes to rank 1 out, rank 2's 8 in; step 2: rank 1 asked
    # for its block, rank 2 told that it is written, then asked for it and written; rank 1's notice
    # that it writes; then the notices behind the writes
    for model, slots in (("rdma", SPREAD), ("soft", EXCHANGE)):
        comm = types.SimpleNamespace(size=3, rank=0, cost_model=CostModel(**_CHOICE_MODELS[model]),
                                     transport=types.SimpleNamespace(max_message=65536))
        plan = specs.alltoall_planner(comm, specs.alltoall_entry(comm, None), True)
        steps = plan(3, 0, (0, 0, 8, 8 + (1 << 20)), (0, 0, 1 << 20, (1 << 20) + 8), 8 + (1 << 20), 65536).steps
        assert [tuple(int(v) for v in s[:3]) for s in steps] == \
            [(slots, 1, 2), (ASK, -1, 1), (NOTICE, 2, -1), (PUT, 2, -1), (LANDED, -1, 1), (NOTICE, 2, -1),
             (LANDED, -1, 1), (WAIT_SENDS, -1, -1)], model


def test_registry_entries_and_wire_ids():
    # the ids every message's description carries: any change here changes the wire
    assert algorithms.WIRE_NAMES == ("", "ring", "halving_doubling", "recursive_doubling", "chain", "binomial",
                                     "dissemination", "direct", "pairwise", "read", "spread", "write")
    from pyrdma.collectives import transport
    assert transport.DESC_ALGORITHMS is algorithms.WIRE_NAMES
    for collective, entries in algorithms.ALGORITHMS.items():
        for name, entry in entries.items():
            assert entry.name == name and callable(entry.planner) and callable(entry.cost), (collective, name)
            assert entry.wire_name in algorithms.WIRE_NAMES
    assert {c: algorithms.only(c).wire_id for c in ("allgather", "reduce_scatter", "barrier")} == \
        {"allgather": 0, "reduce_scatter": 0, "barrier": 6}
    assert {a.name: a.wire_id for a in algorithms.entries("alltoall")} == {"pairwise": 8, "spread": 10, "write": 11}
    assert algorithms.aliases("allreduce") == {"tree": "halving_doubling", "hd": "halving_doubling",
                                               "rd": "recursive_doubling"}
    assert algorithms.canonical("allreduce", "rd") == "recursive_doubling"
    assert algorithms.canonical("allreduce", "ring") == "ring" and algorithms.canonical("gather", "x") == "x"
    rd = algorithms.ALGORITHMS["allreduce"]["recursive_doubling"]
    assert rd.double_area and rd.in_place_instead in algorithms.ALGORITHMS["allreduce"]
    assert pyrdma.collectives.ALGORITHMS == ("auto", "ring", "halving_doubling", "recursive_doubling", "tree", "hd",
                                             "rd")
    with pytest.raises(ValueError):
        algorithms.only("allreduce")


class _AlwaysRing(CostModel):
    def choose_allreduce(self, nbytes, n, max_message):
        self.calls = getattr(self, "calls", 0) + 1
        return "ring"


def test_custom_cost_model_is_used():
    port = free_port()
    models = [_AlwaysRing(), _AlwaysRing()]

    def rank_fn(rank):
        with Communicator(rank, 2, f"127.0.0.1:{port}", transport="tcp", cost_model=models[rank]) as comm:
            comm.allreduce(np.ones(3))
            return comm.cost_model.calls
    assert in_threads(2, rank_fn) == [1, 1]


def test_cuda_arrays_take_the_staging_hook_or_get_a_clear_error():
    class FakeCuda:   # looks like a CuPy array; no GPU needed
        __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (0, False), "version": 3}
    with Communicator(0, 1, "127.0.0.1:0", transport="tcp") as comm:
        for call in (lambda: comm.allreduce(FakeCuda(), out=np.zeros(4)),
                     lambda: comm.allgather(FakeCuda(), out=np.zeros(4)),
                     lambda: comm.reduce_scatter(np.zeros(4), out=FakeCuda())):
            with pytest.raises(pyrdma.UsageError, match="must both be CUDA arrays or both host arrays"):
                call()
        with pytest.raises(pyrdma.UsageError, match="unsupported op"):
            comm.allreduce(FakeCuda(), op="xor")
        try:
            import cupy  # noqa: F401
        except ImportError:
            # the collectives, blocking or not, hand CUDA arrays to pyrdma.cuda's staging, which needs CuPy
            for call in (comm.allreduce, comm.reduce, comm.broadcast, comm.allgather, comm.reduce_scatter,
                         comm.iallreduce, comm.ireduce, comm.ibroadcast, comm.iallgather, comm.ireduce_scatter,
                         comm.igather, comm.ialltoall, lambda b: comm.batch([("send", b, 0)])):
                with pytest.raises(pyrdma.RDMAError, match="CuPy"):
                    call(FakeCuda())


class _ConsumingHostArea(HostMemory):
    """Host memory as a direct collective's work area whose received chunks go through Python with
    its own ``reduce``, as a GPU work area's (pyrdma.cuda's DirectArea) do."""
    consumes = True

    def __init__(self, **attributes):
        self.__dict__.update(attributes)


def test_in_place_path_runs_the_algorithms_on_the_callers_memory():
    # gpu_path "direct" runs the algorithms in place with reductions passed in (CUDA kernels on a
    # GPU); here the same machinery on host memory with the host reductions
    from pyrdma import _reduce
    port = free_port()
    code = _reduce.dtype_code(np.int32)

    def rank_fn(rank):
        with Communicator(rank, 3, f"127.0.0.1:{port}", transport="tcp", max_message=256, timeout=20) as comm:
            x = np.arange(1001, dtype=np.int32) * (rank + 1)
            reduce = functools.partial(_reduce.reduce_bytes, dtype=code, op=_reduce.op_code("sum"))
            steps = []

            def in_place(spec):       # as Communicator._direct_job runs a CUDA array's spec
                return comm._exec.submit(True, comm._run_spec, spec).wait()

            def before(work):
                steps.append(("before", work.nbytes))

            def after(work):      # op="avg" of integers: the sum divided by n after it, as Avg does
                steps.append(("after", work.nbytes))
                _reduce.divide_bytes(work, code, 3)
            for algorithm in ("ring", "recursive_doubling"):     # the latter runs as halving-doubling
                y = x.copy()
                area = _ConsumingHostArea(bytes=y.view(np.uint8), count=y.size, itemsize=4, code=code,
                                          reduce=reduce, before=before, after=after)
                del steps[:]
                in_place(specs.allreduce_direct(comm, area, "avg", algorithm))
                assert (y == np.arange(1001) * 2).all()              # (1 + 2 + 3) / 3
                # one run, whole: before it the input, after it the result, in the caller's memory
                assert steps == [("before", 4004), ("after", 4004)]
            b = np.arange(300, dtype=np.float64) if rank == 1 else np.zeros(300)
            in_place(specs.broadcast_direct(comm, _ConsumingHostArea(bytes=b.view(np.uint8), dtype_name="float64",
                                                                     reduce=None), 1, "auto"))
            return bool((b == np.arange(300)).all())
    assert in_threads(3, rank_fn) == [True, True, True]
    with pytest.raises(pyrdma.UsageError, match="unknown gpu_path"):
        Communicator(0, 1, "127.0.0.1:0", transport="tcp", gpu_path="gpudirect")


@pytest.mark.parametrize("bad", [0, 32, -1])
def test_rdma_transport_rejects_an_ack_timeout_out_of_range(bad):
    from pyrdma.collectives.transport import RdmaTransport
    # checked before any device or peer is touched: exchange=None is never used
    with pytest.raises(pyrdma.UsageError, match=r"qp_timeout must be within 1\.\.31"):
        RdmaTransport(0, 2, None, qp_timeout=bad)


def test_ranks_must_agree_on_the_message_size():
    port = free_port()

    def rank_fn(rank):
        return Communicator(rank, 2, f"127.0.0.1:{port}", transport="tcp", timeout=10,
                            max_message=4096 * (rank + 1))
    for r in in_threads(2, rank_fn):
        assert isinstance(r, pyrdma.UsageError) and "max_message" in str(r)
