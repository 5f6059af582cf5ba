#!/usr/bin/env python3
"""GPU benchmarks for pyrdma.cuda (needs CuPy and a CUDA GPU).

Three tables, then all rows as one JSON document:

1. reduce: ``pyrdma.cuda.reduce_into(dst, src, op)`` against a device-to-device copy of the same
   bytes. A reduction reads two buffers and writes one (3 x bytes of memory traffic), a copy reads
   one and writes one (2 x bytes); both bandwidths are shown, and ``vs_copy`` is copy time divided
   by reduction time (1.0 = a reduction costs a copy; ~0.67 = memory-bound at the copy's bandwidth),
   ``bw/copy`` the reduction's memory bandwidth over the copy's (issue 5's target: >= 0.85 from
   --target-bytes on). Times are per call with --repeat calls enqueued back to back (throughput);
   ``1call`` is one call alone, Python's launch overhead included.
2. staging: ``HostStagingPipeline.run`` (device -> pinned host -> host_op -> device, chunked and
   overlapped) against the unpipelined ``cudaMemcpy`` round trip of the same bytes (one D2H into
   pinned memory, the same host_op on all of it, one H2D). Bandwidth is bytes / time;
   ``vs_memcpy`` > 1 means the pipeline wins.
3. collective: ``Communicator.allreduce`` of a CuPy array, staged and direct (gpu_path), against a
   numpy array of the same bytes, --ranks processes on this GPU (TCP unless an RDMA device is up).

Times are medians over --iters runs after --warmup runs (CUDA events for kernels, wall time with a
final stream synchronize for the staging path, since it involves the host).

    python bench/gpu_reduce_bench.py                        # defaults: 1 KiB .. 256 MiB
    python bench/gpu_reduce_bench.py --dtypes float32 --ops sum --json build/bench/gpu_reduce.json
"""
import argparse
import json
import statistics
import sys
import time

import numpy as np


def parse_size(text):
    text = text.strip().upper()
    for suffix, mult in (("KIB", 1 << 10), ("MIB", 1 << 20), ("GIB", 1 << 30), ("K", 1 << 10), ("M", 1 << 20),
                         ("G", 1 << 30), ("B", 1)):
        if text.endswith(suffix):
            return int(float(text[:-len(suffix)]) * mult)
    return int(text)


def size_range(lo, hi, factor):
    sizes, n = [], lo
    while n <= hi:
        sizes.append(n)
        n *= factor
    return sizes


def human(n):
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:g}{unit}"
    return f"{n}B"


def time_events(cp, fn, iters, warmup, stream, repeat=1):
    """Median milliseconds per fn() call, timed with CUDA events around ``repeat`` calls enqueued back
    to back on stream (with repeat > 1 the GPU stays busy while Python launches the next call, so
    this is throughput; with 1 it includes the launch overhead of one call)."""
    for _ in range(warmup):
        fn()
    stream.synchronize()
    times = []
    for _ in range(iters):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        for _ in range(repeat):
            fn()
        stop.record(stream)
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) / repeat)
    return statistics.median(times)


