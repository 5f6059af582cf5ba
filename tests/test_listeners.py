"""Every listener against strangers, on loopback: the rendezvous (TCPStore), accept()'s admission
(connect.accept_verified) and the perf server (oob.listen). Each binds the address it was given,
serves members while strangers connect and close, stay silent, trickle, send garbage, claim a rank
already taken or hold the wrong secret; the job completes and the stranger is dropped."""
import json
import socket
import threading
import time

import pytest

import pyrdma
from pyrdma import wire
from pyrdma.collectives import TCPStore, bootstrap
from pyrdma.connect import FRAMING as CONNECT, Listener, accept_verified, dial_exchange
from pyrdma.endpoint import Endpoint
from pyrdma.perf import cli, oob
from pyrdma.testing import free_port


def in_threads(fns, timeout=60):
    """Run each fn in a thread; their results (or raised exceptions) in order."""
    results = [None] * len(fns)

    def run(i):
        try:
            results[i] = fns[i]()
        except BaseException as exc:   # returned to the test
            results[i] = exc
    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    return results


def reachable(host, port):
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


# ---- binding ------------------------------------------------------------------------------------

def test_rendezvous_binds_the_master_address():
    with TCPStore("127.0.0.2", 0, 0, 2, timeout=5) as store:
        assert store._listener.getsockname()[0] == "127.0.0.2"
        assert reachable("127.0.0.2", store.port)
        assert not reachable("127.0.0.1", store.port)     # not every interface
    with TCPStore("localhost", 0, 0, 2, timeout=5) as store:
        assert store._listener.getsockname()[0] == "127.0.0.1"
    with TCPStore("127.0.0.2", 0, 0, 2, timeout=5, bind="0.0.0.0") as store:   # asked for explicitly
        assert reachable("127.0.0.1", store.port)


def test_own_hostname_that_resolves_to_loopback_binds_every_interface(monkeypatch):
    # Debian's /etc/hosts maps the machine's own name to 127.0.1.1; other hosts resolve it to the real
    # address, so a MASTER_ADDR naming this host must not be kept on loopback. Other names still are.
    monkeypatch.setattr(socket, "gethostname", lambda: "node7")
    monkeypatch.setattr(socket, "getfqdn", lambda *a: "node7.cluster")
    real = socket.getaddrinfo
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *a, **k: real(
        "127.0.1.1" if host in ("node7", "node7.cluster", "elsewhere") else host, *a, **k))
    assert wire.bind_address("node7") == (socket.AF_INET, "0.0.0.0")
    assert wire.bind_address("node7.cluster") == (socket.AF_INET, "0.0.0.0")
    assert wire.bind_address("elsewhere") == (socket.AF_INET, "127.0.1.1")
    assert wire.bind_address("localhost")[1] in ("127.0.0.1", "::1")
    assert wire.bind_address("127.0.1.1") == (socket.AF_INET, "127.0.1.1")


def test_accept_listener_binds_the_address_given():
    with Listener("127.0.0.2", 0) as listener:
        assert reachable("127.0.0.2", listener.port)
        assert not reachable("127.0.0.1", listener.port)
    with Listener("0.0.0.0", 0) as listener:   # the documented default: every interface
        assert reachable("127.0.0.1", listener.port) and reachable("127.0.0.2", listener.port)


def test_perf_server_binds_its_bind_option():
    args = cli.build_parser().parse_intermixed_args(["write_bw", "--bind", "127.0.0.2"])
    assert args.bind == "127.0.0.2"
    assert cli.build_parser().parse_intermixed_args(["write_bw"]).bind == "0.0.0.0"
    port = free_port("127.0.0.2")
    got = {}

    def server():
        got["ch"], got["hello"] = oob.listen(port, host="127.0.0.2", timeout=10)
        got["ch"].close()
    t = threading.Thread(target=server, daemon=True)
    t.start()
    time.sleep(0.3)
    assert not reachable("127.0.0.1", port)
    with oob.dial("127.0.0.2", port, timeout=10) as ch:
        ch.send_json(oob.HELLO, {"test": "write_bw"})
    t.join(10)
    assert got["hello"] == {"test": "write_bw"}


# ---- strangers at the rendezvous ----------------------------------------------------------------

def _join_frames(rank, size, rnd, record, secret=None):
    """What a member sends, given rank 0's greeting (read from ``sock``) -- for strangers that
    speak the protocol."""
    def talk(sock):
        session = wire.Session(bootstrap.FRAMING, b"D", secret and wire.job_secret(secret))
        kind, _, body, _, _ = bootstrap.FRAMING.recv(sock, "rank 0", time.monotonic() + 5)
        session.take_greeting(kind, body, "rank 0")
        sock.sendall(session.greeting() + session.pack(bootstrap.JOIN, record, (rank, size, rnd)))
        return bootstrap.FRAMING.recv(sock, "rank 0", time.monotonic() + 10)
    return talk


