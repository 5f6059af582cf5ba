"""``pyrdma-perf -R``: perftest's rdma_cm mode (``ib_write_bw -R``, ``ib_send_lat -R``, ...).

    ib_write_bw -R -d rxecm0 -s 65536                               # perftest server on 198.19.0.1
    pyrdma-perf write_bw -R -s 65536 198.19.0.1                     # our client

    pyrdma-perf read_bw -R --bind 198.19.0.1                        # our server
    ib_read_bw -R 198.19.0.1                                        # perftest client

With -R (Debian perftest 4.5, src/perftest_communication.c) nothing travels over TCP. Both the
exchange and the test QPs are rdma_cm connections to the same port (default 18515):

1. The "comm" connection: an RC QP made on the client's CM id after route resolution, one receive
   of a pingpong_dest's size posted before connect/accept. Every message of perftest's exchange
   (version, cycle buffer, cache line, MTU, keys, reports) is then one SEND, the client sending
   first; each side re-posts its receive as soon as a message is taken, so a message is never sent
   before the peer has a receive for it (and the QP's RNR retry covers the race anyway).
2. A handshake, then one rdma_cm connection per test QP (the client resolves, creates the QP on the
   id and connects; the server accepts requests on the same port), and another handshake. The
   client retries a connect the server was not yet listening for, as perftest does (its server
   only listens after the handshake).
3. The keys: a ``struct pingpong_dest`` in binary, fields in network order (not the text record of
   the TCP exchange), swapped in the order of the test's script (pyrdma.perf.compat.SCRIPTS: e.g.
   write_bw per QP, per QP again, once more; send_lat per QP, once, per QP again); the rest of the
   conversation (send tests' barrier before each size, the BW reports, the last handshake) is as
   over TCP, without the final "done".

Every test of pyrdma-perf (the send tests, the latency tests, atomic), against perftest's ib_<test>
-R either way round; two pyrdma-perf sides speak the same exchange, so ``-R`` works between them too.
"""
from __future__ import annotations

import os
import random
import struct
import time

from pyrdma.errors import PeerError, RDMAError, RDMATimeoutError, UsageError, WireFormatError
from pyrdma.perf.compat import SCRIPTS, PerftestSide
from pyrdma.perf.perftest_wire import Conversation, Dest

# struct pingpong_dest: lid, out_reads, qpn, psn, rkey, (4 bytes of padding), vaddr, gid, srqn,
# gid_index: 56 bytes, each field in network order (perftest's HAVE_ENDIAN conversion)
DEST = struct.Struct("!iiiiI4xQ16sIi")
# the receive buffer perftest posts is one pingpong_dest; no message of the exchange is larger
MSG_MAX = DEST.size
_RECV_OFF, _SEND_OFF, _BUF = 0, 128, 256
CONNECT_RETRY_S = 0.1          # perftest's client retries a refused connect every 100 ms


def encode_dest_binary(dest, gid_index=0):
    return DEST.pack(dest.lid, dest.out_reads, dest.qpn, dest.psn, dest.rkey, dest.vaddr, dest.gid,
                     dest.srqn, gid_index)


def decode_dest_binary(raw):
    if len(raw) != DEST.size:
        raise WireFormatError(f"perftest rdma_cm key record is {len(raw)} bytes, expected {DEST.size}")
    lid, out_reads, qpn, psn, rkey, vaddr, gid, srqn, _ = DEST.unpack(raw)
    for name, value, limit in (("lid", lid, 1 << 16), ("out_reads", out_reads, 1 << 16),
                               ("qpn", qpn, 1 << 24), ("psn", psn, 1 << 24)):
        if not 0 <= value < limit:
            raise WireFormatError(f"perftest rdma_cm key record: {name} {value} is out of range")
    return Dest(lid=lid, out_reads=out_reads, qpn=qpn, psn=psn, rkey=rkey, vaddr=vaddr, gid=gid, srqn=srqn)


