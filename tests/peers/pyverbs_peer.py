#!/usr/bin/python3
"""The foreign side of tests/test_interop_pyverbs.py: an RC QP driven by Debian's pyverbs (rdma-core).

Runs under the system interpreter (/usr/bin/python3), never under the project's Python: it imports only
the standard library and pyverbs -- no pyrdma, no numpy -- so that what meets pyrdma on the wire is
somebody else's verbs stack.

Out-of-band protocol (JSON, one object per line, UTF-8, every message carries "proto" and "version"):

  peer -> test  {"type": "hello", "endpoint": E}       E = qpn, psn, lid, gid (hex "xxxx:...:xxxx"),
                                                        gid_index, port, mtu (enum), addr, rkey, length
  test -> peer  {"type": "hello", "endpoint": E, "plan": P}
  peer -> test  {"type": "ready"}                       recvs posted, QP in RTS
  (the test posts its RDMA WRITE, SEND and SEND_WITH_IMM; the peer checks them byte for byte)
  peer -> test  {"type": "received", "ok": true, ...}   then the peer sends its own WRITE/SEND/SEND_WITH_IMM
  peer -> test  {"type": "result", "ok": true, ...}     all of the peer's sends completed successfully
  test -> peer  {"type": "done", "ok": bool, "message": str}
  either way    {"type": "error", "message": str}       the sender gives up

P = {"to_peer": D, "to_test": D, "peer_fill": int}, D = {"write": {"offset", "length", "seed"},
"send": {"recv_offset", "length", "seed"}, "send_imm": {"recv_offset", "length", "seed", "imm"}}:
offsets are into the receiver's advertised MR; imm is the 32-bit value in host order (as
ibv_wc.imm_data after ntohl); the bytes of each transfer are pattern(seed, length) below.

Exit status 0 only when every check passed and the test said done; otherwise a one-line
"pyverbs_peer: ERROR: ..." on stderr and exit status 1. Every socket operation and every CQ poll
has a deadline, and a faulthandler watchdog ends the process if it is stuck in C.
"""
import argparse
import faulthandler
import hashlib
import json
import socket
import sys
import time

PROTO = "pyrdma-interop"
VERSION = 1
MAX_LINE = 1 << 16
MR_LENGTH = 1 << 18


class PeerError(Exception):
    pass


def pattern(seed, length):
    """Deterministic position-dependent bytes: SHA-256 in counter mode over the seed string."""
    out = bytearray()
    key = str(seed).encode()
    counter = 0
    while len(out) < length:
        out += hashlib.sha256(key + counter.to_bytes(8, "little")).digest()
        counter += 1
    return bytes(out[:length])


def first_difference(got, want):
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return i, a, b
    return min(len(got), len(want)), None, None


class Channel:
    """JSON lines over a TCP socket, each read and write bounded by the socket timeout."""

    def __init__(self, sock):
        self.sock = sock
        self.rfile = sock.makefile("rb")

    def send(self, msg_type, **fields):
        msg = {"proto": PROTO, "version": VERSION, "type": msg_type}
        msg.update(fields)
        self.sock.sendall(json.dumps(msg, sort_keys=True).encode() + b"\n")

    def recv(self, expected_type):
        try:
            line = self.rfile.readline(MAX_LINE + 1)
        except socket.timeout:
            raise PeerError(f"timed out waiting for the test's {expected_type!r} message") from None
        if not line:
            raise PeerError(f"the test closed the connection before sending {expected_type!r}")
        if len(line) > MAX_LINE or not line.endswith(b"\n"):
            raise PeerError(f"oversized or truncated message while waiting for {expected_type!r}")
        try:
            msg = json.loads(line)
        except ValueError:
            raise PeerError(f"not JSON: {line[:80]!r}") from None
        if not isinstance(msg, dict) or msg.get("proto") != PROTO:
            raise PeerError(f"not a {PROTO} message: {line[:80]!r}")
        if msg.get("version") != VERSION:
            raise PeerError(f"protocol version {msg.get('version')!r} not supported (peer speaks {VERSION})")
        if msg.get("type") == "error":
            raise PeerError(f"the test gave up: {msg.get('message')}")
        if msg.get("type") != expected_type:
            raise PeerError(f"expected {expected_type!r}, got {msg.get('type')!r}")
        return msg

    def close(self):
        try:
            self.rfile.close()
        finally:
            self.sock.close()


def _int(obj, key, lo, hi):
    value = obj.get(key) if isinstance(obj, dict) else None
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise PeerError(f"bad field {key}={value!r} (want an int in {lo}..{hi})")
    return value