def _wait_until(cond, timeout=10):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.01)


@pytest.mark.parametrize("secret", [None, "job-7f3a"])
def test_rendezvous_survives_strangers(secret):
    size = 4
    store0 = TCPStore("127.0.0.1", 0, 0, size, timeout=30, secret=secret)
    port = store0.port
    stranger_results = {}
    strangers_done = threading.Event()

    def member(rank):
        with TCPStore("127.0.0.1", port, rank, size, timeout=30, secret=secret) as store:
            return store.allgather(f"rank{rank}".encode()), store.allgather(b"again")

    def strangers():
        socks = []
        # a health check: connect and close
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        # a silent connection and a trickling one, held open during the whole rendezvous
        socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        trickle = socket.create_connection(("127.0.0.1", port), timeout=5)
        socks.append(trickle)
        # garbage bytes, and an HTTP request
        for junk in (bytes(range(256)) * 4, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(junk)
        # a frame claiming a huge length: refused from its header, nothing read or allocated
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(bootstrap.FRAMING.header.pack(bootstrap.MAGIC, bootstrap.VERSION, bootstrap.JOIN,
                                                    1, size, 1, 0xFFFFFFFF))
        # the wrong secret (or none, where the job has one)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            try:
                stranger_results["wrong"] = _join_frames(2, size, 1, b"evil", secret=b"wrong")(s)
            except pyrdma.RDMAError as exc:
                stranger_results["wrong"] = exc
        # a second claim of rank 1, once the real rank 1 holds it
        _wait_until(lambda: 1 in store0.present)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            stranger_results["dup"] = _join_frames(1, size, 1, b"evil", secret=secret)(s)
        for i in range(3):
            trickle.send(b"P")
            time.sleep(0.05)
        strangers_done.set()
        return socks

    def rank0():
        with store0:
            return store0.allgather(b"rank0"), store0.allgather(b"again")

    def late(rank):   # rank 3 comes after the strangers did their worst, so round 1 waits for them
        def go():
            strangers_done.wait(30)
            return member(rank)
        return go

    results = in_threads([rank0, lambda: member(1), lambda: member(2), late(3), strangers])
    *ranks, socks = results
    for sock in (socks if isinstance(socks, list) else []):
        sock.close()
    assert not isinstance(socks, BaseException), socks
    for r, res in enumerate(ranks):
        assert not isinstance(res, BaseException), f"rank {r}: {res!r}"
        first, second = res
        assert first == [b"rank0", b"rank1", b"rank2", b"rank3"]
        assert second == [b"again"] * 4
    # the duplicate was refused without disturbing rank 1; the stranger learns why
    kind, _, body, _, _ = stranger_results["dup"]
    assert kind == bootstrap.ERROR and b"rank 1, which another connection already holds" in body
    wrong = stranger_results["wrong"]
    if secret:
        text = repr(wrong) if isinstance(wrong, BaseException) else wrong[2].decode()
        assert "secret" in text or "authentication" in text
    notes = "; ".join(store0.refused) + repr(stranger_results)
    assert "already holds" in notes


def test_rendezvous_drops_a_silent_connection_after_the_handshake_timeout(monkeypatch):
    monkeypatch.setattr(bootstrap, "Doorman", _short_doorman(0.3))
    store0 = TCPStore("127.0.0.1", 0, 0, 2, timeout=2)
    silent = socket.create_connection(("127.0.0.1", store0.port), timeout=5)
    try:
        with store0, pytest.raises(pyrdma.RDMATimeoutError, match="did not greet and speak within 0.3 s"):
            store0.allgather(b"x")
    finally:
        silent.close()


def _short_doorman(seconds):
    class Short(wire.Doorman):
        def __init__(self, *args, **kwargs):
            kwargs["handshake"] = seconds
            super().__init__(*args, **kwargs)
    return Short


def test_rendezvous_refuses_a_flood_without_keeping_members_out():
    size = 2
    store0 = TCPStore("127.0.0.1", 0, 0, size, timeout=20)
    port = store0.port
    flood = []

    def member():
        for _ in range(bootstrap.MAX_PENDING + 20):   # more silent connections than it holds
            flood.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        with TCPStore("127.0.0.1", port, 1, size, timeout=20) as store:
            return store.allgather(b"one")
    try:
        res = in_threads([lambda: store0.allgather(b"zero"), member])
    finally:
        for s in flood:
            s.close()
        store0.close()
    assert res == [[b"zero", b"one"], [b"zero", b"one"]]
    assert any("too many connections" in why for why in store0.refused)


def test_a_member_with_the_wrong_secret_is_told_and_named():
    port = free_port()
    res = in_threads([lambda: TCPStore("127.0.0.1", port, 0, 2, timeout=2, secret="right").allgather(b"a"),
                      lambda: TCPStore("127.0.0.1", port, 1, 2, timeout=2, secret="wrong").allgather(b"b")])
    assert isinstance(res[0], pyrdma.RDMATimeoutError) and "failed authentication" in str(res[0])
    assert isinstance(res[1], pyrdma.PeerError) and "failed authentication" in str(res[1])
    port = free_port()
    res = in_threads([lambda: TCPStore("127.0.0.1", port, 0, 2, timeout=2, secret="right").allgather(b"a"),
                      lambda: TCPStore("127.0.0.1", port, 1, 2, timeout=2).allgather(b"b")])
    assert isinstance(res[1], pyrdma.WireFormatError) and "PYRDMA_JOB_SECRET" in str(res[1])


def test_the_secret_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("PYRDMA_JOB_SECRET", "from-env")
    assert TCPStore("127.0.0.1", 0, 1, 2).secret == b"from-env"
    monkeypatch.delenv("PYRDMA_JOB_SECRET")
    assert TCPStore("127.0.0.1", 0, 1, 2).secret is None
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "RANK": "1", "WORLD_SIZE": "2",
           "PYRDMA_JOB_SECRET": "in-dict"}
    assert TCPStore.from_env(env).secret == b"in-dict"


