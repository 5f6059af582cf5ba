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
import os
import sys

from pyrdma.perf import stats
from pyrdma.perf.side import Side

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
