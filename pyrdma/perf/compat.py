"""``pyrdma-perf --perftest-compat``: one side of a test whose other side is Debian's perftest.

    ib_write_bw -d rxe0 -x 1 -s 65536                                        # perftest server
    pyrdma-perf write_bw --perftest-compat -d rxe0 -x 1 -s 65536 127.0.0.1   # our client

    pyrdma-perf read_bw --perftest-compat -d rxe0 -x 1                       # our server
    ib_read_bw -d rxe0 -x 1 127.0.0.1                                        # perftest client

Only the unidirectional RDMA WRITE and READ bandwidth tests: their server is passive (it exposes a
buffer and waits), so no run parameters need to travel, just as between two perftest binaries both
sides must be given the same -s/-a and -q. The server prints the client's figures, as perftest does.
"""
from __future__ import annotations

import os

from pyrdma.errors import UsageError
from pyrdma.perf import stats
from pyrdma.perf.cli import Side
from pyrdma.perf.perftest_wire import WIRE_VERSION, Conversation, Dest

TESTS = ("write_bw", "read_bw")


class PerftestSide(Side):
    """A Side that speaks perftest's TCP exchange (pyrdma.perf.perftest_wire) instead of ours."""

    wire_name = f"perftest {WIRE_VERSION} exchange"

    def __init__(self, cfg):
        super().__init__(cfg)
        if cfg.test not in TESTS:
            raise SystemExit(f"pyrdma-perf: --perftest-compat runs {' and '.join(TESTS)} (the tests whose "
                             f"perftest server is passive), not {cfg.test}")
        if cfg.bidir:
            raise SystemExit("pyrdma-perf: --perftest-compat does not run -b (bidirectional) tests")
        if cfg.check:
            raise SystemExit("pyrdma-perf: --check needs a pyrdma-perf peer; perftest does not say what "
                             "its buffer holds")
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
        import pyrdma as rd
        res, port = self.res, self.cfg.args.ib_port
        mtu = self.conv.mtu(self.port_attr.active_mtu)
        # perftest sends a GID exactly when it has a GID index: always on RoCE, with -x on InfiniBand
        self.with_gid = self.port_attr.link_layer == "Ethernet" or self.cfg.args.gid_index >= 0
        gid = res.ctx.query_gid(port, self.gid_index) if self.with_gid else bytes(16)
        vaddr = res.mr.addr + res.half      # what the peer writes to or reads from
        self.mine = [Dest(lid=self.port_attr.lid, out_reads=self.out_reads, qpn=qp.qp_num, psn=qp.psn,
                          rkey=res.mr.rkey, vaddr=vaddr, gid=gid) for qp in res.qps]
        theirs = [self.conv.keys(d, self.with_gid) for d in self.mine]
        if self.with_gid and theirs[0].ipv4_mapped != self.mine[0].ipv4_mapped:
            raise UsageError("the two sides use different GID types (one IPv4-mapped, one IPv6): "
                             "choose -x on both so they match")
        length = max(self.cfg.sizes)

        def endpoint(d):
            return rd.Endpoint(qpn=d.qpn, psn=d.psn, lid=d.lid, gid=d.gid, port=port, gid_index=self.gid_index,
                               mtu=mtu, addr=d.vaddr, rkey=d.rkey, length=length)

        for qp, d in zip(res.qps, theirs):
            qp.to_rtr(endpoint(d), path_mtu=mtu, max_dest_rd_atomic=self.out_reads)
            qp.to_rts(timeout=self.cfg.args.qp_timeout, max_rd_atomic=max(1, d.out_reads))
        # perftest swaps the records again to print the remote side, then once more after RTR
        for d in self.mine:
            self.conv.keys(d, self.with_gid)
        self.conv.keys(self.mine[0], self.with_gid)
        res.remotes = [endpoint(d) for d in theirs]
        self.local = [endpoint(d) for d in self.mine]
        self.mtu_bytes = rd.mtu_to_bytes(mtu)

    def run_all(self):
        if not self.cfg.is_server:    # perftest's client runs the test; our server waits in finish()
            super().run_all()

    def run_one(self, mode, size):
        mine, _ = self.measure(mode, size)
        return mine, None, None

    def finish(self):
        cfg, conv = self.cfg, self.conv
        if cfg.is_server:
            conv.set_timeout(max(cfg.args.timeout, 600.0))   # the client's whole run
        conv.keys(self.mine[0], self.with_gid)
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
        conv.finish(self.mine[0], self.with_gid)
        return self.report_files()

    def fail(self, exc):
        if self.conv is not None:
            self.conv.close()     # perftest has no error message; a closed socket ends it

    def close(self):
        super().close()
        if self.conv is not None:
            self.conv.close()
