"""Rendezvous: every rank learns every other rank's record (its endpoints) before connecting.

Four ways in, as launchers provide them:
- torchrun-style environment: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE (``env_config``,
  ``TCPStore.from_env``);
- an mpi4py communicator (``MPIExchange``): an allgather of the records;
- a c10d Store that torch hands a backend (``StoreExchange``): a key per rank and round;
- explicit ``host:port`` of rank 0 plus rank and size (``TCPStore(host, port, rank, size)``).

The TCP store is a small server on rank 0. ``allgather(record)`` sends this rank's record to it
and returns everyone's, in rank order; ``barrier()`` is an allgather of nothing. Frames are
pyrdma.wire frames (magic, version, kind, the sender's rank and world size, the round number, a
bounded length, an HMAC tag when the job has a secret), so a foreign, mismatched or unauthenticated
peer is refused. Rank 0 serves joins concurrently and drops strangers without failing the job.
Every wait has a timeout; rank 0 names the ranks that never joined (and the connections it
refused) and tells the ranks that did why the rendezvous failed.
"""
import ipaddress
import os
import socket
import struct
import time

from pyrdma.errors import PeerError, RDMATimeoutError, UsageError, WireFormatError
from pyrdma.wire import Doorman, Framing, Session, job_secret, listen, send_all

MAGIC = b"PYRDMARV"
VERSION = 2
JOIN, TABLE, ERROR = 1, 2, 3
MAX_PAYLOAD = 1 << 26
MAX_ERROR = 4096
# header fields after magic, version, kind: rank, world size, round
FRAMING = Framing("pyrdma rendezvous", MAGIC, VERSION, {JOIN: "JOIN", TABLE: "TABLE", ERROR: "ERROR"}, fields="iiI",
                  limits={JOIN: MAX_PAYLOAD, TABLE: 2 * MAX_PAYLOAD, ERROR: MAX_ERROR})
# Clients wait this much longer than rank 0, so that rank 0's explanation (who is missing) wins.
CLIENT_GRACE = 2.0
# Connections that have not finished their join yet; past this the oldest is dropped (a flood of
# silent connections cannot keep a member out).
MAX_PENDING = 64


def parse_address(address):
    """'host:port' (or '[v6]:port') -> (host, port)."""
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise UsageError(f"expected host:port, got {address!r}")
    return host.strip("[]"), int(port)


def check_rank(rank, size):
    if not isinstance(rank, int) or not isinstance(size, int) or size < 1 or not 0 <= rank < size:
        raise UsageError(f"rank {rank!r} is not within a world of size {size!r}")


def env_config(environ=None):
    """(host, port, rank, size) from torchrun-style variables, with a clear error for each missing one."""
    environ = os.environ if environ is None else environ
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if not environ.get(v)]
    if missing:
        raise UsageError(f"the environment lacks {', '.join(missing)} (torchrun sets them; or export "
                         f"MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE yourself)")
    try:
        rank, size, port = int(environ["RANK"]), int(environ["WORLD_SIZE"]), int(environ["MASTER_PORT"])
    except ValueError as exc:
        raise UsageError(f"RANK, WORLD_SIZE and MASTER_PORT must be integers: {exc}") from None
    check_rank(rank, size)
    if not 0 <= port < 65536:
        raise UsageError(f"MASTER_PORT {port} is not a TCP port")
    return environ["MASTER_ADDR"], port, rank, size


def _encode_table(records):
    return b"".join(struct.pack("!Q", len(r)) + r for r in records)


def _decode_table(table, size):
    """``size`` records from a table; no length in it is trusted beyond the table's own bytes."""
    records, pos = [], 0
    try:
        for _ in range(size):
            (n,) = struct.unpack_from("!Q", table, pos)
            if pos + 8 + n > len(table):
                raise struct.error("short")
            records.append(bytes(table[pos + 8:pos + 8 + n]))
            pos += 8 + n
    except struct.error:
        raise WireFormatError("the rendezvous table from rank 0 is truncated") from None
    if pos != len(table):
        raise WireFormatError("the rendezvous table from rank 0 has trailing bytes")
    return records


