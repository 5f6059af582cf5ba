"""Fuzzing every wire parser of the out-of-band exchanges: random bytes and mutated valid records,
seeded, several thousand cases, bounded time. A parser may only accept or raise an error of
pyrdma's hierarchy (RDMAError): never another exception, never a hang (every socket read has a
deadline) and never a large allocation (tracemalloc's peak stays small, so no length from a peer
is trusted beyond its bound)."""
import json
import random
import socket
import struct
import threading
import time
import tracemalloc

import numpy as np
import pytest

import pyrdma
from pyrdma import wire
from pyrdma.collectives import bootstrap
from pyrdma.collectives.bootstrap import MPIExchange, TCPStore
from pyrdma.connect import FRAMING as CONNECT, Listener, accept_verified, dial_exchange
from pyrdma.endpoint import Endpoint
from pyrdma.perf import cli, oob, side
from pyrdma.perf import perftest_wire as pw

SEED = 0x5EED_16
CASES = 3000
# No case may make a parser hold more than this (the largest bound of any format is 128 MiB).
PEAK_LIMIT = 4 << 20

EP = Endpoint(qpn=0x1234, psn=0x42, lid=7, gid=bytes(10) + b"\xff\xff\x7f\x00\x00\x01", gid_index=1, mtu=5,
              addr=0x7F0000001000, rkey=0xABCD, length=1 << 20)


def mutate(rng, data):
    """A few random edits of ``data``: flips, cuts, insertions, and lengths set to extremes."""
    data = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(7)
        if op == 0 and data:
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        elif op == 1 and data:
            del data[rng.randrange(len(data)):]
        elif op == 2:
            pos = rng.randint(0, len(data))
            data[pos:pos] = rng.randbytes(rng.randint(1, 16))
        elif op == 3 and len(data) >= 4:    # a 32-bit field (a length, a count) set to an extreme
            pos = rng.randrange(len(data) - 3)
            data[pos:pos + 4] = struct.pack("!I", rng.choice([0, 1, 0x7FFFFFFF, 0xFFFFFFFF, len(data) * 2]))
        elif op == 4 and len(data) >= 8:
            pos = rng.randrange(len(data) - 7)
            data[pos:pos + 8] = struct.pack("!Q", rng.choice([0, 1 << 63, (1 << 64) - 1, 1 << 40]))
        elif op == 5 and data:
            data[rng.randrange(len(data))] = rng.randrange(256)
        else:
            data += data[:rng.randint(0, len(data))]
    return bytes(data)


def cases(rng, samples, n=CASES):
    """n inputs: a third random bytes, the rest mutated samples."""
    for i in range(n):
        if i % 3 == 0:
            yield rng.randbytes(rng.choice([0, 1, 7, 16, 28, 60, 108, rng.randint(0, 400)]))
        else:
            yield mutate(rng, rng.choice(samples))


def expect_hierarchy(fn, data):
    """fn(data) returns or raises RDMAError; anything else fails the test (with the input)."""
    try:
        fn(data)
    except pyrdma.RDMAError:
        pass
    except Exception as exc:   # noqa: BLE001 -- the point of the test
        pytest.fail(f"{fn.__qualname__}({data[:80]!r}...) raised {type(exc).__name__}: {exc}")


@pytest.fixture
def bounded_memory():
    tracemalloc.start()
    start = time.monotonic()
    yield
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < PEAK_LIMIT, f"a parser held {peak} bytes"
    assert time.monotonic() - start < 120


def _session_frames(framing, kind, body, fields=(), secret=None):
    """A greeting and one tagged frame, as a peer that already heard our greeting sends them."""
    me, peer = wire.Session(framing, b"D", secret), wire.Session(framing, b"L", secret)
    me.take_greeting(wire.GREETING, peer.greeting()[framing.header.size:-wire.TAG_SIZE], "peer")
    return me.greeting() + me.pack(kind, body, fields)


FRAMINGS = {
    "rendezvous": (bootstrap.FRAMING, [_session_frames(bootstrap.FRAMING, bootstrap.JOIN, b"record", (1, 4, 1)),
                                       bootstrap.FRAMING.pack(bootstrap.TABLE, bootstrap._encode_table([b"a", b""]),
                                                              (0, 2, 3)),
                                       bootstrap.FRAMING.pack(bootstrap.ERROR, b"why", (0, 2, 1))]),
    "connect": (CONNECT, [_session_frames(CONNECT, 1, EP.to_bytes()), CONNECT.pack(2), CONNECT.pack(3, b"no")]),
    "perf": (oob.FRAMING, [_session_frames(oob.FRAMING, oob.HELLO, b'{"test": "write_bw"}'),
                           oob.encode_frame(oob.ENDPOINTS, oob.encode_endpoints([EP, EP])),
                           oob.encode_frame(oob.SYNC, b"go:loop:64")]),
}


