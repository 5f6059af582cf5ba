"""The endpoint record two peers exchange out of band to connect QPs (and to learn a remote MR).

A fixed-size record with its own magic and version; it travels as the body of pyrdma.wire frames
(accept/connect, pyrdma-perf) or inside rendezvous records, whose framing bounds and tags it."""
import ipaddress
import struct
from dataclasses import dataclass

from pyrdma.errors import WireFormatError

MAGIC = b"PYRDMAEP"
VERSION = 1
# magic, version, qp_type, qpn, psn, lid, gid, port, gid_index, mtu, addr, rkey, length
_FORMAT = struct.Struct("!8sBBIIH16sBBBQIQ")
WIRE_SIZE = _FORMAT.size


@dataclass(frozen=True)
class Endpoint:
    """Everything a peer needs to reach one QP: address (lid/gid/port), qpn and psn, the path MTU
    enum, and optionally one memory region (addr, rkey, length) it may access remotely."""

    qpn: int
    psn: int
    lid: int = 0
    gid: bytes = bytes(16)
    port: int = 1
    gid_index: int = 0
    mtu: int = 3
    addr: int = 0
    rkey: int = 0
    length: int = 0
    qp_type: int = 2  # IBV_QPT_RC

    def __post_init__(self):
        if len(self.gid) != 16:
            raise WireFormatError(f"endpoint GID must be 16 bytes, got {len(self.gid)}")
        limits = {"qpn": 1 << 24, "psn": 1 << 24, "lid": 1 << 16, "port": 256, "gid_index": 256,
                  "mtu": 6, "addr": 1 << 64, "rkey": 1 << 32, "length": 1 << 64, "qp_type": 256}
        for name, limit in limits.items():
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 <= value < limit:
                raise WireFormatError(f"endpoint field {name}={value!r} outside 0..{limit - 1}")

    @property
    def gid_str(self):
        return ipaddress.IPv6Address(self.gid).exploded

    def to_bytes(self):
        return _FORMAT.pack(MAGIC, VERSION, self.qp_type, self.qpn, self.psn, self.lid, bytes(self.gid),
                            self.port, self.gid_index, self.mtu, self.addr, self.rkey, self.length)

    @classmethod
    def from_bytes(cls, data):
        if not isinstance(data, (bytes, bytearray, memoryview)):   # bytes(n) would allocate n bytes
            raise WireFormatError(f"an endpoint record is bytes, not {type(data).__name__}")
        data = bytes(data)
        if len(data) < len(MAGIC) + 1 or data[:len(MAGIC)] != MAGIC:
            raise WireFormatError(f"not a pyrdma endpoint record (got {data[:16]!r}...)")
        if data[len(MAGIC)] != VERSION:
            raise WireFormatError(f"endpoint record version {data[len(MAGIC)]} not supported "
                                  f"(this pyrdma speaks version {VERSION})")
        if len(data) != WIRE_SIZE:
            raise WireFormatError(f"endpoint record is {len(data)} bytes, expected {WIRE_SIZE}")
        (_, _, qp_type, qpn, psn, lid, gid, port, gid_index, mtu, addr, rkey,
         length) = _FORMAT.unpack(data)
        return cls(qpn=qpn, psn=psn, lid=lid, gid=gid, port=port, gid_index=gid_index, mtu=mtu,
                   addr=addr, rkey=rkey, length=length, qp_type=qp_type)

    def with_mr(self, mr):
        """A copy that also advertises ``mr`` (its addr, rkey, length) to the peer."""
        from dataclasses import replace
        return replace(self, addr=mr.addr, rkey=mr.rkey, length=mr.length)
