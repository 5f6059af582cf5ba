#!/usr/bin/env python3
"""perftest vs pyrdma-perf, side by side, on one RDMA device (Soft-RoCE rxe0 in the test VM).

    python3 -m pyrdma.testing.vm --rwdir build/bench -- python3 -m pyrdma.perf.side_by_side --out build/bench

(bench/side_by_side.py runs the same; scripts/bench.sh runs it in the VM.)

For every test (write_bw ... atomic_lat) and size it runs perftest's binary (server + client on
this host, ``-d DEV -x GID``, distinct TCP ports, with timeouts) and pyrdma-perf (one connection
per test covering the whole size sweep, ``--mode both``), parses both outputs with
pyrdma.perf.parse, and prints a table of ours/perftest ratios. For write_bw and read_bw it also
runs our client against perftest's own server (``--perftest-compat``, mode "interop" in the
table), so the bench talks to a program we did not write (``--no-interop`` skips it):

    BW tests:       BW average and MsgRate (higher is better; ratio > 1 means we are faster)
    latency tests:  t_typical and the 99% percentile (lower is better; ratio < 1 means faster)

The whole sweep runs ``--rounds`` times (default 3), pyrdma and perftest one after the other in
each round (pyrdma first in odd rounds, perftest first in even ones). Each ratio is taken within a
round and the table shows the median of the rounds' ratios with their range, as
pyrdma.perf.allreduce_bench does: the emulated device drifts by 10-25% over minutes, so a single run
flips verdicts from boot to boot. With write_lat, each round also runs pyrdma.perf.lat_breakdown,
and the end prints per-op latency with where a Python iteration's time goes (post, poll, Python).

It writes ``side_by_side.json`` (every parsed row, the ratios, the environment) and PNG plots
(``bw_vs_size.png``, ``latency.png``) to --out. Iteration counts default low: the VM is emulated
and 10-50x slower than hardware.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time

from pyrdma.errors import RDMAError
from pyrdma.perf import lat_breakdown
from pyrdma.perf.parse import parse_output
from pyrdma.testing import PERFTEST_CLOCK_FAILED as CLOCK_CALIBRATION_FAILED
from pyrdma.testing import counting_rc_resends, tcp_listening

BW_TESTS = ["write_bw", "read_bw", "send_bw", "atomic_bw"]
LAT_TESTS = ["write_lat", "read_lat", "send_lat", "atomic_lat"]
ALL_TESTS = ["write_bw", "write_lat", "read_bw", "read_lat", "send_bw", "send_lat", "atomic_bw", "atomic_lat"]
DEF_BW_SIZES = [64, 4096, 65536, 1048576]
DEF_LAT_SIZES = [2, 64, 4096]
MODES = ["loop", "batched"]
PERFTEST_ATTEMPTS = 3
# Our batched client against perftest's server (--perftest-compat): the bench talking to a program
# we did not write; its rows are compared with perftest's own client like the other modes.
INTEROP = "interop"
INTEROP_TESTS = ["write_bw", "read_bw"]

# The targets this project reports against (ratios ours/perftest).
TARGETS = [
    dict(name="BW average >= 0.97x perftest at >= 64 KiB (batched)", tests=["write_bw", "read_bw", "send_bw"],
         mode="batched", metric="bw_avg", min_size=65536, op=">=", value=0.97),
    dict(name="write_lat t_typical <= 1.25x perftest at 2 B (loop)", tests=["write_lat"], mode="loop",
         metric="t_typical", sizes=[2], op="<=", value=1.25),
    dict(name="write_lat and send_lat t_typical <= 2.0x perftest at 2 B (loop: post, poll_into(check=True))",
         tests=["write_lat", "send_lat"], mode="loop", metric="t_typical", sizes=[2], op="<=", value=2.0),
    dict(name="MsgRate >= 0.7x perftest at 64 B (batched)", tests=["write_bw", "read_bw", "send_bw"],
         mode="batched", metric="msg_rate", sizes=[64], op=">=", value=0.7),
]


def _kill(proc):
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def _pin(cpu):
    """preexec_fn pinning a child to one CPU. Server and client spin-poll; on a 2-CPU VM two
    spinners sharing a CPU ping-pong at the scheduler tick (4 ms), so each gets its own CPU, for
    perftest and pyrdma-perf alike."""
    if cpu is None or not hasattr(os, "sched_setaffinity"):
        return None
    return lambda: os.sched_setaffinity(0, {cpu})


def _cpus():
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:
        return None, None
    return (cpus[0], cpus[1]) if len(cpus) >= 2 else (None, None)


def run_pair(server_cmd, client_cmd, port, timeout, log=None):
    """Run server then client; returns (rc_server, out_server, rc_client, out_client). Both are
    always gone when this returns."""
    cpu_s, cpu_c = _cpus()
    srv = subprocess.Popen(server_cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True, preexec_fn=_pin(cpu_s))
    cli = None
    try:
        deadline = time.monotonic() + min(timeout, 60)
        while not tcp_listening(port):
            if srv.poll() is not None or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        cli = subprocess.Popen(client_cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True, preexec_fn=_pin(cpu_c))
        try:
            out_c, _ = cli.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill(cli)
            out_c = (cli.stdout.read() if cli.stdout else "") + f"\n[timed out after {timeout} s]\n"
        try:
            out_s, _ = srv.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            _kill(srv)
            out_s = (srv.stdout.read() if srv.stdout else "") + "\n[server killed]\n"
        return srv.returncode, out_s, cli.returncode, out_c
    finally:
        if cli is not None:
            _kill(cli)
        _kill(srv)
        if log:
            with open(log, "a") as fh:
                fh.write(f"$ {' '.join(server_cmd)}  # cpu {cpu_s}\n$ {' '.join(client_cmd)}  # cpu {cpu_c}\n")


class Bench:
    def __init__(self, args):
        self.args = args
        self.port = args.port_base
        self.rows = []          # dict(test, size, tool, mode, report, round)
        self.resends = []       # dict(tool, test, sizes, round, <counter>: count) per run, where the device counts them
        self.failures = []
        self.round = 1
        self.breakdowns = []    # lat_breakdown.measure() of each round (us)
        os.makedirs(args.out, exist_ok=True)
        self.log = os.path.join(args.out, "commands.log")
        open(self.log, "w").close()
        self.raw_dir = os.path.join(args.out, "raw")
        os.makedirs(self.raw_dir, exist_ok=True)

    def next_port(self):
        self.port += 1
        return self.port

    def iters_for(self, test):
        return self.args.iters_lat if test.endswith("_lat") else self.args.iters_bw

    def sizes_for(self, test):
        if test.startswith("atomic"):
            return [8]
        return self.args.lat_sizes if test.endswith("_lat") else self.args.bw_sizes

    def perftest(self, test, size):
        a = self.args
        exe = shutil.which(f"ib_{test}")
        if exe is None:
            self.failures.append(f"perftest binary ib_{test} not found")
            return
        for attempt in range(PERFTEST_ATTEMPTS):
            port = self.next_port()
            base = [exe, "-d", a.dev, "-x", str(a.gid), "-n", str(self.iters_for(test)), "-p", str(port), "-F"]
            if not test.startswith("atomic"):
                base += ["-s", str(size)]
            rc_s, out_s, rc_c, out_c = run_pair(base, base + [a.host], port, a.timeout, self.log)
            self._save(f"perftest_{test}_{size}", out_s, out_c)
            # Under emulation perftest's TSC calibration can fail ("Correlation coefficient r^2 <
            # 0.9"): it then divides by a 0 MHz clock and prints inf for every latency. Such rows
            # are no measurement: run again.
            rows = [r for r in parse_output(out_c).rows_for(None) if math.isfinite(getattr(r, "t_typical", 0.0))]
            if (rc_c == 0 and rows) or CLOCK_CALIBRATION_FAILED not in out_c:
                break
        if rc_c != 0 or not rows:
            why = (f", its clock calibration failed {PERFTEST_ATTEMPTS} times" if CLOCK_CALIBRATION_FAILED in out_c
                   else "")
            self.failures.append(f"perftest {test} {size}B: rc={rc_c}, {len(rows)} rows{why}")
            return
        for r in rows:
            self.rows.append(dict(test=test, size=r.size, tool="perftest", mode="-", report=r.to_dict(),
                                  round=self.round))

    def ours(self, test, sizes):
        a = self.args
        port = self.next_port()
        json_path = os.path.join(self.raw_dir, f"r{self.round}_pyrdma_{test}.json")
        base = [sys.executable, "-m", "pyrdma.perf", test, "-d", a.dev, "-x", str(a.gid),
                "-n", str(self.iters_for(test)), "-p", str(port), "--mode", "both",
                "--sizes", ",".join(str(s) for s in sizes), "-l", str(a.post_list)]
        timeout = a.timeout * len(sizes) * 2
        rc_s, out_s, rc_c, out_c = run_pair(base, base + ["--json", json_path, a.host], port, timeout, self.log)
        self._save(f"pyrdma_{test}", out_s, out_c)
        run = parse_output(out_c)
        if rc_c != 0 or not run.rows:
            self.failures.append(f"pyrdma-perf {test}: rc={rc_c}, {len(run.rows)} rows")
        for r, mode in zip(run.rows, run.modes):
            self.rows.append(dict(test=test, size=r.size, tool="pyrdma", mode=mode, report=r.to_dict(),
                                  round=self.round))

    def interop(self, test, sizes):
        """Our client (batched) against perftest's own server, in perftest's TCP exchange: the
        perftest server prints the report our client sends, which must match ours."""
        a = self.args
        exe = shutil.which(f"ib_{test}")
        if exe is None:
            return
        port = self.next_port()
        server = [exe, "-d", a.dev, "-x", str(a.gid), "-p", str(port), "-F", "-s", str(max(sizes))]
        client = [sys.executable, "-m", "pyrdma.perf", test, "--perftest-compat", "-d", a.dev, "-x", str(a.gid),
                  "-n", str(self.iters_for(test)), "-p", str(port), "--mode", "batched",
                  "--sizes", ",".join(str(s) for s in sizes), "-l", str(a.post_list), a.host]
        rc_s, out_s, rc_c, out_c = run_pair(server, client, port, a.timeout * len(sizes), self.log)
        self._save(f"interop_{test}", out_s, out_c)
        mine = parse_output(out_c).rows_for("batched")
        printed = parse_output(out_s).rows_for(None)
        if rc_c != 0 or rc_s != 0 or not mine or not printed:
            self.failures.append(f"pyrdma-perf --perftest-compat {test}: rc client {rc_c}, server {rc_s}, "
                                 f"{len(mine)} rows, perftest printed {len(printed)}")
            return
        if abs(printed[-1].bw_avg - mine[-1].bw_avg) > 0.01:
            self.failures.append(f"interop {test}: perftest's server printed BW {printed[-1].bw_avg}, "
                                 f"our client measured {mine[-1].bw_avg}")
        for r in mine:
            self.rows.append(dict(test=test, size=r.size, tool="pyrdma", mode=INTEROP, report=r.to_dict(),
                                  round=self.round))

    def _save(self, name, out_s, out_c):
        name = f"r{self.round}_{name}"
        with open(os.path.join(self.raw_dir, name + ".server.txt"), "w") as fh:
            fh.write(out_s or "")
        with open(os.path.join(self.raw_dir, name + ".client.txt"), "w") as fh:
            fh.write(out_c or "")

    def run(self):
        """``--rounds`` rounds; in each, every test by both tools, one after the other (pyrdma first in
        odd rounds, perftest first in even ones), so each ratio compares runs minutes apart at most
        while the emulated device drifts by more than that over a whole sweep."""
        for self.round in range(1, getattr(self.args, "rounds", 1) + 1):
            if getattr(self.args, "rounds", 1) > 1:
                print(f"=== round {self.round} of {self.args.rounds}", flush=True)
            for test in self.args.tests:
                self.run_test(test)
            if getattr(self.args, "breakdown", False) and "write_lat" in self.args.tests:
                self.measure_breakdown()

    def run_test(self, test):
        sizes = self.sizes_for(test)
        print(f"== {test}: sizes {sizes}", flush=True)
        def ours():
            self.counting_resends("pyrdma", test, sizes, self.ours, test, sizes)

        def perftest():
            for size in sizes:
                self.counting_resends("perftest", test, [size], self.perftest, test, size)
        for run in ((ours, perftest) if self.round % 2 else (perftest, ours)):
            run()
        if self.args.interop and test in INTEROP_TESTS:
            self.counting_resends(INTEROP, test, sizes, self.interop, test, sizes)
        runs = [r for r in self.resends if r["test"] == test and r["completer_retry_err"]
                and r.get("round", 1) == self.round]
        if runs:
            print("   RC retries (ACK timeouts; they slow the run that has them): " +
                  ", ".join(f"{r['tool']} {','.join(map(str, r['sizes']))}B: {r['completer_retry_err']}"
                            for r in runs), flush=True)

    def measure_breakdown(self):
        """Where one Python write-latency iteration's time goes (pyrdma.perf.lat_breakdown), this round."""
        try:
            self.breakdowns.append(lat_breakdown.measure(self.args.dev, self.args.iters_lat * 4, 2))
        except RDMAError as exc:
            self.failures.append(f"latency breakdown (round {self.round}): {exc}")

    def counting_resends(self, tool, test, sizes, run, *args):
        """run(*args), noting the device's RC resend counters over it (both sides share the device)."""
        with counting_rc_resends(self.args.dev) as resends:
            run(*args)
        if resends:
            self.resends.append(dict(tool=tool, test=test, sizes=list(sizes), round=self.round, **resends))

    # -- analysis --------------------------------------------------------------------------------
    def reports(self, test, size, tool, mode):
        """{round: report} of one (test, size, tool, mode)."""
        return {row.get("round", 1): row["report"] for row in self.rows
                if row["test"] == test and row["size"] == size and row["tool"] == tool and row["mode"] == mode}

    def find(self, test, size, tool, mode):
        """The report of (test, size, tool, mode), each figure the median over the rounds; None if it never ran."""
        reports = list(self.reports(test, size, tool, mode).values())
        if not reports:
            return None
        return {k: statistics.median(r[k] for r in reports) if isinstance(v, (int, float)) else v
                for k, v in reports[0].items() if all(k in r for r in reports)}

    def comparisons(self):
        out = []
        for test in self.args.tests:
            metrics = ["bw_avg", "msg_rate"] if test.endswith("_bw") else ["t_typical", "p99"]
            for size in self.sizes_for(test):
                refs = self.reports(test, size, "perftest", "-")
                for mode in MODES + [INTEROP]:
                    mines = self.reports(test, size, "pyrdma", mode)
                    if mode == INTEROP and not mines:
                        continue
                    for metric in metrics:
                        # each round's ratio compares runs of that round; the verdict is their median
                        ratios = [mines[r][metric] / refs[r][metric] for r in sorted(refs)
                                  if r in mines and refs[r].get(metric) and mines[r].get(metric) is not None]
                        p = _median([r.get(metric) for r in refs.values()])
                        o = _median([r.get(metric) for r in mines.values()])
                        out.append(dict(test=test, size=size, mode=mode, metric=metric, perftest=p, ours=o,
                                        ratio=_median(ratios), ratio_min=min(ratios) if ratios else None,
                                        ratio_max=max(ratios) if ratios else None, rounds=len(ratios)))
        return out

    def targets(self, comps):
        results = []
        for t in TARGETS:
            picked = [c for c in comps if c["test"] in t["tests"] and c["mode"] == t["mode"]
                      and c["metric"] == t["metric"] and c["ratio"] is not None
                      and (c["size"] in t["sizes"] if "sizes" in t else c["size"] >= t.get("min_size", 0))]
            if not picked:
                results.append(dict(t, status="NO DATA", worst=None, cases=[]))
                continue
            ratios = [c["ratio"] for c in picked]
            worst = min(ratios) if t["op"] == ">=" else max(ratios)
            ok = worst >= t["value"] if t["op"] == ">=" else worst <= t["value"]
            results.append(dict(t, status="MET" if ok else "MISSED", worst=worst,
                                cases=[(c["test"], c["size"], round(c["ratio"], 3)) for c in picked]))
        return results


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def print_table(comps, targets):
    rounds = max((c.get("rounds", 1) for c in comps), default=1)
    print()
    print(f"Medians over {rounds} round(s); ours/pt is the median of the rounds' ratios, range their spread.")
    print(f"{'test':<11} {'bytes':>8} {'mode':<8} {'metric':<10} {'perftest':>12} {'pyrdma':>12} {'ours/pt':>8} "
          f"{'range':>13}")
    print("-" * 89)
    for c in comps:
        fmt = lambda v: "-" if v is None else (f"{v:.6f}" if c["metric"] == "msg_rate" else f"{v:.2f}")
        ratio = "-" if c["ratio"] is None else f"{c['ratio']:.3f}"
        spread = "-" if c.get("ratio_min") is None else f"{c['ratio_min']:.3f}-{c['ratio_max']:.3f}"
        print(f"{c['test']:<11} {c['size']:>8} {c['mode']:<8} {c['metric']:<10} {fmt(c['perftest']):>12} "
              f"{fmt(c['ours']):>12} {ratio:>8} {spread:>13}")
    print()
    print("Targets (ours/perftest, median of the rounds):")
    for t in targets:
        worst = "-" if t["worst"] is None else f"{t['worst']:.3f}"
        print(f"  [{t['status']}] {t['name']}: worst ratio {worst}  {t['cases']}")