def parse_endpoint(ep):
    if not isinstance(ep, dict):
        raise PeerError(f"bad endpoint {ep!r}")
    gid = ep.get("gid")
    if not isinstance(gid, str) or len(bytes.fromhex(gid.replace(":", ""))) != 16:
        raise PeerError(f"bad GID {gid!r}")
    out = {"gid": gid}
    for key, hi in (("qpn", (1 << 24) - 1), ("psn", (1 << 24) - 1), ("lid", 0xFFFF), ("gid_index", 255),
                    ("port", 255), ("mtu", 5), ("addr", (1 << 64) - 1), ("rkey", (1 << 32) - 1),
                    ("length", (1 << 64) - 1)):
        out[key] = _int(ep, key, 0, hi)
    return out


def parse_direction(d, mr_length, name):
    """Validate one direction of the plan against the receiving MR's length; regions must not overlap."""
    if not isinstance(d, dict):
        raise PeerError(f"bad plan[{name}]")
    out = {}
    spans = []
    for op in ("write", "send", "send_imm"):
        spec = d.get(op)
        off_key = "offset" if op == "write" else "recv_offset"
        offset = _int(spec, off_key, 0, mr_length)
        length = _int(spec, "length", 1, mr_length - offset)
        seed = spec.get("seed")
        if not isinstance(seed, str) or not seed:
            raise PeerError(f"bad seed in plan[{name}][{op}]")
        out[op] = {"offset": offset, "length": length, "seed": seed}
        if op == "send_imm":
            out[op]["imm"] = _int(spec, "imm", 0, (1 << 32) - 1)
        spans.append((offset, offset + length, op))
    spans.sort()
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            raise PeerError(f"plan[{name}]: {a} and {b} overlap")
    return out


def choose_gid_index(ctx, port, port_attr, e):
    """Like pyrdma's best_gid_index, decided on our own: IB -> 0; RoCE -> RoCEv2 IPv4-mapped, RoCEv2, any."""
    if port_attr.link_layer != e.IBV_LINK_LAYER_ETHERNET:
        return 0
    ranked = []
    for index in range(port_attr.gid_tbl_len):
        try:
            gid = ctx.query_gid(port, index).gid
        except Exception:
            continue
        raw = bytes.fromhex(gid.replace(":", ""))
        if raw == bytes(16):
            continue
        try:
            v2 = ctx.query_gid_type(port, index) == e.IBV_GID_TYPE_SYSFS_ROCE_V2
        except Exception:
            v2 = False
        ipv4 = raw[:12] == bytes(10) + b"\xff\xff"
        ranked.append((not v2, not ipv4, index))
    if not ranked:
        raise PeerError(f"port {port} has no usable GID")
    return min(ranked)[2]


class Deadline:
    def __init__(self, seconds):
        self.end = time.monotonic() + seconds
        self.seconds = seconds

    def left(self):
        return self.end - time.monotonic()


def poll(cq, n, deadline, what, e):
    """Poll ``cq`` until ``n`` completions arrived or the deadline passed; every one must be SUCCESS."""
    wcs = []
    while len(wcs) < n:
        npolled, got = cq.poll(num_entries=n - len(wcs))
        if npolled > 0:
            for wc in got[:npolled]:
                if wc.status != e.IBV_WC_SUCCESS:
                    raise PeerError(f"{what}: completion wr_id={wc.wr_id} opcode={wc.opcode} failed with "
                                    f"status {wc.status} (vendor_err {wc.vendor_err})")
            wcs.extend(got[:npolled])
            continue
        if deadline.left() <= 0:
            raise PeerError(f"{what}: timed out after {deadline.seconds:.0f} s with {len(wcs)} of {n} "
                            f"completions")
        time.sleep(0.0005)
    return wcs