def test_a_recorded_join_does_not_replay():
    """A join captured on the wire (with the right secret) is useless on a new connection: rank 0's
    nonce differs, so its tag does not verify."""
    secret = b"s"
    store0 = TCPStore("127.0.0.1", 0, 0, 2, timeout=3, secret=secret)
    port = store0.port
    captured = {}

    def member():   # speaks for rank 1 and records what it sent
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            session = wire.Session(bootstrap.FRAMING, b"D", secret)
            kind, _, body, _, _ = bootstrap.FRAMING.recv(s, "rank 0", time.monotonic() + 5)
            session.take_greeting(kind, body, "rank 0")
            captured["bytes"] = session.greeting() + session.pack(bootstrap.JOIN, b"one", (1, 2, 1))
            s.sendall(captured["bytes"])
            bootstrap.FRAMING.recv(s, "rank 0", time.monotonic() + 5)
    res = in_threads([lambda: store0.allgather(b"zero"), member])
    assert res[0] == [b"zero", b"one"]

    def replay():
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            bootstrap.FRAMING.recv(s, "rank 0", time.monotonic() + 5)
            s.sendall(captured["bytes"])
            return bootstrap.FRAMING.recv(s, "rank 0", time.monotonic() + 5)
    res = in_threads([lambda: store0.allgather(b"zero"), replay])
    store0.close()
    assert isinstance(res[0], pyrdma.RDMATimeoutError) and "failed authentication" in str(res[0])
    assert res[1][0] == bootstrap.ERROR


