"""pyrdma over TCP against its floors, on this host, in the same run: sockperf's ping-pong (latency)
and iperf3 (bandwidth), as perftest is the floor over RDMA.

    python3 bench/tcp_bench.py [--sizes 16,4096,32768] [--stream-bytes 8388608] [--seconds 2] [--json OUT]

Latency: two ranks over TCP on 127.0.0.1 send a message back and forth with the blocking
``send``/``recv`` (the one-call path); half the median round trip, against sockperf ping-pong's
median (which reports half a round trip too) with the same message size (14 to 65000 bytes, what
sockperf's TCP ping-pong takes). Bandwidth: rank 0 sends
``--stream-bytes`` messages to rank 1 for ``--seconds``, back to back; bytes per second received,
against iperf3's single stream: once through the sockets alone (PYRDMA_SOCKET_CMA=0: the socket
link's own speed) and once as by default, where ranks of one machine copy large messages out of
each other's memory (process_vm_readv: no socket floor applies; its row says so). Prints the table (ratio: pyrdma's latency / sockperf's, iperf3's
bandwidth / pyrdma's: above 1, pyrdma is slower) and writes the figures as JSON.
Needs sockperf and iperf3 (Debian's packages; scripts/setup.sh installs them).
"""
import argparse
import json
import multiprocessing
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)        # pyrdma from this checkout, in the launcher and the ranks alike


def _rank(rank, port, sizes, stream_bytes, seconds, results, cma):
    os.environ["PYRDMA_SOCKET_CMA"] = cma
    import numpy as np
    from pyrdma.collectives import Communicator
    with Communicator(rank, 2, f"127.0.0.1:{port}", transport="tcp", timeout=60) as comm:
        peer = 1 - rank
        out = {}
        for size in sizes:
            buf = np.zeros(size, np.uint8)
            rounds = 2000
            times = []
            for i in range(rounds + 50):
                t = time.perf_counter()
                if rank == 0:
                    comm.send(buf, peer)
                    comm.recv(buf, peer)
                else:
                    comm.recv(buf, peer)
                    comm.send(buf, peer)
                if i >= 50:
                    times.append(time.perf_counter() - t)
            out[size] = statistics.median(times) / 2 * 1e6
        buf = np.zeros(stream_bytes, np.uint8)
        go = np.zeros(1, np.int64)
        comm.barrier()
        start = time.perf_counter()
        sent = 0
        while True:
            # rank 0 says whether another message follows, so both stop together
            go[0] = time.perf_counter() - start < seconds if rank == 0 else 0
            comm.broadcast(go, root=0)
            if not go[0]:
                break
            if rank == 0:
                comm.send(buf, peer)
            else:
                comm.recv(buf, peer)
            sent += stream_bytes
        comm.barrier()
        out["bandwidth"] = sent / (time.perf_counter() - start)
        out["by_address"] = comm.transport.engine.reads > 0         # (read by this rank)
        results[rank] = out


def pyrdma_figures(sizes, stream_bytes, seconds, cma="1"):
    from pyrdma.testing import free_port
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        port = free_port()
        procs = [ctx.Process(target=_rank, args=(r, port, sizes, stream_bytes, seconds, results, cma)) for r in range(2)]
        for p in procs:
            p.start()
        try:
            for p in procs:
                p.join(120 + 2 * seconds)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
        if 0 not in results:
            raise SystemExit("tcp_bench: the pyrdma ranks failed")
        return dict(results[0], by_address=results[1]["by_address"])     # (the receiver reads)


def _server(cmd):
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    return proc