def run(args, state):
    import pyverbs.enums as e
    from pyverbs.addr import GID, AHAttr, GlobalRoute
    from pyverbs.cq import CQ
    from pyverbs.device import Context, get_device_list
    from pyverbs.mr import MR
    from pyverbs.pd import PD
    from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
    from pyverbs.wr import SGE, RecvWR, SendWR

    host, _, port_s = args.connect.rpartition(":")
    try:
        sock = socket.create_connection((host, int(port_s)), timeout=args.timeout)
    except OSError as exc:
        raise PeerError(f"cannot reach the test at {args.connect}: {exc}") from None
    sock.settimeout(args.timeout)
    chan = state["chan"] = Channel(sock)

    name = args.device
    if name is None:
        devices = get_device_list()
        if not devices:
            raise PeerError("no RDMA devices")
        name = devices[0].name.decode() if isinstance(devices[0].name, bytes) else devices[0].name
    ctx = state["ctx"] = Context(name=name)
    port = args.port
    port_attr = ctx.query_port(port)
    if port_attr.state != e.IBV_PORT_ACTIVE:
        raise PeerError(f"{name} port {port} is not ACTIVE (state {port_attr.state})")
    gid_index = args.gid_index if args.gid_index is not None else choose_gid_index(ctx, port, port_attr, e)
    my_gid = ctx.query_gid(port, gid_index)

    pd = PD(ctx)
    send_cq = CQ(ctx, 16)
    recv_cq = CQ(ctx, 16)
    remote_access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
    target = MR(pd, MR_LENGTH, remote_access)            # the region the test writes into / we receive into
    source = MR(pd, MR_LENGTH, e.IBV_ACCESS_LOCAL_WRITE)  # what we write/send back
    cap = QPCap(max_send_wr=8, max_recv_wr=8, max_send_sge=1, max_recv_sge=1)
    qp = QP(pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=send_cq, rcq=recv_cq, cap=cap, sq_sig_all=1))
    psn = int.from_bytes(hashlib.sha256(str(time.time_ns()).encode()).digest()[:3], "little")

    attr = QPAttr()
    attr.port_num = port
    attr.pkey_index = 0
    attr.qp_access_flags = remote_access
    qp.to_init(attr)

    chan.send("hello", implementation="pyverbs (rdma-core) on " + sys.version.split()[0], endpoint={
        "qpn": qp.qp_num, "psn": psn, "lid": port_attr.lid, "gid": my_gid.gid, "gid_index": gid_index,
        "port": port, "mtu": port_attr.active_mtu, "addr": target.buf, "rkey": target.rkey,
        "length": MR_LENGTH})

    msg = chan.recv("hello")
    remote = parse_endpoint(msg.get("endpoint"))
    plan = msg.get("plan")
    if not isinstance(plan, dict):
        raise PeerError("hello without a plan")
    to_peer = parse_direction(plan.get("to_peer"), MR_LENGTH, "to_peer")
    to_test = parse_direction(plan.get("to_test"), remote["length"], "to_test")
    fill = _int(plan, "peer_fill", 0, 255)

    # Our target MR starts as `fill` everywhere so stray bytes outside the planned regions show up.
    target.write(bytes([fill]) * MR_LENGTH, MR_LENGTH, 0)
    for wr_id, op in ((1, "send"), (2, "send_imm")):
        spec = to_peer[op]
        qp.post_recv(RecvWR(wr_id=wr_id, num_sge=1,
                            sg=[SGE(target.buf + spec["offset"], spec["length"], target.lkey)]))

    dgid = GID()
    dgid.gid = remote["gid"]
    attr.path_mtu = min(port_attr.active_mtu, remote["mtu"])
    attr.dest_qp_num = remote["qpn"]
    attr.rq_psn = remote["psn"]
    attr.max_dest_rd_atomic = 1
    attr.min_rnr_timer = 12
    attr.ah_attr = AHAttr(gr=GlobalRoute(dgid=dgid, sgid_index=gid_index, hop_limit=64), is_global=1,
                          dlid=remote["lid"], port_num=port)
    qp.to_rtr(attr)
    attr.sq_psn = psn
    attr.timeout = 14
    attr.retry_cnt = 7
    attr.rnr_retry = 7
    attr.max_rd_atomic = 1
    qp.to_rts(attr)
    chan.send("ready")

    # ---- the test's WRITE, SEND, SEND_WITH_IMM arrive; RC ordering means the WRITE landed before
    # the SENDs complete at us.
    wcs = poll(recv_cq, 2, Deadline(args.timeout), "receiving the test's SENDs", e)
    for wc, (wr_id, op) in zip(wcs, ((1, "send"), (2, "send_imm"))):
        spec = to_peer[op]
        if wc.wr_id != wr_id or wc.opcode != e.IBV_WC_RECV:
            raise PeerError(f"{op}: expected wr_id {wr_id} opcode RECV, got wr_id {wc.wr_id} opcode {wc.opcode}")
        if wc.byte_len != spec["length"]:
            raise PeerError(f"{op}: byte_len {wc.byte_len}, expected {spec['length']}")
        if wc.qp_num != qp.qp_num:
            raise PeerError(f"{op}: qp_num {wc.qp_num}, expected {qp.qp_num}")
        has_imm = bool(wc.wc_flags & e.IBV_WC_WITH_IMM)
        if has_imm != (op == "send_imm"):
            raise PeerError(f"{op}: IBV_WC_WITH_IMM flag is {has_imm}")
        if has_imm:
            imm = socket.ntohl(wc.imm_data)       # pyverbs hands back the raw big-endian field
            if imm != spec["imm"]:
                raise PeerError(f"{op}: imm_data {imm:#010x}, expected {spec['imm']:#010x} "
                                f"(raw wc.imm_data {wc.imm_data:#010x})")

    expected = bytearray([fill]) * MR_LENGTH
    for op in ("write", "send", "send_imm"):
        spec = to_peer[op]
        expected[spec["offset"]:spec["offset"] + spec["length"]] = pattern(spec["seed"], spec["length"])
    got = target.read(MR_LENGTH, 0)
    if got != expected:
        where, g, w = first_difference(got, expected)
        region = next((op for op, s in to_peer.items() if s["offset"] <= where < s["offset"] + s["length"]),
                      "outside every planned region (should still hold the fill byte)")
        raise PeerError(f"target MR differs at offset {where} ({region}): got {g}, expected {w}")
    chan.send("received", ok=True, bytes=sum(s["length"] for s in to_peer.values()),
              sha256=hashlib.sha256(got).hexdigest())

    # ---- our turn: WRITE, SEND, SEND_WITH_IMM into the test's MR.
    image = bytearray(MR_LENGTH)
    pos = 0
    wrs = []
    for wr_id, op in ((11, "write"), (12, "send"), (13, "send_imm")):
        spec = to_test[op]
        image[pos:pos + spec["length"]] = pattern(spec["seed"], spec["length"])
        sge = SGE(source.buf + pos, spec["length"], source.lkey)
        if op == "write":
            wr = SendWR(wr_id=wr_id, opcode=e.IBV_WR_RDMA_WRITE, num_sge=1, sg=[sge])
            wr.set_wr_rdma(remote["rkey"], remote["addr"] + spec["offset"])
        elif op == "send":
            wr = SendWR(wr_id=wr_id, opcode=e.IBV_WR_SEND, num_sge=1, sg=[sge])
        else:
            wr = SendWR(wr_id=wr_id, opcode=e.IBV_WR_SEND_WITH_IMM, num_sge=1, sg=[sge],
                        imm_data=socket.htonl(spec["imm"]))   # raw field, big-endian on the wire
        wrs.append(wr)
        pos += (spec["length"] + 63) & ~63
        if pos > MR_LENGTH:
            raise PeerError("plan[to_test] does not fit our source buffer")
    source.write(bytes(image), MR_LENGTH, 0)
    for wr in wrs:
        qp.post_send(wr)
    wcs = poll(send_cq, 3, Deadline(args.timeout), "our WRITE/SEND/SEND_WITH_IMM", e)
    want = [(11, e.IBV_WC_RDMA_WRITE), (12, e.IBV_WC_SEND), (13, e.IBV_WC_SEND)]
    if [(wc.wr_id, wc.opcode) for wc in wcs] != want:
        raise PeerError(f"send completions {[(wc.wr_id, wc.opcode) for wc in wcs]}, expected {want}")
    chan.send("result", ok=True, bytes=sum(s["length"] for s in to_test.values()))

    done = chan.recv("done")
    if done.get("ok") is not True:
        raise PeerError(f"the test reported a failure on its side: {done.get('message')}")
    state["summary"] = (f"pyverbs_peer: ok: qpn {qp.qp_num} on {name} port {port} gid[{gid_index}] "
                        f"<-> qpn {remote['qpn']}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--connect", required=True, help="HOST:PORT where the test listens")
    ap.add_argument("--device", default=None, help="RDMA device name (default: the first one)")
    ap.add_argument("--port", type=int, default=1)
    ap.add_argument("--gid-index", type=int, default=None, help="default: chosen like best_gid_index")
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds for each socket op and each poll")
    args = ap.parse_args(argv)
    # Last resort if we hang inside a C call: dump the stack and exit(1).
    faulthandler.dump_traceback_later(max(4 * args.timeout, 60), exit=True)
    state = {"chan": None, "ctx": None, "summary": None}
    status = 0
    try:
        run(args, state)
    except Exception as exc:
        status = 1
        message = str(exc) if isinstance(exc, PeerError) else f"{type(exc).__name__}: {exc}"
        print(f"pyverbs_peer: ERROR: {message}", file=sys.stderr, flush=True)
        if state["chan"] is not None:
            try:
                state["chan"].send("error", message=message)
            except OSError:
                pass
    finally:
        if state["chan"] is not None:
            state["chan"].close()
        if state["ctx"] is not None:
            try:
                state["ctx"].close()   # pyverbs closes the QP, MRs, CQs and PD hanging off it
            except Exception as exc:
                print(f"pyverbs_peer: ERROR: closing the device context: {exc}", file=sys.stderr)
                status = 1
        faulthandler.cancel_dump_traceback_later()
    if status == 0 and state["summary"]:
        print(state["summary"], flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