def print_latency(bench, comps):
    """Per-op latency of the latency tests (loop mode against perftest, medians of the rounds) and,
    with write_lat, where one Python iteration's time goes beyond the C path perftest runs."""
    rows = [c for c in comps if c["metric"] == "t_typical" and c["mode"] == "loop"
            and c["perftest"] is not None and c["ours"] is not None]
    if rows:
        print("\nPer-op latency, t_typical [usec], medians of the rounds (pyrdma: loop mode, one Python call per op):")
        for c in rows:
            spread = "" if c.get("ratio_min") is None else f", range {c['ratio_min']:.3f}-{c['ratio_max']:.3f}"
            print(f"  {c['test']:<11} {c['size']:>6} B  perftest {c['perftest']:8.2f}  pyrdma {c['ours']:8.2f}  "
                  f"{c['ours'] - c['perftest']:+8.2f} us ({c['ratio']:.3f}x{spread})")
    if not bench.breakdowns:
        return
    b = {k: statistics.median(d[k] for d in bench.breakdowns) for k in bench.breakdowns[0]}
    print(f"\nWhere a Python write iteration's time goes [usec] (pyrdma.perf.lat_breakdown: one process, RC QPs "
          f"looped back, 2 B inline WRITE; medians of {len(bench.breakdowns)} round(s)):")
    print(f"  post      qp.post_write(...) from Python                      {b['post']:8.2f}")
    print(f"  poll      cq.poll_into(...) from Python until the completion  {b['poll']:8.2f}")
    print(f"  C path    post_send_list + poll_wait (what perftest's loop does) {b['batched_op']:5.2f}")
    print(f"  API       post + poll from Python beyond the C path           {b['python_op'] - b['batched_op']:8.2f}")
    print(f"  Python    write_lat's own loop bookkeeping (no verbs call)    {b['bookkeeping']:8.2f}")
    print(f"  (an empty Python loop iteration: {b['empty']:.2f})")
    lat = next((c for c in rows if c["test"] == "write_lat" and c["size"] == 2), None)
    if lat is not None:
        print(f"  write_lat 2 B is {lat['ours'] - lat['perftest']:+.2f} us per op beyond perftest; API + Python "
              f"account for {b['python_op'] - b['batched_op'] + b['bookkeeping']:.2f} us of one iteration")