class CMConversation(Conversation):
    """perftest's exchange over its rdma_cm "comm" QP (ctx_xchg_data_rdma): same-size messages, one
    SEND each, the client first. Made on a CM id whose route is resolved (client) or that came from
    a listener's request (server); ``connect()`` / ``accept()`` then establish it."""

    def __init__(self, cm_id, peer, client, timeout=60.0):
        import numpy as np
        import pyrdma as rd
        self.cm_id = cm_id
        self.peer = peer
        self.client = client
        self.timeout = timeout
        self.peer_version = None
        self.objs = []
        ctx = cm_id.context
        self.pd = self._keep(rd.ProtectionDomain(ctx))
        self.scq = self._keep(rd.CompletionQueue(ctx, 16))
        self.rcq = self._keep(rd.CompletionQueue(ctx, 16))
        self.buf = np.zeros(_BUF, np.uint8)
        self.mr = self._keep(rd.MemoryRegion(self.pd, self.buf, rd.ACCESS_LOCAL_WRITE))
        self.qp = self._keep(cm_id.create_qp(self.pd, self.scq, self.rcq, max_send_wr=4, max_recv_wr=4))
        self.wcs = np.empty(4, rd.WC_DTYPE)
        self.qp.post_recv_buf(self.mr, _RECV_OFF, _SEND_OFF - _RECV_OFF, wr_id=1)

    def _keep(self, obj):
        self.objs.append(obj)
        return obj

    def set_timeout(self, seconds):
        self.timeout = seconds

    def close(self):
        for obj in reversed(self.objs):
            try:
                obj.close()
            except Exception:
                pass
        self.objs = []

    def _send(self, data):
        if len(data) > MSG_MAX:
            raise UsageError(f"a message of perftest's rdma_cm exchange is at most {MSG_MAX} bytes")
        self.buf[_SEND_OFF:_SEND_OFF + len(data)] = memoryview(bytes(data))
        self.qp.post_send_buf(self.mr, _SEND_OFF, len(data), wr_id=2)
        try:
            self.scq.poll_wait(self.wcs, timeout=self.timeout, check=True)
        except RDMATimeoutError:
            raise PeerError(f"no send completion from {self.peer} within {self.timeout:g} s",
                            peer=self.peer) from None
        except RDMAError as exc:
            raise PeerError(f"cannot send to {self.peer}: {exc}", peer=self.peer) from None

    def _recv_exact(self, n):
        try:
            self.rcq.poll_wait(self.wcs, timeout=self.timeout, check=True)
        except RDMATimeoutError:
            raise PeerError(f"nothing from {self.peer} within {self.timeout:g} s during perftest's "
                            "rdma_cm exchange (perftest prints why it left)", peer=self.peer) from None
        except RDMAError as exc:
            raise PeerError(f"the rdma_cm exchange with {self.peer} failed: {exc}", peer=self.peer) from None
        got = int(self.wcs[0]["byte_len"])
        data = bytes(self.buf[_RECV_OFF:_RECV_OFF + got])
        # re-posted before we answer, so the peer's next message always finds a receive
        self.qp.post_recv_buf(self.mr, _RECV_OFF, _SEND_OFF - _RECV_OFF, wr_id=1)
        if got != n:
            raise WireFormatError(f"{self.peer} sent a {got}-byte message where perftest's exchange "
                                  f"has {n} bytes (do both sides run the same test?)")
        return data

    def keys(self, mine, with_gid=True):
        return decode_dest_binary(self.exchange(encode_dest_binary(mine)))

    def finish(self, mine, with_gid=True):
        """ctx_close_connection: the last handshake; no "done" over rdma_cm."""
        self.keys(mine)