@pytest.mark.parametrize("name", list(FRAMINGS))
def test_fuzz_frame_headers_and_splitting(name, bounded_memory):
    framing, samples = FRAMINGS[name]
    rng = random.Random(f"{SEED}-{name}")
    session = wire.Session(framing, b"L", b"secret")
    session.peer_nonce = bytes(16)

    def parse(data):
        framing.parse_header(data[:framing.header.size])

    def split_all(data):
        buf = bytearray(data)
        while True:
            got = framing.split(buf)
            if got is None:
                return
            kind, fields, body, tag, head, used = got
            assert used <= len(data) and len(body) <= framing.limit(kind)
            del buf[:used]
            if kind == wire.GREETING:
                session.take_greeting(kind, body, "fuzz")
            else:
                session.verify(head, body, tag, "fuzz")
    for data in cases(rng, samples):
        expect_hierarchy(parse, data)
        expect_hierarchy(split_all, data)


@pytest.mark.parametrize("name", list(FRAMINGS))
def test_fuzz_framed_reads_from_a_socket(name, bounded_memory):
    """Framing.recv over a real socket: a frame that claims more than arrives ends in PeerError
    when the sender closes, never in a read of the claimed length."""
    framing, samples = FRAMINGS[name]
    rng = random.Random(f"{SEED}-sock-{name}")
    for data in cases(rng, samples, n=400):
        a, b = socket.socketpair()
        with a, b:
            b.sendall(data)
            b.shutdown(socket.SHUT_WR)
            expect_hierarchy(lambda d: framing.recv(a, "fuzz", time.monotonic() + 2), data)


def test_fuzz_records_and_payloads(bounded_memory):
    rng = random.Random(f"{SEED}-records")
    ep_samples = [EP.to_bytes(), Endpoint(qpn=1, psn=2).to_bytes()]
    for data in cases(rng, ep_samples):
        expect_hierarchy(Endpoint.from_bytes, data)
    for data in cases(rng, [oob.encode_endpoints([EP] * k) for k in (0, 1, 3)]):
        expect_hierarchy(oob.decode_endpoints, data)
        expect_hierarchy(oob.decode_header, data[:oob.HEADER_SIZE])
    for data in cases(rng, [bootstrap._encode_table([b"ab", b"", b"c" * 40]), bootstrap._encode_table([b"x"])]):
        for size in (1, 3):
            expect_hierarchy(lambda d: bootstrap._decode_table(d, size), data)
    hello = json.dumps(_cfg("write_bw", "-s", "64", "h").run_params()).encode()
    deep = b"[" * 50000 + b"]" * 50000      # json's recursion limit
    for data in list(cases(rng, [hello, b'{"report": {"size": 1}}'])) + [deep]:
        expect_hierarchy(oob.decode_json, data)


def test_fuzz_greetings_and_tags(bounded_memory):
    rng = random.Random(f"{SEED}-session")
    for secret in (None, b"k"):
        for data in cases(rng, [wire.Session(CONNECT, b"L", secret).greeting()[CONNECT.header.size:-32]]):
            s = wire.Session(CONNECT, b"D", secret)
            expect_hierarchy(lambda d: s.take_greeting(wire.GREETING, d, "fuzz"), data)
        s = wire.Session(CONNECT, b"D", b"k")
        s.peer_nonce = bytes(16)
        for data in cases(rng, [bytes(64)], n=500):
            with pytest.raises(pyrdma.WireFormatError, match="authentication"):
                s.verify(data[:CONNECT.header.size], data, data[-32:], "fuzz")


def _cfg(*argv):
    return cli.Config(cli.build_parser().parse_intermixed_args(list(argv)))


def _mutate_obj(rng, obj, depth=0):
    """A JSON value like ``obj`` with random replacements (types, extremes, nesting)."""
    extremes = [None, True, False, -1, 0, 1 << 62, 1e308, float("nan"), float("inf"), "", "x" * 100, [], {},
                [1 << 40], ["loop", "loop"], [[]], {"a": 1}]
    if rng.random() < 0.3 or depth > 3:
        return rng.choice(extremes)
    if isinstance(obj, dict):
        out = {k: (_mutate_obj(rng, v, depth + 1) if rng.random() < 0.3 else v) for k, v in obj.items()}
        if rng.random() < 0.2 and out:
            out.pop(rng.choice(list(out)))
        return out
    if isinstance(obj, list):
        return [_mutate_obj(rng, v, depth + 1) if rng.random() < 0.5 else v for v in obj] * rng.choice([1, 1, 100])
    return obj