class TCPStore:
    """All-gather of one bytes record per rank through a server on rank 0 at ``host:port``.

    Rank 0 listens on ``port`` (0: any free port, see ``.port``) at the address ``host`` names
    (``bind`` overrides it; "0.0.0.0" means every interface), so a loopback MASTER_ADDR keeps the
    rendezvous on loopback. It serves joins concurrently (pyrdma.wire.Doorman), gives each
    connection ``wire.HANDSHAKE_TIMEOUT`` seconds to join, drops (and logs) connections that are malformed,
    foreign, unauthenticated or claim a rank already taken, and goes on.

    ``secret`` (default ``$PYRDMA_JOB_SECRET``): every rank must have the same; joins and tables
    then carry an HMAC-SHA256 over the connection's nonces, so only members join and replays fail.
    Without one, any process that reaches the port first with a rank's number takes that rank.

    ``advertise_host`` is the address other ranks can reach this one at (the local end of its
    connection to rank 0)."""

    def __init__(self, host, port, rank, size, timeout=60.0, secret=None, bind=None):
        check_rank(rank, size)
        self.host, self.port, self.rank, self.size, self.timeout = host, int(port), rank, size, timeout
        self.secret = job_secret(secret)
        self.round = 0
        self._listener = None
        self.advertise_host = None
        self.refused = []        # rank 0: why strangers were dropped in the current round
        self.present = ()        # rank 0: the ranks that joined the current round so far
        if rank == 0:
            if size > 1:
                self._listener = listen(host if bind is None else bind, self.port)
                self.port = self._listener.getsockname()[1]
            self.advertise_host = _loopback_or(host)

    @classmethod
    def from_env(cls, environ=None, timeout=60.0, secret=None):
        host, port, rank, size = env_config(environ)
        if secret is None and environ is not None:
            secret = job_secret(environ=environ)
        return cls(host, port, rank, size, timeout, secret)

    def allgather(self, record):
        """Every rank's ``record`` (bytes), in rank order."""
        record = bytes(record)
        if len(record) > MAX_PAYLOAD // max(1, self.size):
            raise UsageError(f"a rendezvous record of {len(record)} bytes is too large")
        self.round += 1
        if self.size == 1:
            return [record]
        return self._serve(record) if self.rank == 0 else self._join(record)

    def barrier(self):
        """Return once every rank has called barrier() (a setup-time barrier over TCP)."""
        self.allgather(b"")

    # ---- rank 0 ---------------------------------------------------------------------------------

    def _check_join(self, kind, rank, size, rnd, body):
        """Why a verified first frame is not a join of this round (None when it is one)."""
        if kind != JOIN:
            return f"sent a {FRAMING.kinds[kind]} frame where a JOIN belongs"
        if size != self.size:
            return f"claims rank {rank} of a world of {size} ranks; rank 0 was told {self.size}"
        if not 0 < rank < size:
            return f"claims rank {rank}, not within 1..{self.size - 1}"
        if rnd != self.round:
            return f"joins rendezvous round {rnd}; rank 0 is in round {self.round}"
        return None

    def _serve(self, record):
        records = {0: record}
        joined = {}            # rank -> Admitted (its session tags the table)
        self.present = records.keys()
        deadline = time.monotonic() + self.timeout
        door = Doorman(self._listener, FRAMING, self.secret, ERROR, limit=MAX_PAYLOAD // self.size,
                       max_pending=MAX_PENDING + self.size, fields=(0, self.size, self.round))
        self.refused = door.refused
        try:
            while len(records) < self.size:
                event = door.next(deadline)
                if event is None:
                    missing = sorted(set(range(self.size)) - set(records))
                    also = f"; refused: {'; '.join(door.refused)}" if door.refused else ""
                    raise RDMATimeoutError(f"rendezvous on port {self.port} (round {self.round}): "
                                           f"ranks {missing} did not join within {self.timeout} s{also}",
                                           call="rendezvous")
                if event[0] == "gone":   # a member that joined sends nothing more: it left
                    conn = event[1]
                    rank = next(r for r, c in joined.items() if c is conn)
                    del joined[rank], records[rank]
                    door.refuse(conn, f"rank {rank} closed or spoke out of turn after joining; its rank "
                                      f"is open again", tell=False)
                    continue
                _, conn, kind, (rank, size, rnd), body = event
                why = self._check_join(kind, rank, size, rnd, body)
                if why is None and rank in records:
                    why = f"claims rank {rank}, which another connection already holds"
                if why is not None:
                    door.refuse(conn, why)
                    if self.secret and size != self.size:
                        # an authenticated member that disagrees: a misconfigured job, fail fast
                        raise UsageError(f"rank {rank} (at {conn.who}) believes the world has {size} ranks; "
                                         f"rank 0 was told {self.size}")
                    continue
                records[rank] = body
                joined[rank] = conn
                door.watch(conn)
            table = _encode_table([records[r] for r in range(self.size)])
            for rank, conn in joined.items():
                door.release(conn, 1.0)
                send_all(conn.sock, conn.session.pack(TABLE, table, (0, self.size, self.round)), conn.who,
                         max(time.monotonic() + 1.0, deadline))
            return [records[r] for r in range(self.size)]
        except BaseException as exc:
            message = str(exc).encode()[:MAX_ERROR]
            for conn in joined.values():   # tell the ranks that did come why it failed
                try:
                    conn.sock.settimeout(1.0)
                    conn.sock.sendall(FRAMING.pack(ERROR, message, (0, self.size, self.round)))
                except OSError:
                    pass
            raise
        finally:
            for conn in joined.values():
                conn.sock.close()
            door.close()

    # ---- ranks 1 .. size-1 ------------------------------------------------------------------------

    def _join(self, record):
        deadline = time.monotonic() + self.timeout + CLIENT_GRACE
        where = f"rank 0 at {self.host}:{self.port}"
        while True:
            try:
                sock = socket.create_connection((self.host, self.port),
                                                timeout=max(0.05, min(2.0, deadline - time.monotonic())))
                break
            except OSError as exc:
                if time.monotonic() >= deadline:
                    raise PeerError(f"rank {self.rank}: {where} was not reachable within {self.timeout} s "
                                    f"({exc})", peer=0) from None
                time.sleep(0.05)
        with sock:
            self.advertise_host = sock.getsockname()[0]
            session = Session(FRAMING, b"D", self.secret)
            try:
                kind, _, body, _, _ = FRAMING.recv(sock, where, deadline)
                if kind != ERROR:
                    session.take_greeting(kind, body, where)
                    send_all(sock, session.greeting() + session.pack(JOIN, record, (self.rank, self.size, self.round)),
                             where, deadline)
                    kind, (_, size, rnd), body, tag, head = FRAMING.recv(
                        sock, where, deadline, limit=MAX_PAYLOAD + 8 * self.size)
            except RDMATimeoutError:
                raise PeerError(f"rank {self.rank}: {where} did not answer within {self.timeout} s "
                                f"(rank 0 stalled?)", peer=0) from None
            except PeerError as exc:
                raise PeerError(f"rank {self.rank}: the connection to {where} failed: {exc}", peer=0) from None
        if kind == ERROR:
            raise PeerError(f"the rendezvous failed: {body.decode(errors='replace')}", peer=0)
        session.verify(head, body, tag, where)
        if kind != TABLE or size != self.size or rnd != self.round:
            raise WireFormatError(f"{where} answered with frame kind {kind}, size {size}, round {rnd}; "
                                  f"expected the table of round {self.round} for {self.size} ranks")
        return _decode_table(body, self.size)

    def close(self):
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _loopback_or(host):
    if host in ("", "0.0.0.0", "::", "localhost"):
        return "127.0.0.1"
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


