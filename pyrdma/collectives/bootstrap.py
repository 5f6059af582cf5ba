"""Rendezvous: every rank learns every other rank's record (its endpoints) before connecting.

Three ways in, as launchers provide them:
- torchrun-style environment: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE (``from_env``);
- an mpi4py communicator (``MPIExchange``): an allgather;
- explicit ``host:port`` of rank 0 plus rank and size (``TCPStore``).

The TCP store runs on rank 0. Every message is framed with a magic, a version, the sender's rank
and world size, and a length, so a foreign or mismatched peer is rejected with a clear error.
Every wait has a timeout that names the ranks that never showed up.
"""
import os
import socket
import struct
import threading
import time

from pyrdma.errors import PeerError, RDMATimeoutError, UsageError, WireFormatError

MAGIC = b"PYRDMACB"
VERSION = 1
_HEADER = struct.Struct("!8sBiiQ")   # magic, version, rank, world size, payload length
MAX_PAYLOAD = 1 << 24


def parse_address(address):
    """'host:port' -> (host, port)."""
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit():
        raise UsageError(f"expected host:port, got {address!r}")
    return host.strip("[]"), int(port)


def env_config(environ=None):
    """(host, port, rank, size) from torchrun-style variables, with a clear error for each missing one."""
    environ = os.environ if environ is None else environ
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if v not in environ]
    if missing:
        raise UsageError(f"environment lacks {', '.join(missing)} (set by torchrun, or export them)")
    try:
        rank, size, port = int(environ["RANK"]), int(environ["WORLD_SIZE"]), int(environ["MASTER_PORT"])
    except ValueError as exc:
        raise UsageError(f"RANK, WORLD_SIZE and MASTER_PORT must be integers: {exc}") from None
    check_rank(rank, size)
    return environ["MASTER_ADDR"], port, rank, size


def check_rank(rank, size):
    if size < 1 or not 0 <= rank < size:
        raise UsageError(f"rank {rank} is not within a world of size {size}")


def _send_frame(sock, rank, size, payload):
    sock.sendall(_HEADER.pack(MAGIC, VERSION, rank, size, len(payload)) + payload)


def _recv_exact(sock, n, who):
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = sock.recv(n - len(buf))
        except socket.timeout:
            raise RDMATimeoutError(f"{who} sent nothing in time during rendezvous", call="recv") from None
        if not chunk:
            raise PeerError(f"{who} closed the connection during rendezvous", peer=who)
        buf += chunk
    return bytes(buf)


def _recv_frame(sock, size, who):
    magic, version, rank, their_size, length = _HEADER.unpack(_recv_exact(sock, _HEADER.size, who))
    if magic != MAGIC:
        raise WireFormatError(f"{who} is not a pyrdma rendezvous peer (got {magic!r})")
    if version != VERSION:
        raise WireFormatError(f"{who} speaks rendezvous version {version}, this pyrdma speaks {VERSION}")
    if their_size != size:
        raise UsageError(f"{who} (rank {rank}) believes the world has {their_size} ranks, this rank says {size}")
    if not 0 <= rank < size or length > MAX_PAYLOAD:
        raise WireFormatError(f"{who} sent a malformed rendezvous frame (rank {rank}, {length} bytes)")
    return rank, _recv_exact(sock, length, f"rank {rank}")


class TCPStore:
    """All-gather of one bytes record per rank through rank 0 at ``host:port``."""

    def __init__(self, host, port, rank, size, timeout=60.0):
        check_rank(rank, size)
        self.host, self.port, self.rank, self.size, self.timeout = host, port, rank, size, timeout
        self._listener = None
        if rank == 0 and size > 1:
            self._listener = socket.create_server(("", port), reuse_port=False)
            self._listener.settimeout(timeout)

    def allgather(self, record):
        """Every rank's ``record`` (bytes), indexed by rank."""
        if self.size == 1:
            return [bytes(record)]
        return self._serve(record) if self.rank == 0 else self._join(record)

    def _serve(self, record):
        records = {0: bytes(record)}
        conns = {}
        deadline = time.monotonic() + self.timeout
        try:
            while len(records) < self.size:
                self._listener.settimeout(max(0.01, deadline - time.monotonic()))
                try:
                    sock, addr = self._listener.accept()
                except socket.timeout:
                    missing = sorted(set(range(self.size)) - set(records))
                    raise RDMATimeoutError(f"rendezvous on port {self.port}: ranks {missing} did not join "
                                           f"within {self.timeout} s", call="rendezvous") from None
                sock.settimeout(max(0.01, deadline - time.monotonic()))
                rank, payload = _recv_frame(sock, self.size, f"{addr[0]}:{addr[1]}")
                if rank in records:
                    sock.close()
                    raise UsageError(f"two processes claim rank {rank}")
                records[rank] = payload
                conns[rank] = sock
            table = b"".join(struct.pack("!Q", len(records[r])) + records[r] for r in range(self.size))
            for rank, sock in conns.items():
                _send_frame(sock, 0, self.size, table)
            return [records[r] for r in range(self.size)]
        finally:
            for sock in conns.values():
                sock.close()

    def _join(self, record):
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                sock = socket.create_connection((self.host, self.port),
                                                timeout=max(0.01, deadline - time.monotonic()))
                break
            except OSError as exc:
                if time.monotonic() >= deadline:
                    raise RDMATimeoutError(f"rank 0 at {self.host}:{self.port} not reachable within "
                                           f"{self.timeout} s ({exc})", call="rendezvous") from None
                time.sleep(0.05)
        with sock:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            _send_frame(sock, self.rank, self.size, bytes(record))
            _, table = _recv_frame(sock, self.size, f"rank 0 at {self.host}:{self.port}")
        records, pos = [], 0
        for _ in range(self.size):
            (n,) = struct.unpack_from("!Q", table, pos)
            records.append(table[pos + 8:pos + 8 + n])
            pos += 8 + n
        if pos != len(table):
            raise WireFormatError("rendezvous table has trailing bytes")
        return records

    def close(self):
        if self._listener is not None:
            self._listener.close()
            self._listener = None


class MPIExchange:
    """All-gather of records through an mpi4py communicator."""

    def __init__(self, mpi_comm):
        self.comm = mpi_comm
        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()

    def allgather(self, record):
        return [bytes(r) for r in self.comm.allgather(bytes(record))]

    def close(self):
        pass