def test_fuzz_perf_hello_parameters_and_reports(bounded_memory):
    rng = random.Random(f"{SEED}-params")
    servers = {t: _cfg(t) for t in ("write_bw", "read_lat", "atomic_bw", "send_bw")}
    samples = [_cfg(t, *extra, "h").run_params() for t, extra in
               [("write_bw", ["-a"]), ("read_lat", ["-D", "4"]), ("atomic_bw", []), ("send_bw", ["-q", "2"])]]
    accepted = 0
    for _ in range(CASES):
        params = _mutate_obj(rng, rng.choice(samples))
        server = servers[rng.choice(list(servers))]
        try:
            out = server.check_params(params) if isinstance(params, dict) else None
        except pyrdma.UsageError:
            continue
        if out is None:
            continue
        accepted += 1   # what passes is within every bound
        assert max(out["sizes"]) <= server.args.max_size and out["iters"] <= cli.MAX_ITER
        assert out["num_qps"] <= oob.MAX_QPS and 1 <= out["post_list"] <= cli.MAX_TX
    assert accepted > 0
    report = {"size": 64, "iters": 100, "bw_peak": 1.0, "bw_avg": 1.0, "msg_rate": 0.1, "gbits": False}
    for _ in range(CASES):
        d = _mutate_obj(rng, report)
        kind = rng.choice(["BWReport", "LatReport", "LatDurationReport", "nonsense", None, 5])
        try:
            side.report_from_dict(d, kind)
        except pyrdma.WireFormatError:
            pass


class _FakeSock:
    def __init__(self, data):
        self.data = data

    def settimeout(self, t):
        pass

    def sendall(self, data):
        pass

    def recv(self, n):
        out, self.data = self.data[:n], self.data[n:]
        return out

    def gettimeout(self):
        return 1.0

    def close(self):
        pass


def test_fuzz_perftest_exchange(bounded_memory):
    rng = random.Random(f"{SEED}-perftest")
    dest = pw.Dest(lid=1, out_reads=16, qpn=0x11, psn=0x22, rkey=0x33, vaddr=0x7F0000001000, gid=bytes(range(16)))
    for with_gid in (True, False):
        size = pw.KEY_MSG_SIZE_GID if with_gid else pw.KEY_MSG_SIZE
        for data in cases(rng, [pw.encode_dest(dest, with_gid)]):
            expect_hierarchy(lambda d: pw.decode_dest(d[:size], with_gid), data)
    for data in cases(rng, [pw.encode_version(), b"5.70".ljust(16, b"\0"), b"nan".ljust(16, b"\0")]):
        expect_hierarchy(pw.decode_version, data[:16])
    for data in cases(rng, [pw.encode_report(65536, 5000, 1.0, 1.0, 0.1)]):
        expect_hierarchy(pw.decode_report, data)
    for data in cases(rng, [struct.pack("!ii", 4096, 64)], n=1000):
        conv = pw.Conversation(_FakeSock(data + bytes(8)), "fuzz", client=True)
        try:
            cycle, line = conv.sys_data(4096)
            assert cycle <= max(4096, pw.MAX_CYCLE_BUFFER) and line <= pw.MAX_CACHE_LINE
        except pyrdma.RDMAError:
            pass
        conv = pw.Conversation(_FakeSock(data[:2]), "fuzz", client=True)
        expect_hierarchy(lambda d: conv.mtu(5), data)


def test_fuzz_mpi_lengths(bounded_memory, monkeypatch):
    """MPIExchange allocates the sum of the lengths the other ranks announce: bounded first."""
    rng = random.Random(f"{SEED}-mpi")
    monkeypatch.setattr(bootstrap, "_mpi_byte", lambda: None)    # no MPI needed for the fake

    class Done:
        def Test(self):
            return True

    class FakeComm:
        def __init__(self, lengths):
            self.lengths = lengths

        def Get_rank(self):
            return 0

        def Get_size(self):
            return len(self.lengths)

        def Iallgather(self, mine, out):
            out[:] = self.lengths
            return Done()

        def Iallgatherv(self, mine, spec):
            return Done()
    for _ in range(300):
        lengths = [rng.choice([0, 5, -1, 1 << 40, -(1 << 62), (1 << 63) - 1, bootstrap.MAX_PAYLOAD])
                   for _ in range(rng.randint(1, 4))]
        lengths[0] = 3
        ex = MPIExchange(FakeComm(np.array(lengths, np.int64)))
        expect_hierarchy(ex.allgather, b"abc")


# ---- the live listeners and dialers, against mutated conversations ---------------------------------

