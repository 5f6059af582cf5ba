"""Run one function in N processes, one per rank, and always reap them.

    from mp import run_ranks
    from pyrdma.testing import free_port
    results = run_ranks(fn, 2, port, timeout=120)   # fn(rank, size, port) in 2 fresh processes

``fn`` must be importable by the children (a module-level function of a test module or helper).
Every wait has a timeout, and the children are killed and joined whatever happens.
"""
import multiprocessing
import queue
import time
import traceback

DEFAULT_TIMEOUT = 300
# What every rank imports, done once in the fork server: a spawned rank imported them itself, 22 s
# for 3 ranks and 29 s for 4 in the emulated VM, against 0.4 s for 4 ranks forked from the server.
PRELOAD = ["numpy", "pytest", "pyrdma.collectives"]


def rank_context():
    """The multiprocessing context for rank processes: forked from a server that has imported
    PRELOAD and nothing else (no device opened, no thread), so each rank is fresh but starts in
    a fraction of a second. The server and its children keep the environment it started with."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx
# After the last live child exits, how long to keep reading results it may still be flushing.
_DRAIN_S = 2.0


def _child(fn, rank, size, args, kwargs, results):
    try:
        value = fn(rank, size, *args, **kwargs)
    except BaseException as exc:   # the parent reports it
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    else:
        results.put((rank, "ok", value))


def _stop(procs, finishing):
    """Join the children; the ``finishing`` ones (they reported) get a moment to exit on their own,
    the rest are terminated, then killed. Each wait is bounded."""
    started = {rank: p for rank, p in enumerate(procs) if p.pid is not None}   # start() may fail part way
    for rank, p in started.items():
        if rank in finishing:
            p.join(timeout=5)
    for p in started.values():
        if p.is_alive():
            p.terminate()
    for p in started.values():
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def run_ranks(fn, size, *args, timeout=DEFAULT_TIMEOUT, expect_errors=False, kwargs=None):
    """Call ``fn(rank, size, *args, **kwargs)`` in ``size`` new processes; return the results by rank.

    Raises AssertionError naming the ranks that raised (with their tracebacks), crashed or hung past
    ``timeout`` seconds. With ``expect_errors`` it returns ``(status, value)`` per rank instead, status
    one of "ok", "error" (value: the traceback), "missing" (value: the exit code, None if it hung).
    """
    ctx = rank_context()
    results = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(fn, rank, size, args, kwargs or {}, results), name=f"rank{rank}")
             for rank in range(size)]
    got = {}
    hung = set()
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        all_exited_at = None
        while len(got) < size and time.monotonic() < deadline:
            try:
                rank, status, value = results.get(timeout=min(0.2, max(0.01, deadline - time.monotonic())))
                got[rank] = (status, value)
                continue
            except queue.Empty:
                pass
            # A child that died without reporting (crash, os._exit) must not cost the whole timeout.
            if all(not p.is_alive() for r, p in enumerate(procs) if r not in got):
                all_exited_at = all_exited_at or time.monotonic()
                if time.monotonic() - all_exited_at > _DRAIN_S:
                    break
    finally:
        hung = {rank for rank, p in enumerate(procs) if rank not in got and p.is_alive()}
        _stop(procs, finishing=set(got))
        results.close()
        results.join_thread()
    outcome = [got.get(r, ("missing", None if r in hung else procs[r].exitcode)) for r in range(size)]
    if expect_errors:
        return outcome
    bad = []
    for rank, (status, value) in enumerate(outcome):
        if status == "error":
            bad.append(f"rank {rank} raised {value}")
        elif status == "missing":
            how = f"hung, killed after {timeout} s" if value is None else f"exited with code {value}"
            bad.append(f"rank {rank} gave no result: {how}")
    assert not bad, f"run_ranks({getattr(fn, '__name__', fn)}, {size}) failed:\n" + "\n".join(bad)
    return [value for _, value in outcome]