def time_wall(fn, iters, warmup, sync):
    for _ in range(warmup):
        fn()
        sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bench_reduce(cp, gpu, args):
    rows = []
    stream = cp.cuda.Stream(non_blocking=True)
    for dtype in args.dtypes:
        itemsize = np.dtype(dtype).itemsize
        for nbytes in args.sizes:
            count = max(1, nbytes // itemsize)
            nbytes = count * itemsize
            with stream:
                dst = cp.ones(count, dtype)
                src = cp.ones(count, dtype)
                copy_dst = cp.empty_like(dst)
            copy_ms = time_events(cp, lambda: copy_dst.data.copy_from_device_async(src.data, nbytes, stream),
                                  args.iters, args.warmup, stream, args.repeat)
            for op in args.ops:
                # repeated sums/products drift or wrap; the kernel's time does not depend on the values
                call = lambda op=op: gpu.reduce_into(dst, src, op, stream=stream)   # noqa: E731
                ms = time_events(cp, call, args.iters, args.warmup, stream, args.repeat)
                one_ms = time_events(cp, call, args.iters, args.warmup, stream, 1)
                rows.append({"table": "reduce", "bytes": nbytes, "count": count, "dtype": dtype, "op": op,
                             "reduce_us": ms * 1e3, "copy_us": copy_ms * 1e3, "one_call_us": one_ms * 1e3,
                             "reduce_GBps": 3 * nbytes / (ms * 1e-3) / 1e9,
                             "copy_GBps": 2 * nbytes / (copy_ms * 1e-3) / 1e9,
                             "vs_copy": copy_ms / ms,
                             "bw_vs_copy": (3 * nbytes / ms) / (2 * nbytes / copy_ms)})
            dst = src = copy_dst = None     # free before the next size (a del would leave the closures' names unbound)
    return rows


def bench_staging(cp, gpu, args):
    rows = []
    stream = cp.cuda.Stream(non_blocking=True)
    host_ops = {"noop": lambda chunk: None, "add": lambda chunk: np.add(chunk, chunk, out=chunk)}
    host_op = host_ops[args.host_op]
    rt = cp.cuda.runtime
    with gpu.HostStagingPipeline(args.chunk_bytes, args.depth) as pipe:
        for nbytes in args.sizes:
            count = max(1, nbytes // 4)
            nbytes = count * 4
            with stream:
                x = cp.ones(count, cp.float32)
            pinned_mem = cp.cuda.alloc_pinned_memory(nbytes)
            pinned = np.frombuffer(pinned_mem, np.float32, count)

            def staged():
                pipe.run(x, host_op, stream=stream)

            def memcpy_round_trip():
                rt.memcpyAsync(pinned.ctypes.data, x.data.ptr, nbytes, rt.memcpyDeviceToHost, stream.ptr)
                stream.synchronize()
                host_op(pinned)
                rt.memcpyAsync(x.data.ptr, pinned.ctypes.data, nbytes, rt.memcpyHostToDevice, stream.ptr)

            staged_ms = time_wall(staged, args.iters, args.warmup, stream.synchronize)
            memcpy_ms = time_wall(memcpy_round_trip, args.iters, args.warmup, stream.synchronize)
            rows.append({"table": "staging", "bytes": nbytes, "chunk_bytes": args.chunk_bytes, "depth": args.depth,
                         "host_op": args.host_op, "staged_us": staged_ms * 1e3, "memcpy_us": memcpy_ms * 1e3,
                         "staged_GBps": nbytes / (staged_ms * 1e-3) / 1e9,
                         "memcpy_GBps": nbytes / (memcpy_ms * 1e-3) / 1e9,
                         "vs_memcpy": memcpy_ms / staged_ms})
            x = pinned = pinned_mem = None  # free before the next size
    return rows


def _collective_rank(rank, size, port, transport, sizes, iters, warmup, results):
    import cupy as cp
    from pyrdma.collectives import Communicator
    with Communicator(rank, size, f"127.0.0.1:{port}", transport=transport, timeout=120) as comm:
        rows = []
        for nbytes in sizes:
            host = np.ones(max(1, nbytes // 4), np.float32)
            dev = cp.ones(host.size, cp.float32)
            row = {"table": "collective", "bytes": host.nbytes, "ranks": size, "transport": comm.transport_name}
            sync = cp.cuda.Device().synchronize
            for name, buf, path in (("numpy", host, "auto"), ("cupy", dev, "staged"), ("direct", dev, "direct")):
                comm.gpu_path = path
                times = []
                for i in range(warmup + iters):
                    comm.barrier()
                    t0 = time.perf_counter()
                    comm.allreduce(buf)
                    sync()
                    times.append(time.perf_counter() - t0)
                row[f"{name}_us"] = statistics.median(times[warmup:]) * 1e6
            row["cupy_vs_numpy"] = row["numpy_us"] / row["cupy_us"]
            row["direct_vs_numpy"] = row["numpy_us"] / row["direct_us"]
            rows.append(row)
        if rank == 0:
            results.put(rows)


def bench_collective(args):
    """allreduce of a CuPy array (staged through pinned host memory) against the same Communicator's
    allreduce of a numpy array of the same bytes: what staging costs on top of the host collective."""
    import multiprocessing
    from pyrdma.testing import free_port
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    sizes = [n for n in args.sizes if n >= args.collective_min_bytes]
    procs = [ctx.Process(target=_collective_rank, args=(r, args.ranks, port, args.transport, sizes, args.iters,
                                                         args.warmup, results)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    try:
        rows = results.get(timeout=600)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return rows


def print_collective(rows):
    if not rows:
        return
    print(f"# allreduce float32 sum, {rows[0]['ranks']} ranks over {rows[0]['transport']}, same Communicator: "
          f"numpy array; CuPy array staged (gpu_path='staged'); CuPy array in GPU memory with CUDA reductions "
          f"(gpu_path='direct'); x/numpy = numpy time / x time")
    print(f"{'size':>10} {'numpy(us)':>11} {'staged(us)':>11} {'direct(us)':>11} {'staged/numpy':>13} "
          f"{'direct/numpy':>13}")
    for r in rows:
        print(f"{r['bytes']:>10} {r['numpy_us']:>11.1f} {r['cupy_us']:>11.1f} {r['direct_us']:>11.1f} "
              f"{r['cupy_vs_numpy']:>13.2f} {r['direct_vs_numpy']:>13.2f}")


def print_reduce(rows, repeat, target_bytes):
    print(f"# reduce_into vs device-to-device copy of the same bytes (us per call, {repeat} calls back to back; "
          f"1call: one call alone, launch included)")
    print(f"{'size':>10} {'count':>12} {'type':>8} {'op':>5} {'reduce(us)':>11} {'1call(us)':>10} {'GB/s(3N)':>9} "
          f"{'copy(us)':>10} {'GB/s(2N)':>9} {'vs_copy':>8} {'bw/copy':>8}")
    for r in rows:
        print(f"{r['bytes']:>10} {r['count']:>12} {r['dtype']:>8} {r['op']:>5} {r['reduce_us']:>11.2f} "
              f"{r['one_call_us']:>10.2f} {r['reduce_GBps']:>9.1f} {r['copy_us']:>10.2f} {r['copy_GBps']:>9.1f} "
              f"{r['vs_copy']:>8.2f} {r['bw_vs_copy']:>8.2f}")
    big = [r for r in rows if r["bytes"] >= target_bytes]
    if big:
        worst = min(big, key=lambda r: r["bw_vs_copy"])
        verdict = "MET" if worst["bw_vs_copy"] >= 0.85 else "MISSED"
        print(f"# target: reduction bandwidth >= 0.85x the copy's at >= {human(target_bytes)}: {verdict} "
              f"(worst {worst['bw_vs_copy']:.3f}: {worst['dtype']} {worst['op']} {human(worst['bytes'])})")


def print_staging(rows):
    if not rows:
        return
    r0 = rows[0]
    print(f"# host staging pipeline (chunk {human(r0['chunk_bytes'])}, depth {r0['depth']}, host_op "
          f"{r0['host_op']}) vs unpipelined cudaMemcpy round trip")
    print(f"{'size':>10} {'staged(us)':>11} {'GB/s':>8} {'memcpy(us)':>11} {'GB/s':>8} {'vs_memcpy':>10}")
    for r in rows:
        print(f"{r['bytes']:>10} {r['staged_us']:>11.1f} {r['staged_GBps']:>8.2f} {r['memcpy_us']:>11.1f} "
              f"{r['memcpy_GBps']:>8.2f} {r['vs_memcpy']:>10.2f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--min-bytes", type=parse_size, default=1 << 10)
    p.add_argument("--max-bytes", type=parse_size, default=256 << 20)
    p.add_argument("--step-factor", type=int, default=4)
    p.add_argument("--dtypes", nargs="+",
                   default=["int8", "uint8", "int32", "int64", "float16", "float32", "float64"])
    p.add_argument("--ops", nargs="+", default=["sum", "prod", "min", "max"])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeat", type=int, default=10, help="reduce/copy calls per timed sample")
    p.add_argument("--target-bytes", type=parse_size, default=64 << 20,
                   help="sizes from which the 0.85x-of-copy bandwidth target is checked")
    p.add_argument("--chunk-bytes", type=parse_size, default=4 << 20)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--host-op", choices=["noop", "add"], default="noop",
                   help="what the staging path does on the host per chunk (add: numpy x += x)")
    p.add_argument("--skip", choices=["reduce", "staging", "collective"], action="append", default=[])
    p.add_argument("--ranks", type=int, default=2, help="ranks of the collective table (processes on this GPU)")
    p.add_argument("--transport", choices=["auto", "rdma", "tcp"], default="auto",
                   help="the collective table's transport (auto: RDMA when a device is up, else TCP)")
    p.add_argument("--collective-min-bytes", type=parse_size, default=64 << 10)
    p.add_argument("--json", help="also write the JSON rows to this file")
    args = p.parse_args(argv)
    args.sizes = size_range(args.min_bytes, args.max_bytes, args.step_factor)

    try:
        import cupy as cp
    except ImportError:
        sys.exit("gpu_reduce_bench needs CuPy and a CUDA GPU (pip install cupy-cuda12x)")
    import pyrdma.cuda as gpu

    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    print(f"# GPU {dev.id}: {name}, CuPy {cp.__version__}, CUDA runtime {cp.cuda.runtime.runtimeGetVersion()}")
    rows = []
    if "reduce" not in args.skip:
        reduce_rows = bench_reduce(cp, gpu, args)
        print_reduce(reduce_rows, args.repeat, args.target_bytes)
        rows += reduce_rows
    if "staging" not in args.skip:
        staging_rows = bench_staging(cp, gpu, args)
        print()
        print_staging(staging_rows)
        rows += staging_rows
    if "collective" not in args.skip:
        collective_rows = bench_collective(args)
        print()
        print_collective(collective_rows)
        rows += collective_rows
    doc = {"gpu": name, "cupy": cp.__version__, "iters": args.iters, "warmup": args.warmup, "rows": rows}
    text = json.dumps(doc, indent=1)
    print()
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