def test_fuzz_rendezvous_server_then_a_member_joins():
    """Rank 0 with a secret takes several hundred fuzzed connections, then serves rank 1."""
    rng = random.Random(f"{SEED}-rv-server")
    secret = b"fuzz-job"
    store0 = TCPStore("127.0.0.1", 0, 0, 2, timeout=60, secret=secret)
    port = store0.port
    samples = [_session_frames(bootstrap.FRAMING, bootstrap.JOIN, b"one", (1, 2, 1), secret),
               _session_frames(bootstrap.FRAMING, bootstrap.JOIN, b"one", (1, 2, 1))]

    def fuzz_then_join():
        for data in cases(rng, samples, n=300):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(data)
        with TCPStore("127.0.0.1", port, 1, 2, timeout=30, secret=secret) as store:
            return store.allgather(b"one")
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r1", fuzz_then_join()), daemon=True)
    t.start()
    with store0:
        assert store0.allgather(b"zero") == [b"zero", b"one"]
    t.join(30)
    assert out["r1"] == [b"zero", b"one"]


def _fake_server(replies, greet=None):
    """A server that, per connection, optionally greets, reads a little, sends one reply and
    closes; returns (port, thread)."""
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(30)

    def serve():
        with srv:
            for reply in replies:
                try:
                    conn, _ = srv.accept()
                except OSError:
                    return
                with conn:
                    conn.settimeout(5)
                    try:
                        if greet is not None:
                            conn.sendall(greet)
                        conn.sendall(reply)
                        conn.shutdown(socket.SHUT_WR)
                        conn.recv(4096)
                    except OSError:
                        pass
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return srv.getsockname()[1], t


def test_fuzz_rendezvous_client_against_a_hostile_rank0(bounded_memory):
    rng = random.Random(f"{SEED}-rv-client")
    greeting = wire.Session(bootstrap.FRAMING, b"L").greeting()
    samples = [greeting + bootstrap.FRAMING.pack(bootstrap.TABLE, bootstrap._encode_table([b"a", b"b"]), (0, 2, 1)),
               greeting + bootstrap.FRAMING.pack(bootstrap.ERROR, b"no", (0, 2, 1))]
    replies = list(cases(rng, samples, n=200))
    port, t = _fake_server(replies)
    for _ in replies:
        expect_hierarchy(lambda d: TCPStore("127.0.0.1", port, 1, 2, timeout=2).allgather(d), b"rec")
    t.join(10)


def test_fuzz_connect_dialer_and_listener(bounded_memory):
    rng = random.Random(f"{SEED}-connect")
    listener_greeting = wire.Session(CONNECT, b"L").greeting()
    samples = [listener_greeting + CONNECT.pack(1, EP.to_bytes()), listener_greeting + CONNECT.pack(3, b"refused")]
    replies = list(cases(rng, samples, n=200))
    port, t = _fake_server(replies)
    for _ in replies:
        def dial(_):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                dial_exchange(s, "fuzz", EP, None, time.monotonic() + 2)
        expect_hierarchy(dial, b"")
    t.join(10)
    # the accepting side: fuzzed dialers, then a member. Without a secret the tags are not checked,
    # so a mutation of only the tag or a nonce is a valid dialer that may be accepted first: the
    # member is told apart by its own endpoint.
    member_ep = Endpoint(qpn=0x777, psn=0x88)
    dialer = [_session_frames(CONNECT, 1, EP.to_bytes())]
    with Listener("127.0.0.1", 0) as listener:
        def fuzz_then_member():
            for data in cases(rng, dialer, n=300):
                with socket.create_connection(("127.0.0.1", listener.port), timeout=5) as s:
                    s.sendall(data)
            with socket.create_connection(("127.0.0.1", listener.port), timeout=5) as s:
                return dial_exchange(s, "listener", member_ep, None, time.monotonic() + 30)[1]
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("remote", fuzz_then_member()), daemon=True)
        t.start()
        deadline = time.monotonic() + 60
        accepted = []
        while True:
            sock, who, session, remote = accept_verified(listener, Endpoint(qpn=5, psn=6), None, deadline)
            sock.close()
            accepted.append(remote)
            if remote == member_ep:
                break
        t.join(30)
    assert not t.is_alive()
    assert out["remote"] == Endpoint(qpn=5, psn=6)
    assert len(accepted) < 30, "most fuzzed dialers must be refused"


def test_fuzz_perf_channel(bounded_memory):
    rng = random.Random(f"{SEED}-perf-channel")
    greeting = wire.Session(oob.FRAMING, b"L").greeting()
    samples = [greeting + oob.encode_frame(k, p) for k, p in
               [(oob.HELLO, b'{"test": "write_bw"}'), (oob.ENDPOINTS, oob.encode_endpoints([EP])),
                (oob.SYNC, b"rts"), (oob.ERROR, b"x"), (oob.REPORT, b'{"report": null}')]]
    for data in cases(rng, samples, n=600):
        a, b = socket.socketpair()
        with a, b:
            b.sendall(data)
            b.shutdown(socket.SHUT_WR)
            ch = oob.Channel(a, "fuzz", timeout=2)
            for call in (lambda: ch.recv_json(oob.HELLO), lambda: ch.exchange_endpoints([EP]), lambda: ch.sync("rts")):
                expect_hierarchy(lambda d: call(), data)
