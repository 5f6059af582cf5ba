"""The side of a pyrdma-perf run (server or client): its resources, the exchange with the peer,
the measurement per (mode, size), the printing and the JSON report. ``Side`` meets another
pyrdma-perf over pyrdma's TCP exchange; pyrdma.perf.compat (perftest's exchange) and
pyrdma.perf.rdmacm (rdma_cm) derive from it. The run's parameters come in a pyrdma.perf.cli.Config.
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np

from pyrdma.perf import stats

DEF_INLINE_WRITE, DEF_INLINE_SEND = 220, 236
# perftest only turns inline on for devices it knows; a Soft-RoCE (vendor 0xffffff) gets 0.
_INLINE_VENDORS = {0x02C9, 0x15B3, 0x8086, 0x1425, 0x14E4, 0x1077, 0x1FC1, 0x1D0F}


def _default_inline(cfg, vendor_id):
    if cfg.inline_req is not None:
        return max(0, cfg.inline_req)
    if cfg.kind != "lat" or cfg.verb not in ("write", "send"):
        return 0
    if vendor_id not in _INLINE_VENDORS:
        return 0
    return DEF_INLINE_WRITE if cfg.verb == "write" else DEF_INLINE_SEND


def _alt_hex(value, width):
    # C's "%#0Nx": zero prints without the 0x prefix
    return f"{value:0{width}x}" if value == 0 else f"{value:#0{width}x}"


def _print_addr(side, ep, verb, out_reads):
    line = f" {side} address: LID {_alt_hex(ep.lid, 4)} QPN {_alt_hex(ep.qpn, 6)} PSN {_alt_hex(ep.psn, 6)}"
    if verb == "read":
        line += f" OUT {_alt_hex(out_reads, 4)}"
    if verb in ("read", "write"):
        line += f" RKey {_alt_hex(ep.rkey, 8)} VAddr {_alt_hex(ep.addr, 16)}"
    print(line)
    print(" GID: " + ":".join(f"{b:02d}" for b in ep.gid))


class Side:
    """One side of a test run against another pyrdma-perf: resources, channel, printing, JSON."""

    wire_name = "pyrdma wire v1"
    exchange_name = "Ethernet"

    def __init__(self, cfg):
        self.cfg = cfg
        self.results = []
        self.res = None
        self.ch = None
        self.check_failures = []

    # -- setup -----------------------------------------------------------------------------------
    def open(self):
        self.open_channel()
        self.build_resources()
        self.connect_qps()

    def open_channel(self):
        """Meet the peer over TCP and agree on the run parameters (the client's win)."""
        from pyrdma.perf import oob
        cfg = self.cfg
        if cfg.is_server:
            self._print_waiting()
            self.ch = self._accept_client()
            self.ch.send_json(oob.HELLO, dict(cfg.run_params(), ok=True))
        else:
            self.ch = oob.dial(cfg.host, cfg.args.port, timeout=cfg.args.timeout)
            reply = self.ch.exchange_json(oob.HELLO, cfg.run_params())
            if reply.get("test") != cfg.test:
                raise SystemExit(f"pyrdma-perf: server runs {reply.get('test')}, not {cfg.test}")

    def _accept_client(self):
        """The first client whose HELLO is well-formed, authenticated and within bounds; the
        others are told why and dropped, and the server waits on (perftest serves one client)."""
        from pyrdma.perf import oob
        cfg = self.cfg
        mismatch = []

        def admit(hello):
            if hello.get("test") != cfg.test:
                mismatch.append(hello.get("test"))   # a pyrdma-perf client of another test
                return
            cfg.check_params(hello)
        ch, hello = oob.listen(cfg.args.port, host=cfg.args.bind, timeout=max(cfg.args.timeout, 600.0),
                               admit=admit)
        ch.timeout = cfg.args.timeout
        if mismatch:      # end as perftest does when the two sides run different tests
            ch.fail(f"server runs {cfg.test}, client asked for {mismatch[0]}")
            ch.close()
            raise SystemExit(f"pyrdma-perf: client runs {mismatch[0]}, this server {cfg.test}")
        cfg.adopt(hello)
        return ch

    @staticmethod
    def _print_waiting():
        print("\n************************************\n* Waiting for client to connect... *\n"
              "************************************", flush=True)

    def build_resources(self, min_half=4096):
        """Context, PD, one MR of [source half | destination half], CQs and the QPs in INIT."""
        import pyrdma as rd
        from pyrdma.perf import loops
        cfg = self.cfg
        ctx = self.open_device()
        try:
            port = cfg.args.ib_port
            gid_index = cfg.args.gid_index if cfg.args.gid_index >= 0 else ctx.best_gid_index(port)
            dev = ctx.query_device()
            self.inline = _default_inline(cfg, dev.vendor_id)
            pd = rd.ProtectionDomain(ctx)
            half = max(min_half, -(-max(cfg.sizes) // 4096) * 4096)
            buf = rd.aligned_empty(2 * half)
            seed = 2 if cfg.is_server else 1
            buf[:half] = loops.pattern(half, seed)
            buf[half:] = 0
            mr = rd.MemoryRegion(pd, buf, rd.ACCESS_ALL)
            nq = cfg.num_qps
            send_depth = max(cfg.tx_depth, cfg.post_list, 16) + 1
            cq = rd.CompletionQueue(ctx, cqe=max(256, 2 * send_depth * nq))
            rcq = rd.CompletionQueue(ctx, cqe=max(256, (cfg.rx_depth + 16) * nq)) if cfg.verb == "send" else cq
            self.qp_caps = dict(max_send_wr=send_depth,
                                max_recv_wr=max(1, cfg.rx_depth) if cfg.verb == "send" else 1)
            qps = self.create_qps(pd, cq, rcq, port, gid_index)
            self.res = loops.Resources(ctx=ctx, pd=pd, cq=cq, rcq=rcq, mr=mr, buf=buf, half=half, qps=qps,
                                       inline_size=self.inline, seed=seed)
        except BaseException:
            ctx.close()
            raise
        self.port_attr = ctx.query_port(port)
        self.gid_index = gid_index
        self.dev_name = ctx.name
        self.out_reads = min(16, dev.max_qp_rd_atom)
        for qp in qps:
            qp.to_init()
        if cfg.verb == "send":
            # Pre-post the first receives in INIT, before the peer can send, as perftest does
            # (ctx_set_recv_wqes runs before RTR): a SEND that finds no receive is RNR-NAKed and
            # retried only after the RNR timer, which on rxe is at least one tick (4 ms).
            loops.ensure_receives(self.res, cfg.rx_depth)

    def open_device(self):
        import pyrdma as rd
        return rd.Context(self.cfg.args.ib_dev)

    def create_qps(self, pd, cq, rcq, port, gid_index):
        """The test's RC QPs in RESET (with rdma_cm they are made on the CM ids instead)."""
        import pyrdma as rd
        qps = []
        for _ in range(self.cfg.num_qps):
            kwargs = dict(self.qp_caps, max_inline_data=self.inline, port=port, gid_index=gid_index)
            try:
                qps.append(rd.QueuePair(pd, rd.QPT_RC, cq, rcq, **kwargs))
            except rd.RDMAError:
                if not self.inline:
                    raise
                self.inline = 0   # the device refused that much inline data
                kwargs["max_inline_data"] = 0
                qps.append(rd.QueuePair(pd, rd.QPT_RC, cq, rcq, **kwargs))
        return qps

    def connect_qps(self):
        import pyrdma as rd
        qps, mr = self.res.qps, self.res.mr
        local = [qp.endpoint(mr=mr) for qp in qps]
        remotes = self.ch.exchange_endpoints(local)
        if len(remotes) != len(local):
            raise SystemExit(f"pyrdma-perf: peer has {len(remotes)} QPs, we have {len(local)}")
        for qp, remote in zip(qps, remotes):
            qp.connect(remote, timeout=self.cfg.args.qp_timeout)
        self.res.remotes = remotes
        self.local = local
        self.mtu_bytes = min(self.port_attr.active_mtu_bytes, rd.mtu_to_bytes(remotes[0].mtu))
        self.ch.sync("rts")

    # -- printing --------------------------------------------------------------------------------
    def print_banner(self):
        cfg = self.cfg
        words = [cfg.title]
        if cfg.verb == "atomic":
            words.append(cfg.atomic_type)
        if cfg.kind == "bw":
            if cfg.bidir:
                words.append("Bidirectional")
            words.append("BW")
        else:
            words.append("Latency")
        print(stats.RESULT_LINE)
        print("                    " + " ".join(words) + " Test")
        print(f" Dual-port       : OFF\t\tDevice         : {self.dev_name}")
        print(f" Number of qps   : {cfg.num_qps}\t\tTransport type : IB")
        print(" Connection type : RC\t\tUsing SRQ      : OFF")
        if not cfg.is_server or cfg.bidir:
            print(f" TX depth        : {cfg.tx_depth}")
        if cfg.verb == "send" and (cfg.is_server or cfg.bidir):
            print(f" RX depth        : {cfg.rx_depth}")
        if cfg.kind == "bw":
            print(f" CQ Moderation   : {cfg.cq_mod_for(cfg.sizes[0])}")
            if "batched" in cfg.modes:
                print(f" Post List       : {min(cfg.post_list, cfg.tx_depth)} (batched mode)")
        print(f" Mtu             : {self.mtu_bytes}[B]")
        print(f" Link type       : {self.port_attr.link_layer}")
        print(f" GID index       : {self.gid_index}")
        if cfg.verb in ("read", "atomic"):
            print(f" Outstand reads  : {self.out_reads}")
        else:
            print(f" Max inline data : {self.inline}[B]")
        print(f" rdma_cm QPs\t : {'ON' if self.exchange_name == 'rdma_cm' else 'OFF'}")
        print(f" Data ex. method : {self.exchange_name} ({self.wire_name})")
        print(stats.RESULT_LINE)
        for ep in self.local:
            _print_addr("local", ep, cfg.verb, self.out_reads)
        for ep in self.res.remotes:
            _print_addr("remote", ep, cfg.verb, self.out_reads)

    def _table_header(self, mode):
        cfg = self.cfg
        print(stats.RESULT_LINE)
        print(f" pyrdma mode     : {mode}")
        if cfg.kind == "bw":
            print(stats.bw_header(cfg.gbits))
        elif cfg.duration is None:
            print(stats.LAT_HEADER)
        else:
            print(stats.LAT_DUR_HEADER)
        sys.stdout.flush()

    # -- runs ------------------------------------------------------------------------------------
    def run_all(self):
        cfg = self.cfg
        prints_rows = not (cfg.kind == "lat" and cfg.verb in ("read", "atomic") and cfg.is_server)
        for mode in cfg.modes:
            if prints_rows:
                self._table_header(mode)
            for size in cfg.sizes:
                mine, peer, check = self.run_one(mode, size)
                shown = mine
                if cfg.kind == "bw" and cfg.verb != "send":
                    if cfg.bidir:
                        shown = mine + peer
                    elif cfg.is_server:
                        shown = peer      # perftest's server prints the client's numbers
                if prints_rows and shown is not None:
                    print(shown.row(), flush=True)
                self.results.append(dict(mode=mode, size=size, report=_d(mine), peer_report=_d(peer),
                                         shown=_d(shown), check=check))
        if prints_rows:
            print(stats.RESULT_LINE)
        elif cfg.is_server:
            print(stats.RESULT_LINE)

    def run_one(self, mode, size):
        from pyrdma.perf import loops, oob
        cfg, res, ch = self.cfg, self.res, self.ch
        half = res.half
        res.buf[half:half + size] = 0          # destination area: cleared before the barrier
        if cfg.verb == "send":
            loops.ensure_receives(res, cfg.rx_depth)
        ch.sync(f"go:{mode}:{size}")
        mine, run_ops = self.measure(mode, size)
        peer_msg = ch.exchange_json(oob.REPORT, dict(report=_d(mine), kind=_kind(mine),
                                                     atomic_ops=run_ops))
        peer = report_from_dict(peer_msg.get("report"), peer_msg.get("kind"))
        ops = peer_msg.get("atomic_ops")
        if ops is not None and (not isinstance(ops, int) or isinstance(ops, bool) or ops < 0):
            from pyrdma.errors import WireFormatError
            raise WireFormatError(f"the peer's atomic_ops={str(ops)[:40]!r} is not a count")
        if cfg.duration is not None:
            loops.drain_receives(res)
        check = self.check_data(size, peer_msg) if cfg.check else None
        if check is not None and check != "OK":
            self.check_failures.append(f"{mode} {size}B: {check}")
        return mine, peer, check

    def measure(self, mode, size):
        """Run one (mode, size) on our side; (our report or None, operations we issued or None)."""
        from pyrdma.perf import loops
        cfg, res = self.cfg, self.res
        mine = None
        run_ops = None         # operations issued this run (atomic check: the peer's counter)
        kw = dict(mode=mode, duration=cfg.duration, margin=cfg.margin)
        sender = (not cfg.is_server) or cfg.bidir
        if cfg.kind == "bw":
            cq_mod = cfg.cq_mod_for(size)
            if cfg.verb == "send" and cfg.is_server:
                t0, t1, got = loops.bw_receiver(res, size, cfg.iters, rx_depth=cfg.rx_depth, **kw)
                if cfg.duration is None:
                    mine = stats.bw_report([t0], [t1], size, cfg.iters, num_qps=cfg.num_qps, no_peak=True,
                                           gbits=cfg.gbits)
                else:
                    mine = stats.bw_duration_report(t0, t1, size, got, gbits=cfg.gbits)
            elif sender:
                run = loops.bw_sender(res, cfg.verb, size, cfg.iters, tx_depth=cfg.tx_depth, cq_mod=cq_mod,
                                      post_list=cfg.post_list, atomic_type=cfg.atomic_type,
                                      warmup=cfg.verb != "send", **kw)
                run_ops = run.posted
                mine = loops.bw_report_from(run, size, num_qps=cfg.num_qps, cq_mod=cq_mod,
                                            post_list=cfg.post_list, gbits=cfg.gbits, no_peak=cfg.no_peak,
                                            mode=mode, tx_depth=cfg.tx_depth)
        else:
            rtt = 2 if cfg.verb in ("write", "send") else 1
            out = None
            if cfg.verb == "write":
                out = loops.write_lat(res, size, cfg.iters, is_server=cfg.is_server,
                                      inline=size <= self.inline, **kw)
            elif cfg.verb == "send":
                out = loops.send_lat(res, size, cfg.iters, is_server=cfg.is_server, inline=size <= self.inline,
                                     rx_depth=cfg.rx_depth, **kw)
            elif not cfg.is_server:
                out = loops.op_lat(res, cfg.verb, size, cfg.iters, atomic_type=cfg.atomic_type, **kw)
                run_ops = out[1] if cfg.duration is None else None
            if out is not None:
                if cfg.duration is None:
                    mine = stats.lat_report(out[0], size, out[1], rtt_factor=rtt)
                else:
                    mine = stats.lat_duration_report(out[0], size, out[1], rtt_factor=rtt)
        return mine, run_ops

    def check_data(self, size, peer_msg):
        """Verify what the peer's operations left in our memory (or what ours fetched)."""
        from pyrdma.perf import loops
        cfg, res = self.cfg, self.res
        half = res.half
        peer_seed = 1 if cfg.is_server else 2
        expect = loops.pattern(size, peer_seed)
        got = res.buf[half:half + size]
        if cfg.verb == "write":
            receives = cfg.is_server or cfg.bidir or cfg.kind == "lat"
            if not receives:
                return None
            n = size - 1 if cfg.kind == "lat" else size   # write_lat's last byte carries the counter
            ok = np.array_equal(got[:n], expect[:n])
        elif cfg.verb == "read":
            if cfg.is_server and not cfg.bidir:
                return None
            ok = np.array_equal(got, expect)
        elif cfg.verb == "send":
            if not cfg.is_server and cfg.kind == "bw":
                return None
            ok = np.array_equal(got, expect)
        else:
            if not cfg.is_server and not cfg.bidir:
                return None
            counter = int(res.buf[half:half + 8].view(np.uint64)[0])
            if peer_msg.get("atomic_ops") is None:
                return None    # duration runs: the count is not known exactly
            # the counter was zeroed before this run; FETCH_AND_ADD adds 1 per op, CMP_AND_SWAP
            # compares with 0 and swaps in 0
            want = 0 if cfg.atomic_type == "CMP_AND_SWAP" else int(peer_msg["atomic_ops"])
            if counter != want:
                return f"FAIL: remote counter {counter}, expected {want}"
            return "OK"
        if ok:
            return "OK"
        bad = int(np.argmax(got[:len(expect)] != expect)) if len(got) else 0
        return f"FAIL: first mismatch at byte {bad}"

    def finish(self):
        try:
            self.ch.bye()
        finally:
            self.ch.close()
        return self.report_files()

    def report_files(self):
        """Print the data check verdict and write --json; the exit status."""
        cfg = self.cfg
        if cfg.check:
            print(" Data check      : " + ("OK" if not self.check_failures else
                                           "FAILED: " + "; ".join(self.check_failures)))
        if cfg.args.json_path:
            doc = dict(tool="pyrdma-perf", test=cfg.test, role="server" if cfg.is_server else "client",
                       device=self.dev_name, kind=cfg.kind, params=dict(cfg.run_params(), tx_depth=cfg.tx_depth,
                                                                         rx_depth=cfg.rx_depth,
                                                                         inline=self.inline,
                                                                         gbits=cfg.gbits),
                       units=dict(bw="Gb/sec" if cfg.gbits else "MB/sec (2^20 bytes)", lat="usec",
                                  msg_rate="Mpps"),
                       results=self.results, check_failures=self.check_failures,
                       time=time.strftime("%Y-%m-%dT%H:%M:%S"))
            with open(cfg.args.json_path, "w") as fh:
                json.dump(doc, fh, indent=1)
        return 1 if self.check_failures else 0

    def fail(self, exc):
        """Tell the peer we give up (best effort)."""
        if self.ch is not None:
            self.ch.fail(f"{type(exc).__name__}: {exc}")

    def close(self):
        if self.res is not None:
            self.res.close()
        if self.ch is not None:
            self.ch.close()


def _kind(report):
    return None if report is None else type(report).__name__


def _d(report):
    return None if report is None else report.to_dict()


def report_from_dict(d, kind):
    """The peer's report (a dict from its REPORT message); WireFormatError unless it is one."""
    from pyrdma.errors import WireFormatError
    if d is None:
        return None
    cls = {"BWReport": stats.BWReport, "LatReport": stats.LatReport,
           "LatDurationReport": stats.LatDurationReport}.get(kind)
    if cls is None:
        return None
    if not isinstance(d, dict):
        raise WireFormatError(f"the peer's report is {type(d).__name__}, not an object")
    fields = cls.__dataclass_fields__
    d = {k: v for k, v in d.items() if k in fields}
    for k, v in d.items():
        if not isinstance(v, (int, float)):
            raise WireFormatError(f"the peer's report has {k}={str(v)[:40]!r}, not a number")
    try:
        return cls(**d)
    except TypeError as exc:
        raise WireFormatError(f"the peer's report is incomplete: {exc}") from None
