"""``pyrdma-perf --perftest-compat``: one side of a test whose other side is Debian's perftest.

    ib_write_bw -d rxe0 -x 1 -s 65536                                        # perftest server
    pyrdma-perf write_bw --perftest-compat -d rxe0 -x 1 -s 65536 127.0.0.1   # our client

    pyrdma-perf read_bw --perftest-compat -d rxe0 -x 1                       # our server
    ib_read_bw -d rxe0 -x 1 127.0.0.1                                        # perftest client

Over TCP only the unidirectional RDMA WRITE and READ bandwidth tests: their server is passive (it
exposes a buffer and waits). With ``-R`` (pyrdma.perf.rdmacm) every test: each perftest test has its
own sequence of handshakes around the run (``SCRIPTS``), and both exchanges follow it. No run
parameters travel, so just as between two perftest binaries both sides must be given the same
-s/-a, -n and -q (and, against another pyrdma-perf, the same --mode). A passive BW server prints the
client's figures, as perftest does; in the other tests each side prints its own.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from pyrdma.errors import UsageError
from pyrdma.perf import stats
from pyrdma.perf.side import Side
from pyrdma.perf.perftest_wire import WIRE_VERSION, Conversation, Dest


@dataclass(frozen=True)
class Script:
    """What one perftest test says over its exchange once the QPs exist (Debian perftest 4.5,
    src/*_bw.c and *_lat.c main()); every message is a key-record handshake unless noted.

    ``setup``: ``"keys"`` swaps every QP's record and learns the peer's, ``"rtr"`` is where the QPs
    are connected (over TCP; rdma_cm connected them before), ``"each"`` swaps every QP's record
    again, ``"first"`` swaps QP 0's record once."""
    setup: tuple
    server_runs: bool        # the server takes part in the run (else it waits in the next handshake)
    sync_before: bool        # a handshake before each size (send tests: the receives are posted)
    sync_after: bool         # and one after it, with -a only (send_bw's -a loop; its -s run has none)
    reports: bool            # the client's BW report goes to the server, which prints it
    close: bool              # ctx_close_connection at the end (write_lat just leaves)


_PASSIVE_BW = Script(("keys", "rtr", "each", "first"), server_runs=False, sync_before=False, sync_after=False,
                     reports=True, close=True)
_PASSIVE_LAT = Script(("first", "keys", "rtr", "each", "first"), server_runs=False, sync_before=False,
                      sync_after=False, reports=False, close=True)
SCRIPTS = {
    "write_bw": _PASSIVE_BW,
    "read_bw": _PASSIVE_BW,
    "atomic_bw": _PASSIVE_BW,
    "send_bw": Script(("keys", "rtr", "first", "each"), server_runs=True, sync_before=True, sync_after=True,
                      reports=False, close=True),
    "write_lat": Script(("first", "keys", "rtr", "each", "first"), server_runs=True, sync_before=False,
                        sync_after=False, reports=False, close=False),
    "read_lat": _PASSIVE_LAT,
    "atomic_lat": _PASSIVE_LAT,
    "send_lat": Script(("keys", "rtr", "first", "each"), server_runs=True, sync_before=True, sync_after=False,
                       reports=False, close=True),
}
TESTS = ("write_bw", "read_bw")      # over TCP (--perftest-compat); -R runs every test in SCRIPTS


def _list(names):
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]


class PerftestSide(Side):
    """A Side that speaks perftest's TCP exchange (pyrdma.perf.perftest_wire) instead of ours."""

    wire_name = f"perftest {WIRE_VERSION} exchange"
    option = "--perftest-compat"
    tests = TESTS
    tests_why = "the tests whose perftest server is passive"

    def __init__(self, cfg):
        super().__init__(cfg)
        if cfg.test not in self.tests:
            raise SystemExit(f"pyrdma-perf: {self.option} runs {_list(self.tests)} ({self.tests_why}), "
                             f"not {cfg.test}")
        if cfg.bidir:
            raise SystemExit(f"pyrdma-perf: {self.option} does not run -b (bidirectional) tests")
        if cfg.check:
            raise SystemExit("pyrdma-perf: --check needs a pyrdma-perf peer; perftest does not say what "
                             "its buffer holds")
        self.script = SCRIPTS[cfg.test]
        if self.script.server_runs:
            # both sides run every size in step, with no handshake of ours between runs: one pass,
            # and a run perftest's loop can follow
            if cfg.args.mode is None:
                cfg.modes = ["loop"]
            elif len(cfg.modes) > 1:
                raise SystemExit(f"pyrdma-perf: {cfg.test} against perftest runs one pass: choose "
                                 "--mode loop or --mode batched (the default here is loop)")
            if cfg.duration is not None:
                raise SystemExit(f"pyrdma-perf: {self.option} runs {cfg.test} for -n iterations, not -D")
        self.conv = None
        self.mine = []
        self.with_gid = True

    def open_channel(self):
        from pyrdma.connect import dial_one
        cfg = self.cfg
        if cfg.is_server:
            self._print_waiting()
            self._accept_perftest()
        else:
            sock, _ = dial_one(cfg.host, cfg.args.port, cfg.args.timeout)
            peer = f"{cfg.host}:{cfg.args.port}"
            self.conv = Conversation(sock, peer, client=True, timeout=cfg.args.timeout)
            self.conv.versions()
            self.cycle_buffer, _ = self.conv.sys_data(os.sysconf("SC_PAGESIZE"))

    def _accept_perftest(self):
        """The first client that speaks perftest's opening (version, sizes) within bounds; others
        are dropped and the server waits on. perftest's exchange has no room for a secret."""
        import sys
        import time
        from pyrdma.connect import Listener
        from pyrdma.errors import PeerError, RDMATimeoutError, WireFormatError
        from pyrdma.wire import HANDSHAKE_TIMEOUT, drop, job_secret
        cfg = self.cfg
        if job_secret() is not None:
            print("pyrdma-perf: note: perftest's exchange cannot carry PYRDMA_JOB_SECRET; this server "
                  "does not authenticate its client (use --bind to limit who can reach it)", file=sys.stderr)
        deadline = time.monotonic() + max(cfg.args.timeout, 600.0)
        with Listener(cfg.args.bind, cfg.args.port) as listener:
            while True:
                sock, peer = listener.accept(deadline, who="perftest client")
                conv = Conversation(sock, peer, client=False, timeout=min(cfg.args.timeout, HANDSHAKE_TIMEOUT))
                try:
                    conv.versions()
                    self.cycle_buffer, _ = conv.sys_data(os.sysconf("SC_PAGESIZE"))
                except (WireFormatError, PeerError, RDMATimeoutError) as exc:
                    drop(sock, peer, str(exc))
                    print(f"pyrdma-perf: refused a client from {peer}: {exc}", file=sys.stderr, flush=True)
                    continue
                conv.set_timeout(cfg.args.timeout)
                self.conv = conv
                return

    def build_resources(self, min_half=4096):
        super().build_resources(min_half=max(min_half, self.cycle_buffer))
        self.res.perftest_peer = True

    def connect_qps(self):
        """The key records, in the order the test's script swaps them, and the QPs connected."""
        import pyrdma as rd
        res, conv, port = self.res, self.conv, self.cfg.args.ib_port
        mtu = conv.mtu(self.port_attr.active_mtu)
        self.attach_qps()
        # perftest sends a GID exactly when it has a GID index: always on RoCE, with -x on InfiniBand
        self.with_gid = self.port_attr.link_layer == "Ethernet" or self.cfg.args.gid_index >= 0
        gid = res.ctx.query_gid(port, self.gid_index) if self.with_gid else bytes(16)
        vaddr = res.mr.addr + res.half      # what the peer writes to or reads from
        self.mine = [Dest(lid=self.port_attr.lid, out_reads=self.out_reads, qpn=qp.qp_num, psn=self.sq_psn(qp),
                          rkey=res.mr.rkey, vaddr=vaddr, gid=gid) for qp in res.qps]
        length = max(self.cfg.sizes)

        def endpoint(d):
            return rd.Endpoint(qpn=d.qpn, psn=d.psn, lid=d.lid, gid=d.gid, port=port, gid_index=self.gid_index,
                               mtu=mtu, addr=d.vaddr, rkey=d.rkey, length=length)

        theirs = None
        for step in self.script.setup:
            if step == "keys":
                theirs = [conv.keys(d, self.with_gid) for d in self.mine]
            elif step == "rtr":
                self.rtr(theirs, endpoint, mtu)
            elif step == "each":
                for d in self.mine:
                    conv.keys(d, self.with_gid)
            else:
                self.handshake()
        res.remotes = [endpoint(d) for d in theirs]
        self.local = [endpoint(d) for d in self.mine]
        self.mtu_bytes = rd.mtu_to_bytes(mtu)

    def attach_qps(self):
        """Where -R makes its rdma_cm connections; over TCP the QPs are already in INIT."""

    def sq_psn(self, qp):
        return qp.psn

    def rtr(self, theirs, endpoint, mtu):
        """Over TCP: both QPs to RTR and RTS once the records are known (perftest's ctx_connect)."""
        if self.with_gid and theirs[0].ipv4_mapped != self.mine[0].ipv4_mapped:
            raise UsageError("the two sides use different GID types (one IPv4-mapped, one IPv6): "
                             "choose -x on both so they match")
        for qp, d in zip(self.res.qps, theirs):
            qp.to_rtr(endpoint(d), path_mtu=mtu, max_dest_rd_atomic=self.out_reads)
            qp.to_rts(timeout=self.cfg.args.qp_timeout, max_rd_atomic=max(1, d.out_reads))

    def handshake(self):
        """perftest's ctx_hand_shake on QP 0's record: its barrier."""
        self.conv.keys(self.mine[0], self.with_gid)

    def run_all(self):
        # a passive server waits in finish() while perftest's client runs the test
        if not self.cfg.is_server or self.script.server_runs:
            super().run_all()

    def run_one(self, mode, size):
        """One size, with the test's own barriers around it: never ours (perftest has none), and the
        destination is not cleared (write_lat's peer may already be writing the next size)."""
        from pyrdma.perf import loops
        cfg, script = self.cfg, self.script
        if cfg.verb == "send" and (cfg.is_server or cfg.kind == "lat"):
            loops.ensure_receives(self.res, cfg.rx_depth)     # before the barrier, as perftest
        if script.sync_before:
            self.handshake()
        mine, _ = self.measure(mode, size)
        if script.sync_after and cfg.all:
            self.handshake()
        return mine, None, None

    def finish(self):
        cfg, conv, script = self.cfg, self.conv, self.script
        if not script.close:        # write_lat: neither side says more once its run is over
            conv.close()
            return self.report_files()
        if cfg.is_server:
            conv.set_timeout(max(cfg.args.timeout, 600.0))   # the client's whole run
        if script.reports:
            self._reports()
        conv.finish(self.mine[0], self.with_gid)
        return self.report_files()

    def _reports(self):
        """The client's "finished" handshake and the BW reports; the server prints the client's."""
        cfg, conv = self.cfg, self.conv
        self.handshake()
        conv.set_timeout(cfg.args.timeout)
        last = self.results[-1]["report"] if self.results else None
        mine = last or dict(size=0, iters=0, bw_peak=0.0, bw_avg=0.0, msg_rate=0.0)
        peer = conv.reports(mine)
        if cfg.is_server:
            # perftest's server prints the client's figures (in its own -s/--report_gbits units)
            shown = stats.BWReport(gbits=cfg.gbits, **peer)
            print(stats.RESULT_LINE)
            print(stats.bw_header(cfg.gbits))
            print(shown.row())
            print(stats.RESULT_LINE, flush=True)
            self.results.append(dict(mode="perftest", size=peer["size"], report=None, peer_report=peer,
                                     shown=shown.to_dict(), check=None))

    def fail(self, exc):
        if self.conv is not None:
            self.conv.close()     # perftest has no error message; a closed socket ends it

    def close(self):
        super().close()
        if self.conv is not None:
            self.conv.close()