class StoreExchange:
    """The Communicator's rendezvous (``allgather(bytes) -> [bytes]``) through a c10d Store: each
    round, every rank sets its key and waits for the others' until ``timeout``."""

    def __init__(self, store, rank, size, timeout, environ=None):
        self.store, self.rank, self.size = store, rank, size
        self.timeout = timeout
        self.advertise_host = advertise_host(os.environ if environ is None else environ)
        self._round = 0

    def _key(self, rnd, rank):
        return f"pyrdma/{rnd}/{rank}"

    def allgather(self, record):
        rnd = self._round
        self._round += 1
        self.store.set(self._key(rnd, self.rank), bytes(record))
        keys = [self._key(rnd, r) for r in range(self.size)]
        try:
            self.store.wait(keys, self.timeout)
        except RuntimeError as exc:     # torch's DistStoreError (a timeout) or a lost store
            missing = [r for r, k in enumerate(keys) if not self._has(k)]
            raise RDMATimeoutError(f"rank {self.rank}: ranks {missing} did not join the pyrdma rendezvous within "
                                   f"{self.timeout.total_seconds():g} s ({exc})", call="init_process_group") from None
        return [bytes(self.store.get(k)) for k in keys]

    def _has(self, key):
        try:
            return self.store.check([key])
        except RuntimeError:
            return False

    def barrier(self):
        self.allgather(b"")

    def close(self):
        pass