def sockperf_latency(size, seconds):
    """sockperf ping-pong's median latency (half a round trip, us) over TCP on 127.0.0.1."""
    from pyrdma.testing import free_port
    port = str(free_port())
    server = _server(["sockperf", "server", "--tcp", "-i", "127.0.0.1", "-p", port])
    try:
        run = subprocess.run(["sockperf", "ping-pong", "--tcp", "-i", "127.0.0.1", "-p", port, "-m", str(size),
                              "-t", str(seconds)], capture_output=True, text=True, timeout=60 + seconds)
    finally:
        server.kill()
        server.wait()
    match = re.search(r"percentile 50\.000 =\s*([0-9.]+)", run.stdout + run.stderr)
    if not match:
        raise SystemExit(f"tcp_bench: sockperf gave no median:\n{run.stdout}{run.stderr}")
    return float(match.group(1))


def iperf3_bandwidth(seconds):
    """iperf3's single-stream bandwidth (bytes per second received) over TCP on 127.0.0.1."""
    from pyrdma.testing import free_port
    port = str(free_port())
    server = _server(["iperf3", "-s", "-1", "-p", port])
    try:
        run = subprocess.run(["iperf3", "-c", "127.0.0.1", "-p", port, "-t", str(seconds), "-J"],
                             capture_output=True, text=True, timeout=60 + seconds)
    finally:
        server.kill()
        server.wait()
    try:
        return json.loads(run.stdout)["end"]["sum_received"]["bits_per_second"] / 8
    except (ValueError, KeyError) as exc:
        raise SystemExit(f"tcp_bench: iperf3 gave no result ({exc}):\n{run.stdout[-2000:]}{run.stderr}") from None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="16,4096,32768")
    ap.add_argument("--stream-bytes", type=int, default=8 << 20)
    ap.add_argument("--seconds", type=int, default=2)          # whole seconds: sockperf and iperf3 take no less
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    missing = [tool for tool in ("sockperf", "iperf3") if shutil.which(tool) is None]
    if missing:
        raise SystemExit(f"tcp_bench: {' and '.join(missing)} not found (apt-get install sockperf iperf3)")
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.seconds < 1:
        raise SystemExit(f"tcp_bench: --seconds must be at least 1, got {args.seconds}")
    if any(not 14 <= size <= 65000 for size in sizes):
        raise SystemExit(f"tcp_bench: --sizes must be within 14..65000 bytes (sockperf's), got {args.sizes}")
    ours = pyrdma_figures(sizes, args.stream_bytes, args.seconds)
    rows = [dict(test="latency", bytes=size, pyrdma_us=ours[size], sockperf_us=sockperf_latency(size, args.seconds),
                 ) for size in sizes]
    for row in rows:
        row["ratio"] = row["pyrdma_us"] / row["sockperf_us"]
    sockets = pyrdma_figures([], args.stream_bytes, args.seconds, cma="0")
    iperf3 = iperf3_bandwidth(args.seconds)
    bws = [dict(test="bandwidth", bytes=args.stream_bytes, path="sockets", pyrdma_Bps=sockets["bandwidth"],
                iperf3_Bps=iperf3, ratio=iperf3 / sockets["bandwidth"])]
    if ours["by_address"]:
        bws.append(dict(test="bandwidth", bytes=args.stream_bytes, path="by address", pyrdma_Bps=ours["bandwidth"],
                        iperf3_Bps=iperf3, ratio=iperf3 / ours["bandwidth"]))
    print(f"{'test':10s} {'bytes':>9s} {'pyrdma':>12s} {'floor':>12s} {'ratio':>7s}")
    for row in rows:
        print(f"{'latency':10s} {row['bytes']:9d} {row['pyrdma_us']:9.1f} us {row['sockperf_us']:9.1f} us "
              f"{row['ratio']:7.2f}   (sockperf ping-pong)")
    for bw in bws:
        how = "iperf3, one stream" if bw["path"] == "sockets" else \
            "by address (process_vm_readv), the default here: iperf3 for scale only"
        print(f"{'bandwidth':10s} {bw['bytes']:9d} {bw['pyrdma_Bps'] / 1e9:7.2f} GB/s {bw['iperf3_Bps'] / 1e9:7.2f} GB/s "
              f"{bw['ratio']:7.2f}   ({how})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rows=rows + bws), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