def plot(bench, out):
    os.environ.setdefault("MPLCONFIGDIR", os.path.join(out, ".mplconfig"))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots", file=sys.stderr)
        return []
    files = []
    bw_tests = [t for t in bench.args.tests if t.endswith("_bw") and not t.startswith("atomic")]
    if bw_tests:
        fig, axes = plt.subplots(1, len(bw_tests), figsize=(5 * len(bw_tests), 4), squeeze=False)
        for ax, test in zip(axes[0], bw_tests):
            sizes = bench.sizes_for(test)
            for tool, mode, style in (("perftest", "-", "k-o"), ("pyrdma", "loop", "C0--s"),
                                      ("pyrdma", "batched", "C1-^"), ("pyrdma", INTEROP, "C2:x")):
                ys = [(bench.find(test, s, tool, mode) or {}).get("bw_avg") for s in sizes]
                pts = [(s, y) for s, y in zip(sizes, ys) if y is not None]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], style,
                            label=tool if tool == "perftest" else
                            ("pyrdma batched vs perftest server" if mode == INTEROP else f"pyrdma {mode}"))
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("message size [bytes]")
            ax.set_ylabel("BW average [MB/sec, 2^20]")
            ax.set_title(test)
            ax.grid(True, alpha=0.3)
            ax.legend()
        fig.tight_layout()
        path = os.path.join(out, "bw_vs_size.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path)
    lat_tests = [t for t in bench.args.tests if t.endswith("_lat")]
    if lat_tests:
        fig, axes = plt.subplots(1, len(lat_tests), figsize=(5 * len(lat_tests), 4), squeeze=False)
        for ax, test in zip(axes[0], lat_tests):
            sizes = bench.sizes_for(test)
            labels, typ, p99 = [], [], []
            for s in sizes:
                for tool, mode in (("perftest", "-"), ("pyrdma", "loop"), ("pyrdma", "batched")):
                    r = bench.find(test, s, tool, mode) or {}
                    labels.append(f"{s}B\n{'pt' if tool == 'perftest' else mode}")
                    typ.append(r.get("t_typical") or 0)
                    p99.append(r.get("p99") or 0)
            xs = range(len(labels))
            ax.bar([x - 0.2 for x in xs], typ, width=0.4, label="t_typical")
            ax.bar([x + 0.2 for x in xs], p99, width=0.4, label="99%")
            ax.set_xticks(list(xs))
            ax.set_xticklabels(labels, fontsize=7)
            ax.set_ylabel("usec")
            ax.set_yscale("log")
            ax.set_title(test)
            ax.legend()
        fig.tight_layout()
        path = os.path.join(out, "latency.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path)
    return files


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join("build", "bench"))
    p.add_argument("--dev", default="rxe0")
    p.add_argument("--gid", type=int, default=1)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--tests", default=",".join(ALL_TESTS))
    p.add_argument("--bw-sizes", default=",".join(map(str, DEF_BW_SIZES)))
    p.add_argument("--lat-sizes", default=",".join(map(str, DEF_LAT_SIZES)))
    p.add_argument("--iters-bw", type=int, default=500)
    p.add_argument("--iters-lat", type=int, default=500)
    p.add_argument("--post-list", type=int, default=32)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per perftest run")
    p.add_argument("--port-base", type=int, default=19000)
    p.add_argument("--no-interop", dest="interop", action="store_false",
                   help="skip our client against perftest's server (write_bw, read_bw)")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of every test by both tools; the ratios are the medians of the rounds' ratios")
    p.add_argument("--no-breakdown", dest="breakdown", action="store_false",
                   help="skip the per-round latency breakdown (pyrdma.perf.lat_breakdown; needs write_lat)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    args.tests = [t.strip().replace("ib_", "") for t in args.tests.split(",") if t.strip()]
    args.bw_sizes = [int(x) for x in args.bw_sizes.split(",")]
    args.lat_sizes = [int(x) for x in args.lat_sizes.split(",")]
    t0 = time.time()
    bench = Bench(args)
    bench.run()
    comps = bench.comparisons()
    targets = bench.targets(comps)
    print_table(comps, targets)
    print_latency(bench, comps)
    plots = plot(bench, args.out)
    perftest_version = ""
    try:
        perftest_version = subprocess.run(["ib_write_bw", "--version"], capture_output=True, text=True,
                                          timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    doc = dict(env=dict(kernel=platform.release(), python=platform.python_version(), device=args.dev,
                        gid_index=args.gid, perftest=perftest_version, cpus=os.cpu_count(),
                        seconds=round(time.time() - t0, 1)),
               params=dict(vars(args)), rows=bench.rows, comparisons=comps, targets=targets,
               failures=bench.failures, plots=plots, rc_resends=bench.resends, lat_breakdown=bench.breakdowns)
    with open(os.path.join(args.out, "side_by_side.json"), "w") as fh:
        json.dump(doc, fh, indent=1, default=str)
    if bench.failures:
        print("\nFailures:\n  " + "\n  ".join(bench.failures))
    print(f"\nwrote {args.out}/side_by_side.json" + "".join(f", {f}" for f in plots))
    return 1 if bench.failures else 0


if __name__ == "__main__":
    sys.exit(main())