def advertise_host(environ):
    """Where this rank's TCP transport listens: PYRDMA_TCP_HOST, else the local address that routes
    to MASTER_ADDR (loopback when MASTER_ADDR is loopback or unset)."""
    if environ.get("PYRDMA_TCP_HOST"):
        return environ["PYRDMA_TCP_HOST"]
    master = environ.get("MASTER_ADDR")
    if not master:
        return "127.0.0.1"
    try:
        ip = socket.getaddrinfo(master, None, socket.AF_INET)[0][4][0]
        if ipaddress.ip_address(ip).is_loopback:
            return "127.0.0.1"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((ip, 9))           # no packet is sent: this only asks the routing table
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


class MPIExchange:
    """All-gather of records through an mpi4py communicator (``comm.allgather``).

    MPI's own allgather has no timeout; when the communicator offers non-blocking ``Iallgather``
    (mpi4py >= 3 with numpy), each phase is polled against ``timeout``."""

    def __init__(self, mpi_comm, timeout=60.0):
        self.comm = mpi_comm
        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        self.timeout = timeout
        self.advertise_host = None
        try:
            self.advertise_host = socket.gethostbyname(socket.gethostname())
        except OSError:
            pass
        if self.advertise_host and self.advertise_host.startswith("127.") and self.size > 1:
            self.advertise_host = None   # let the transport fall back to what it knows

    def allgather(self, record):
        record = bytes(record)
        if len(record) > MAX_PAYLOAD // max(1, self.size):
            raise UsageError(f"a rendezvous record of {len(record)} bytes is too large")
        if hasattr(self.comm, "Iallgather") and hasattr(self.comm, "Iallgatherv"):
            return self._allgather_polled(record)
        records = self.comm.allgather(record)
        if not isinstance(records, list) or len(records) != self.size or \
                not all(isinstance(r, (bytes, bytearray)) for r in records):
            raise WireFormatError(f"MPI allgather returned {type(records).__name__}, not {self.size} byte records")
        return [bytes(r) for r in records]

    def _wait(self, request, what):
        deadline = time.monotonic() + self.timeout
        while not request.Test():
            if time.monotonic() > deadline:
                raise RDMATimeoutError(f"MPI {what} did not finish within {self.timeout} s "
                                       f"(a rank did not reach the rendezvous)", call="rendezvous")
            time.sleep(0.001)

    def _allgather_polled(self, record):
        import numpy as np
        lengths = np.zeros(self.size, np.int64)
        self._wait(self.comm.Iallgather(np.array([len(record)], np.int64), lengths), "allgather of lengths")
        # the lengths come from the other ranks: bound them before allocating their sum
        if (lengths < 0).any() or (lengths > MAX_PAYLOAD // self.size).any():
            raise WireFormatError(f"a rank announced a rendezvous record of {int(lengths.max())} bytes "
                                  f"(or a negative length); at most {MAX_PAYLOAD // self.size}")
        data = np.empty(int(lengths.sum()), np.uint8)
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        self._wait(self.comm.Iallgatherv(np.frombuffer(record, np.uint8),
                                         [data, lengths.tolist(), offsets.tolist(), _mpi_byte()]),
                   "allgather of records")
        return [data[o:o + n].tobytes() for o, n in zip(offsets.tolist(), lengths.tolist())]

    def barrier(self):
        self.allgather(b"")

    def close(self):
        pass


def _mpi_byte():
    from mpi4py import MPI
    return MPI.BYTE