class RdmaCmSide(PerftestSide):
    """A PerftestSide whose exchange and QPs are rdma_cm connections, as perftest's -R."""

    wire_name = "perftest's exchange over an rdma_cm QP"
    exchange_name = "rdma_cm"
    option = "-R"
    tests = tuple(SCRIPTS)
    tests_why = "perftest's RC tests"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.listener = None      # server: the listening id (the comm and the test QPs' requests)
        self.comm_id = None
        self.test_ids = []
        self.with_gid = True

    # -- the comm connection ---------------------------------------------------------------------
    def open_channel(self):
        cfg = self.cfg
        if cfg.is_server:
            self._serve_comm()
        else:
            self._dial_comm()
        self.conv.versions()
        self.cycle_buffer, _ = self.conv.sys_data(os.sysconf("SC_PAGESIZE"))

    def _dial_comm(self):
        cfg = self.cfg
        peer = f"{cfg.host}:{cfg.args.port}"
        self.comm_id, self.conv = self._connect(lambda cm_id: CMConversation(cm_id, peer, True, cfg.args.timeout),
                                                conn=dict(responder_resources=1, initiator_depth=1))

    def _connect(self, make, conn):
        """Resolve, make the QP (``make(cm_id)``, returning what owns it) and connect a new id to the
        server; a refused connect (the server not listening yet) is retried until --timeout."""
        import pyrdma as rd
        cfg = self.cfg
        deadline = time.monotonic() + cfg.args.timeout
        while True:
            cm_id = rd.CMID()
            made = None
            try:
                cm_id.resolve_addr(cfg.host, cfg.args.port, timeout=2.0)
                cm_id.resolve_route(timeout=2.0)
                made = make(cm_id)
                cm_id.connect(retry_count=7, rnr_retry_count=7, timeout=cfg.args.timeout, **conn)
                return cm_id, made
            except RDMAError as exc:
                if isinstance(made, CMConversation):
                    made.close()
                cm_id.close()
                refused = "REJECTED" in str(exc) or "UNREACHABLE" in str(exc)
                if not refused or time.monotonic() + CONNECT_RETRY_S > deadline:
                    raise PeerError(f"rdma_cm connect to {cfg.host}:{cfg.args.port} failed: {exc}",
                                    peer=f"{cfg.host}:{cfg.args.port}") from None
                time.sleep(CONNECT_RETRY_S)
            except BaseException:
                if isinstance(made, CMConversation):
                    made.close()
                cm_id.close()
                raise

    def _serve_comm(self):
        import pyrdma as rd
        cfg = self.cfg
        self.listener = rd.CMID()
        host = None if cfg.args.bind in ("0.0.0.0", "") else cfg.args.bind
        self.listener.bind_addr(host, cfg.args.port)
        self.listener.listen()
        self._print_waiting()        # once listening: a client may connect from now on
        req = self.listener.get_request(timeout=max(cfg.args.timeout, 600.0))
        peer = req.peer_addr
        peer = f"{peer[0]}:{peer[1]}" if peer else "the client"
        try:
            self.conv = CMConversation(req, peer, False, cfg.args.timeout)
            req.accept(timeout=cfg.args.timeout)
        except BaseException:
            if self.conv is not None:
                self.conv.close()
            req.close()
            raise
        self.comm_id = req

    # -- the test QPs ----------------------------------------------------------------------------
    def open_device(self):
        ctx = self.comm_id.context
        dev = self.cfg.args.ib_dev
        if dev is not None and dev != ctx.name:
            raise UsageError(f"-d {dev}: with -R the device is the one the address resolves to ({ctx.name})")
        self.cfg.args.ib_port = self.comm_id.port_num
        return ctx

    def create_qps(self, pd, cq, rcq, port, gid_index):
        return []            # made on the CM ids in connect_qps

    def attach_qps(self):
        """perftest's create_rdma_cm_connection: a handshake, one rdma_cm connection per test QP
        (made on its CM id), another handshake. The key records follow as the test's script says."""
        from pyrdma.perf import loops
        cfg, res = self.cfg, self.res
        blank = Dest(lid=0, out_reads=0, qpn=0, psn=0, rkey=0, vaddr=0)
        self.conv.keys(blank)        # perftest syncs before its rdma_cm connections ...
        # perftest asks for read/atomic depth only in the tests that need it (0 otherwise; 1 here)
        depth = self.out_reads if cfg.verb in ("read", "atomic") else 1
        conn = dict(responder_resources=depth, initiator_depth=depth)
        caps = dict(self.qp_caps, max_inline_data=self.inline)

        def make_qp(cm_id):
            return cm_id.create_qp(res.pd, res.cq, res.rcq, **caps)

        for _ in range(cfg.num_qps):
            if cfg.is_server:
                req = self.listener.get_request(timeout=cfg.args.timeout)
                try:
                    qp = make_qp(req)
                    req.accept(timeout=cfg.args.timeout, **conn)
                except BaseException:
                    req.close()
                    raise
                cm_id = req
            else:
                cm_id, qp = self._connect(make_qp, conn)
            self.test_ids.append(cm_id)
            res.qps.append(qp)
        if cfg.verb == "send":
            res.rx_posted = None     # build_resources saw no QPs: the first receives go up now
            loops.ensure_receives(res, cfg.rx_depth)
        self.conv.keys(blank)        # ... and after them

    def sq_psn(self, qp):
        return random.getrandbits(24)     # rdma_cm chose the PSNs; perftest prints a random one

    def rtr(self, theirs, endpoint, mtu):
        pass                 # rdma_cm connected the QPs

    def finish(self):
        try:
            return super().finish()
        finally:
            self._disconnect()

    def _disconnect(self):
        for cm_id in self.test_ids + ([self.comm_id] if self.comm_id is not None else []):
            try:
                cm_id.disconnect()
            except Exception:
                pass

    def fail(self, exc):
        pass                 # perftest has no error message: closing the ids disconnects it

    def close(self):
        try:
            super().close()
        finally:
            for obj in (*self.test_ids, self.comm_id, self.listener):
                if obj is not None:
                    try:
                        obj.close()
                    except Exception:
                        pass
