"""pyrdma-perf: perftest's microbenchmarks (ib_write_bw, ib_read_lat, ...) written with pyrdma.

    pyrdma-perf write_bw -d rxe0 -x 1                 # server (no host)
    pyrdma-perf write_bw -d rxe0 -x 1 127.0.0.1       # client
    python -m pyrdma.perf ib_send_lat -a --mode both 10.0.0.1

Flags follow perftest's; the output prints the same banner, columns and arithmetic (see
pyrdma.perf.stats), one table per mode:

``--mode loop``     one public-API call per operation (post_write(...), poll_into(...)).
``--mode batched``  SendWRList post lists + poll_wait (the binding's ceiling).
``--mode both``     both tables, loop first.

Server and client talk over TCP in pyrdma's own versioned format (pyrdma.perf.oob); the client's
run parameters (sizes, iterations, modes, ...) are authoritative and the server adopts them, within
perftest's own limits and the server's --max-size. The server listens on --bind (default every
interface, as perftest's server); a client that is foreign, silent, unauthenticated (with
PYRDMA_JOB_SECRET set) or asks for parameters out of bounds is refused with a message, and the
server waits for the next one.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from pyrdma.perf import stats

TESTS = {
    # name: (verb, kind, title, default iters, default size)
    "write_bw": ("write", "bw", "RDMA_Write", 5000, 65536),
    "write_lat": ("write", "lat", "RDMA_Write", 1000, 2),
    "read_bw": ("read", "bw", "RDMA_Read", 1000, 65536),
    "read_lat": ("read", "lat", "RDMA_Read", 1000, 2),
    "send_bw": ("send", "bw", "Send", 1000, 65536),
    "send_lat": ("send", "lat", "Send", 1000, 2),
    "atomic_bw": ("atomic", "bw", "Atomic", 1000, 8),
    "atomic_lat": ("atomic", "lat", "Atomic", 1000, 8),
}
ALIASES = {f"ib_{name}": name for name in TESTS}
ALIASES.update({name.replace("_", "-"): name for name in TESTS})

DEF_TX_BW, DEF_TX_LAT = 128, 1
DEF_CQ_MOD = 100
CQ_MOD_SIZE_LIMIT = 8192           # perftest disables CQ moderation above this size (not with -a)
DEF_RX_SEND = 512
DEF_POST_LIST = 32                 # batched mode: WRs per list (one signaled completion per list)
DEF_INLINE_WRITE, DEF_INLINE_SEND = 220, 236
# perftest only turns inline on for devices it knows; a Soft-RoCE (vendor 0xffffff) gets 0.
_INLINE_VENDORS = {0x02C9, 0x15B3, 0x8086, 0x1425, 0x14E4, 0x1077, 0x1FC1, 0x1D0F}
MIN_ITER = 5
# Bounds on what a server adopts from a client: perftest's own (perftest_parameters.h) where it has
# them, else generous ones; --max-size (default DEF_MAX_SIZE) caps the memory a client may make the
# server register (twice the largest size).
MAX_ITER = 100_000_000
MAX_MSG_SIZE = 0x7FFFFFFF          # perftest's largest -s (UINT_MAX / 2)
DEF_MAX_SIZE = 1 << 30
MAX_TX = 15000                     # perftest's MAX_TX: the post list never exceeds the send queue
MAX_SIZES = 64
MAX_DURATION = 24 * 3600.0


def build_parser():
    p = argparse.ArgumentParser(
        prog="pyrdma-perf", description="perftest-compatible RDMA microbenchmarks written with pyrdma.",
        epilog="Tests: " + ", ".join(TESTS) + " (perftest names such as ib_write_bw work too). "
               "Without a host this is the server; with one, the client.")
    p.add_argument("test", help="write_bw, write_lat, read_bw, read_lat, send_bw, send_lat, atomic_bw, atomic_lat")
    p.add_argument("host", nargs="?", default=None, help="server to connect to (omit to be the server)")
    p.add_argument("-d", "--ib-dev", "--ib_dev", dest="ib_dev", default=None, help="RDMA device (default: first ACTIVE)")
    p.add_argument("-i", "--ib-port", "--ib_port", dest="ib_port", type=int, default=1)
    p.add_argument("-x", "--gid-index", "--gid_index", dest="gid_index", type=int, default=-1,
                   help="GID index (default: the best RoCEv2/IPv4 entry, 0 on IB)")
    p.add_argument("-s", "--size", type=int, default=None, help="message size in bytes")
    p.add_argument("-a", "--all", action="store_true", help="sizes 2 .. 2^23")
    p.add_argument("--sizes", default=None, help="comma-separated list of sizes, run in one connection")
    p.add_argument("-n", "--iters", type=int, default=None, help="iterations per size")
    p.add_argument("-D", "--duration", type=float, default=None, help="run for this many seconds instead")
    p.add_argument("-f", "--margin", type=float, default=None, help="duration margins (default duration/4)")
    p.add_argument("-q", "--qp", dest="num_qps", type=int, default=1, help="number of QPs (BW tests)")
    p.add_argument("-t", "--tx-depth", "--tx_depth", dest="tx_depth", type=int, default=None)
    p.add_argument("-r", "--rx-depth", "--rx_depth", dest="rx_depth", type=int, default=DEF_RX_SEND)
    p.add_argument("-Q", "--cq-mod", "--cq_mod", dest="cq_mod", type=int, default=None,
                   help="signal one WR in this many (BW loop mode; default 100, 1 above 8 KiB)")
    p.add_argument("-l", "--post-list", "--post_list", dest="post_list", type=int, default=DEF_POST_LIST,
                   help=f"batched mode: WRs per posted list (default {DEF_POST_LIST})")
    p.add_argument("-I", "--inline-size", "--inline_size", dest="inline_size", type=int, default=None,
                   help="max inline size (latency tests; default as perftest: 220 write / 236 send on "
                        "known vendors, 0 otherwise)")
    p.add_argument("-A", "--atomic-type", "--atomic_type", dest="atomic_type", default="FETCH_AND_ADD",
                   choices=["FETCH_AND_ADD", "CMP_AND_SWAP"])
    p.add_argument("-u", "--qp-timeout", "--qp_timeout", dest="qp_timeout", type=int, default=14,
                   help="RC ACK timeout: 4.096 us * 2^timeout before a resend (perftest's -u; default 14)")
    p.add_argument("-p", "--port", type=int, default=18515, help="TCP port of the out-of-band exchange")
    p.add_argument("--bind", default="0.0.0.0",
                   help="server: the address to listen on (default 0.0.0.0, every interface, as perftest; "
                        "give the RDMA interface's address or 127.0.0.1 to stay on it)")
    p.add_argument("--max-size", "--max_size", dest="max_size", type=int, default=DEF_MAX_SIZE,
                   help=f"server: the largest message size a client may ask for (default {DEF_MAX_SIZE})")
    p.add_argument("-b", "--bidirectional", action="store_true", help="both sides send (BW tests)")
    p.add_argument("-N", "--noPeak", "--no-peak", dest="no_peak", action="store_true", help="skip the peak BW")
    p.add_argument("--report_gbits", "--report-gbits", dest="report_gbits", action="store_true",
                   help="report Gb/sec instead of MB/sec (MB = 2^20 bytes, as perftest)")
    p.add_argument("-F", "--CPU-freq", dest="cpu_freq", action="store_true",
                   help="accepted for perftest compatibility; ignored (we time with perf_counter_ns)")
    p.add_argument("--mode", choices=["loop", "batched", "both"], default=None,
                   help="loop: one API call per op; batched: WR lists + poll_wait; both (default; loop "
                        "where a perftest peer runs too: send_bw, write_lat, send_lat with -R)")
    p.add_argument("--json", dest="json_path", default=None, help="write the results here as JSON")
    p.add_argument("--check", action="store_true", help="verify the transferred data after every run")
    p.add_argument("--timeout", type=float, default=60.0, help="out-of-band timeout in seconds")
    p.add_argument("-R", "--rdma_cm", "--rdma-cm", dest="rdma_cm", action="store_true",
                   help="connect with rdma_cm as perftest's -R: the exchange and the QPs are rdma_cm "
                        "connections to --port (every test; the peer is perftest's ib_<test> -R or "
                        "pyrdma-perf -R, given the same -s/-a, -n and -q)")
    p.add_argument("--perftest-compat", dest="perftest_compat", action="store_true",
                   help="speak Debian perftest 4.5's TCP exchange (client of an ib_*_bw/lat server)")
    return p


def canonical_test(name):
    name = name.strip()
    if name in TESTS:
        return name
    if name in ALIASES:
        return ALIASES[name]
    raise SystemExit(f"pyrdma-perf: unknown test {name!r}; choose from {', '.join(TESTS)} "
                     f"(or their perftest names, e.g. ib_write_bw)")


class Config:
    """Parsed and defaulted parameters (perftest's force_dependencies, the parts that apply)."""

    def __init__(self, args):
        self.args = args
        self.test = canonical_test(args.test)
        self.verb, self.kind, self.title, def_iters, def_size = TESTS[self.test]
        self.is_server = args.host is None
        self.host = args.host
        if args.mode in (None, "both"):
            self.modes = ["loop", "batched"]
        else:
            self.modes = [args.mode]
        if args.all:
            self.sizes = stats.all_sizes()
        elif args.sizes:
            try:
                self.sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
            except ValueError:
                raise SystemExit(f"pyrdma-perf: bad --sizes {args.sizes!r}") from None
        elif args.size is not None:
            self.sizes = [args.size]
        else:
            self.sizes = [def_size]
        if self.verb == "atomic":
            self.sizes = [8]
        for s in self.sizes:
            if not 1 <= s <= (1 << 23) * 1024:
                raise SystemExit(f"pyrdma-perf: bad size {s}")
        if self.kind == "lat" and min(self.sizes) < 1:
            raise SystemExit("pyrdma-perf: latency sizes must be >= 1")
        self.iters = args.iters if args.iters is not None else def_iters
        self.duration = args.duration
        if self.duration is None and self.iters < MIN_ITER:
            raise SystemExit(f"pyrdma-perf: at least {MIN_ITER} iterations")
        self.margin = args.margin
        if self.duration is not None:
            if self.margin is None:
                self.margin = int(self.duration // 4)
            if not self.duration > 2 * self.margin:
                raise SystemExit("pyrdma-perf: duration must be more than twice the margin")
        if not 1 <= args.qp_timeout <= 31:
            raise SystemExit(f"pyrdma-perf: -u/--qp-timeout must be within 1..31, got {args.qp_timeout}")
        self.num_qps = args.num_qps if self.kind == "bw" else 1
        self.bidir = args.bidirectional and self.kind == "bw"
        if self.bidir and self.verb == "send":
            raise SystemExit("pyrdma-perf: -b for send_bw is not implemented yet (write/read/atomic are)")
        tx = args.tx_depth if args.tx_depth is not None else (DEF_TX_BW if self.kind == "bw" else DEF_TX_LAT)
        if self.duration is None and tx > self.iters:
            tx = self.iters
        self.tx_depth = max(1, tx)
        self.rx_depth = args.rx_depth
        if self.duration is None and self.rx_depth > self.iters:
            self.rx_depth = self.iters
        self.cq_mod_req = args.cq_mod
        self.post_list = max(1, args.post_list)
        self.inline_req = args.inline_size
        self.atomic_type = args.atomic_type
        self.gbits = args.report_gbits
        self.no_peak = args.no_peak or self.duration is not None or (
            self.duration is None and self.iters * self.num_qps > 20000 and self.kind == "bw")
        self.check = args.check
        self.all = args.all

    def cq_mod_for(self, size):
        cq = DEF_CQ_MOD if self.cq_mod_req is None else self.cq_mod_req
        if self.cq_mod_req is None and size > CQ_MOD_SIZE_LIMIT and not self.all:
            cq = 1
        return max(1, min(cq, self.tx_depth))

    def run_params(self):
        """What the client tells the server (the server adopts these)."""
        return dict(test=self.test, sizes=self.sizes, iters=self.iters, duration=self.duration,
                    margin=self.margin, num_qps=self.num_qps, modes=self.modes, bidir=self.bidir,
                    atomic_type=self.atomic_type, check=self.check, post_list=self.post_list,
                    all=self.all, no_peak=self.no_peak)

    def check_params(self, params):
        """The client's run parameters, checked against the bounds (a UsageError names
        the first one out of bounds); returns them normalised."""
        from pyrdma.errors import UsageError
        from pyrdma.perf import oob

        def fail(why):
            raise UsageError(f"the client's parameters are out of bounds: {why}")

        def integer(key, lo, hi):
            v = params.get(key)
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                fail(f"{key}={v!r} is not an integer within {lo}..{hi}")
            return v

        def flag(key):
            v = params.get(key)
            if not isinstance(v, bool):
                fail(f"{key}={v!r} is not true or false")
            return v

        out = {}
        sizes = params.get("sizes")
        if not isinstance(sizes, list) or not 1 <= len(sizes) <= MAX_SIZES:
            fail(f"sizes must be a list of 1..{MAX_SIZES} sizes")
        top = min(MAX_MSG_SIZE, self.args.max_size)
        for v in sizes:
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= top:
                fail(f"size {v!r} is not within 1..{top} (the server's --max-size is {self.args.max_size})")
        if self.verb == "atomic" and sizes != [8]:
            fail("atomic tests use 8-byte operations")
        out["sizes"] = list(sizes)
        out["iters"] = integer("iters", MIN_ITER, MAX_ITER)
        for key in ("duration", "margin"):
            v = params.get(key)
            if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or
                                  not 0 <= v <= MAX_DURATION):
                fail(f"{key}={v!r} is not a number of seconds within 0..{MAX_DURATION:g}")
            out[key] = v
        if out["duration"] is not None:
            if out["margin"] is None or not out["duration"] > 2 * out["margin"]:
                fail("the duration must be more than twice the margin")
        elif out["margin"] is not None:
            fail("a margin without a duration")
        out["num_qps"] = integer("num_qps", 1, oob.MAX_QPS if self.kind == "bw" else 1)
        modes = params.get("modes")
        if not isinstance(modes, list) or not modes or not all(isinstance(m, str) for m in modes) or \
                len(set(modes)) != len(modes) or not set(modes) <= {"loop", "batched"}:
            fail(f"modes={modes!r} is not a list of loop and/or batched")
        out["modes"] = list(modes)
        for key in ("bidir", "check", "all", "no_peak"):
            out[key] = flag(key)
        if out["bidir"] and (self.kind != "bw" or self.verb == "send"):
            fail(f"-b is not available for {self.test}")
        if params.get("atomic_type") not in ("FETCH_AND_ADD", "CMP_AND_SWAP"):
            fail(f"atomic_type={params.get('atomic_type')!r}")
        out["atomic_type"] = params["atomic_type"]
        out["post_list"] = integer("post_list", 1, MAX_TX)
        return out

    def adopt(self, params):
        params = self.check_params(params)
        for key in ("sizes", "iters", "duration", "margin", "num_qps", "modes", "bidir", "atomic_type",
                    "check", "post_list", "all", "no_peak"):
            setattr(self, key, params[key])
        if self.duration is None:
            self.tx_depth = min(self.tx_depth, self.iters) if self.args.tx_depth is None else self.tx_depth
            self.rx_depth = min(self.rx_depth, self.iters)


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
        peer = _undict(peer_msg.get("report"), peer_msg.get("kind"))
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


def _undict(d, kind):
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


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    from pyrdma.perf import collectives       # nccl-tests' all_reduce_perf, alltoall_perf, ...
    if argv and collectives.canonical(argv[0]) is not None:
        return collectives.main(argv)
    args = build_parser().parse_intermixed_args(argv)
    cfg = Config(args)
    if args.rdma_cm:
        from pyrdma.perf.rdmacm import RdmaCmSide
        side = RdmaCmSide(cfg)
    elif args.perftest_compat:
        from pyrdma.perf.compat import PerftestSide
        side = PerftestSide(cfg)
    else:
        side = Side(cfg)
    try:
        side.open()
        side.print_banner()
        side.run_all()
        return side.finish()
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        side.fail(exc)
        print(f"pyrdma-perf: {type(exc).__name__}: {exc}", file=sys.stderr)
        if os.environ.get("PYRDMA_PERF_DEBUG"):
            raise
        return 1
    finally:
        side.close()


if __name__ == "__main__":
    sys.exit(main())
