"""Rendezvous: every rank learns every other rank's record (its endpoints) before connecting.

Three ways in, as launchers provide them:
- torchrun-style environment: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE (``env_config``,
  ``TCPStore.from_env``);
- an mpi4py communicator (``MPIExchange``): an allgather of the records;
- explicit ``host:port`` of rank 0 plus rank and size (``TCPStore(host, port, rank, size)``).

The TCP store is a small server on rank 0. ``allgather(record)`` sends this rank's record to it
and returns everyone's, in rank order; ``barrier()`` is an allgather of nothing. Every frame has a
magic, a version, its kind, the sender's rank and world size, the round number and the payload
length, so a foreign or mismatched peer is rejected with WireFormatError (or UsageError for a
disagreement about the world size). Every wait has a timeout; rank 0 names the ranks that never
joined and tells the ranks that did why the rendezvous failed.
"""
import os
import socket
import struct
import time

from pyrdma.errors import PeerError, RDMATimeoutError, UsageError, WireFormatError

MAGIC = b"PYRDMARV"
VERSION = 1
# magic, version, kind, rank, world size, round, payload length
_HEADER = struct.Struct("!8sBBxxiiIQ")
JOIN, TABLE, ERROR = 1, 2, 3
MAX_PAYLOAD = 1 << 26
# Clients wait this much longer than rank 0, so that rank 0's explanation (who is missing) wins.
CLIENT_GRACE = 2.0


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
    return environ["MASTER_ADDR"], port, rank, size


def _pack(kind, rank, size, rnd, payload=b""):
    return _HEADER.pack(MAGIC, VERSION, kind, rank, size, rnd, len(payload)) + payload


def _recv_exact(sock, n, who, deadline):
    buf = bytearray()
    while len(buf) < n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise socket.timeout()
        sock.settimeout(remaining)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise PeerError(f"{who} closed the connection during the rendezvous", peer=who)
        buf += chunk
    return bytes(buf)


def _recv_frame(sock, who, deadline):
    """(kind, rank, size, round, payload) of one frame; WireFormatError for anything foreign."""
    header = _recv_exact(sock, _HEADER.size, who, deadline)
    magic, version, kind, rank, size, rnd, length = _HEADER.unpack(header)
    if magic != MAGIC:
        raise WireFormatError(f"{who} is not a pyrdma rendezvous peer (it sent {header[:8]!r})")
    if version != VERSION:
        raise WireFormatError(f"{who} speaks rendezvous version {version}, this pyrdma speaks {VERSION}")
    if kind not in (JOIN, TABLE, ERROR) or length > MAX_PAYLOAD or size < 1 or not 0 <= rank < size:
        raise WireFormatError(f"{who} sent a malformed rendezvous frame (kind {kind}, rank {rank}, "
                              f"size {size}, {length} bytes)")
    return kind, rank, size, rnd, _recv_exact(sock, length, who, deadline)


def _encode_table(records):
    return b"".join(struct.pack("!Q", len(r)) + r for r in records)


def _decode_table(table, size):
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

    Rank 0 listens on ``port`` (0: any free port, see ``.port``). ``advertise_host`` is the address
    other ranks can reach this one at (the local end of its connection to rank 0)."""

    def __init__(self, host, port, rank, size, timeout=60.0):
        check_rank(rank, size)
        self.host, self.port, self.rank, self.size, self.timeout = host, int(port), rank, size, timeout
        self.round = 0
        self._listener = None
        self.advertise_host = None
        if rank == 0:
            if size > 1:
                try:
                    self._listener = socket.create_server(("", self.port))
                except OSError as exc:
                    raise UsageError(f"rank 0 cannot listen on port {self.port} for the rendezvous: {exc}") from None
                self.port = self._listener.getsockname()[1]
            self.advertise_host = _loopback_or(host)

    @classmethod
    def from_env(cls, environ=None, timeout=60.0):
        host, port, rank, size = env_config(environ)
        return cls(host, port, rank, size, timeout)

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

    def _serve(self, record):
        records = {0: record}
        conns = {}
        deadline = time.monotonic() + self.timeout
        try:
            while len(records) < self.size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(set(range(self.size)) - set(records))
                    raise RDMATimeoutError(f"rendezvous on port {self.port} (round {self.round}): "
                                           f"ranks {missing} did not join within {self.timeout} s",
                                           call="rendezvous")
                self._listener.settimeout(remaining)
                try:
                    sock, addr = self._listener.accept()
                except socket.timeout:
                    continue
                who = f"{addr[0]}:{addr[1]}"
                try:
                    kind, rank, size, rnd, payload = _recv_frame(sock, who, deadline)
                except socket.timeout:
                    sock.close()
                    continue
                except BaseException:
                    sock.close()
                    raise
                if size != self.size:
                    sock.close()
                    raise UsageError(f"rank {rank} (at {who}) believes the world has {size} ranks; "
                                     f"rank 0 was told {self.size}")
                if kind != JOIN or rnd != self.round:
                    sock.close()
                    raise WireFormatError(f"rank {rank} (at {who}) sent a frame of kind {kind} for "
                                          f"rendezvous round {rnd}; rank 0 is in round {self.round}")
                if rank in records:
                    sock.close()
                    raise UsageError(f"two processes claim rank {rank} (the second from {who})")
                records[rank] = payload
                conns[rank] = sock
            table = _encode_table([records[r] for r in range(self.size)])
            for rank, sock in conns.items():
                sock.settimeout(max(1.0, deadline - time.monotonic()))
                sock.sendall(_pack(TABLE, 0, self.size, self.round, table))
            return [records[r] for r in range(self.size)]
        except BaseException as exc:
            message = str(exc).encode()[:4096]
            for sock in conns.values():   # tell the ranks that did come why it failed
                try:
                    sock.settimeout(1.0)
                    sock.sendall(_pack(ERROR, 0, self.size, self.round, message))
                except OSError:
                    pass
            raise
        finally:
            for sock in conns.values():
                sock.close()

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
            try:
                sock.settimeout(max(0.05, deadline - time.monotonic()))
                sock.sendall(_pack(JOIN, self.rank, self.size, self.round, record))
                kind, _, size, rnd, payload = _recv_frame(sock, where, deadline)
            except socket.timeout:
                raise PeerError(f"rank {self.rank}: {where} did not answer within {self.timeout} s "
                                f"(rank 0 stalled?)", peer=0) from None
            except (ConnectionError, OSError) as exc:
                raise PeerError(f"rank {self.rank}: the connection to {where} failed: {exc}", peer=0) from None
        if kind == ERROR:
            raise PeerError(f"the rendezvous failed: {payload.decode(errors='replace')}", peer=0)
        if kind != TABLE or size != self.size or rnd != self.round:
            raise WireFormatError(f"{where} answered with frame kind {kind}, size {size}, round {rnd}; "
                                  f"expected the table of round {self.round} for {self.size} ranks")
        return _decode_table(payload, self.size)

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
        if hasattr(self.comm, "Iallgather") and hasattr(self.comm, "Iallgatherv"):
            return self._allgather_polled(record)
        return [bytes(r) for r in self.comm.allgather(record)]

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
