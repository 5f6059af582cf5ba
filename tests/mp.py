"""Run one function in N processes, each its own rank; always reap them."""
import multiprocessing as mp
import socket
import traceback

DEFAULT_TIMEOUT = 300


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank, size, args, results):
    try:
        results.put((rank, "ok", fn(rank, size, *args)))
    except BaseException as exc:   # the parent reports it
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run_ranks(fn, size, *args, timeout=DEFAULT_TIMEOUT, expect_errors=False):
    """fn(rank, size, *args) in ``size`` spawned processes; returns the results by rank.
    Raises AssertionError naming the ranks that failed or hung (unless expect_errors: then the
    (status, value) pairs are returned). Children are killed and joined in every case."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(fn, r, size, args, results), daemon=True) for r in range(size)]
    for p in procs:
        p.start()
    got = {}
    try:
        import queue
        import time
        deadline = time.monotonic() + timeout
        while len(got) < size:
            try:
                rank, status, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                break
            got[rank] = (status, value)
    finally:
        for p in procs:
            p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    missing = sorted(set(range(size)) - set(got))
    if expect_errors:
        return [got.get(r, ("missing", None)) for r in range(size)]
    failed = {r: v for r, (s, v) in got.items() if s != "ok"}
    assert not missing and not failed, f"ranks {missing} gave no result; failures: {failed}"
    return [got[r][1] for r in range(size)]