def test_client_bounds_what_rank0_sends():
    """A fake rank 0 announcing a table larger than any real one is refused from its header."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def fake_rank0():
        conn, _ = srv.accept()
        with conn:
            session = wire.Session(bootstrap.FRAMING, b"L")
            conn.sendall(session.greeting())
            conn.recv(4096)
            conn.sendall(bootstrap.FRAMING.header.pack(bootstrap.MAGIC, bootstrap.VERSION, bootstrap.TABLE,
                                                       0, 2, 1, bootstrap.MAX_PAYLOAD + 1000))
            time.sleep(1)
    t = threading.Thread(target=fake_rank0, daemon=True)
    t.start()
    with pytest.raises(pyrdma.WireFormatError, match="claiming"):
        TCPStore("127.0.0.1", port, 1, 2, timeout=5).allgather(b"x")
    t.join(5)
    srv.close()


# ---- strangers at accept() and at the perf server -------------------------------------------------

EP = Endpoint(qpn=0x11, psn=0x22, rkey=0x3344, addr=0x1000, length=4096)


@pytest.mark.parametrize("secret", [None, b"pair-secret"])
def test_accept_admits_the_member_and_drops_strangers(secret):
    listener = Listener("127.0.0.1", 0)
    port = listener.port
    got = {}

    def strangers_then_member():
        silent = socket.create_connection(("127.0.0.1", port), timeout=5)
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"\x16\x03\x01" + bytes(200))     # a TLS hello
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            try:
                dial_exchange(s, "x", Endpoint(qpn=9, psn=9), b"wrong" if secret else b"some", time.monotonic() + 5)
            except pyrdma.RDMAError as exc:
                got["wrong"] = exc
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            session, remote = dial_exchange(s, "listener", EP, secret, time.monotonic() + 10)
        silent.close()
        return remote

    def listen_side():
        sock, who, session, remote = accept_verified(listener, Endpoint(qpn=0x55, psn=1), secret,
                                                     time.monotonic() + 20)
        sock.close()
        return remote
    res = in_threads([listen_side, strangers_then_member])
    listener.close()
    assert res[0] == EP, res
    assert res[1] == Endpoint(qpn=0x55, psn=1), res
    assert isinstance(got["wrong"], pyrdma.RDMAError)


def test_accept_times_out_naming_the_strangers():
    with Listener("127.0.0.1", 0) as listener:
        socket.create_connection(("127.0.0.1", listener.port), timeout=5).sendall(b"junk" * 10)
        with pytest.raises(pyrdma.RDMATimeoutError, match="refused: .*not a pyrdma connect peer"):
            accept_verified(listener, EP, None, time.monotonic() + 1)


def _cfg(*argv):
    return cli.Config(cli.build_parser().parse_intermixed_args(list(argv)))


def test_perf_server_refuses_out_of_bounds_parameters_and_serves_on():
    cfg = _cfg("write_bw", "--bind", "127.0.0.1", "-p", str(free_port()), "--timeout", "20")
    side = cli.Side(cfg)
    port = cfg.args.port
    good = _cfg("write_bw", "-s", "4096", "-n", "100", "127.0.0.1").run_params()
    crafted = [dict(good, sizes=[1 << 40]), dict(good, sizes=[1] * 1000), dict(good, iters=10 ** 12),
               dict(good, num_qps=10 ** 6), dict(good, modes=["x"]), dict(good, post_list=-1),
               dict(good, duration=float("inf"), margin=0), dict(good, sizes="big"), {"test": "write_bw"},
               dict(good, bidir="yes")]
    refusals = []

    def clients():
        time.sleep(0.2)
        for params in crafted:
            with oob.dial("127.0.0.1", port, timeout=10) as ch:
                try:
                    ch.exchange_json(oob.HELLO, params)
                except oob.PeerFailed as exc:
                    refusals.append(str(exc))
        with oob.dial("127.0.0.1", port, timeout=10) as ch:
            return ch.exchange_json(oob.HELLO, good)
    def serve():     # what Side.open_channel does on the server
        ch = side._accept_client()
        ch.send_json(oob.HELLO, dict(cfg.run_params(), ok=True))
        return ch
    res = in_threads([serve, clients])
    assert not isinstance(res[0], BaseException) and not isinstance(res[1], BaseException), (res, refusals)
    res[0].close()
    assert res[1]["sizes"] == [4096] and res[1]["iters"] == 100
    assert cfg.sizes == [4096]
    assert len(refusals) == len(crafted)
    assert all("out of bounds" in r for r in refusals), refusals
    assert "size 1099511627776 is not within" in refusals[0]


def test_perf_check_params_accepts_what_the_client_sends():
    for argv in (["write_bw", "-a"], ["read_lat", "-D", "4"], ["atomic_bw", "-A", "CMP_AND_SWAP"],
                 ["send_bw", "-q", "8", "--mode", "loop"], ["write_bw", "-b", "--check"]):
        server = _cfg(*argv[:1])
        params = _cfg(*argv, "h").run_params()
        assert server.check_params(json.loads(json.dumps(params)))["sizes"] == params["sizes"]


def test_perf_server_with_a_secret_refuses_a_client_without():
    port = free_port()

    def server():
        return oob.listen(port, host="127.0.0.1", timeout=3, secret=b"k")

    def client():
        time.sleep(0.2)
        with oob.dial("127.0.0.1", port, timeout=5, secret=None) as ch:
            ch.send_json(oob.HELLO, {"test": "write_bw"})
    res = in_threads([server, client])
    assert isinstance(res[0], pyrdma.RDMATimeoutError) and "PYRDMA_JOB_SECRET" in str(res[0])
    assert isinstance(res[1], pyrdma.WireFormatError) and "PYRDMA_JOB_SECRET" in str(res[1])


def test_connect_frames_use_the_shared_framing():
    assert CONNECT.magic == b"PYRDMACN" and CONNECT.limit(1) == Endpoint(qpn=0, psn=0).to_bytes().__len__()
