"""Helpers for tests and benchmarks that run pyrdma against real devices and other programs."""
import contextlib
import os
import socket
import sys

SYSFS_INFINIBAND = "/sys/class/infiniband"
# Soft-RoCE's counters of RC retransmission: ACK timeouts (each resends everything not yet
# acknowledged) and packets the responder had already received.
RESEND_COUNTERS = ("completer_retry_err", "duplicate_request")


def free_port(host="127.0.0.1"):
    """A TCP port on ``host`` that was free a moment ago (another process may take it before the
    caller binds it: the usual race of asking the kernel for an ephemeral port)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def tcp_listening(port):
    """True once some socket listens on TCP ``port``, read from /proc: a probe connection would be
    taken by a one-shot server (perftest's, or pyrdma-perf's) as its client."""
    want = f":{port:04X}"
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as fh:
                next(fh)
                for line in fh:
                    parts = line.split()
                    if parts[1].endswith(want) and parts[3] == "0A":
                        return True
        except OSError:
            pass
    return False


def rc_resends(dev, port=1, sysfs=SYSFS_INFINIBAND):
    """{counter: value} of RESEND_COUNTERS for ``dev``'s ``port``, or None where the device has no
    such counters (only rxe names them so). Resends cost time and CPU: a benchmark run that caused
    many measured the ACK timeout more than the code under test."""
    base = os.path.join(sysfs, dev, "ports", str(port), "hw_counters")
    try:
        values = {}
        for name in RESEND_COUNTERS:
            with open(os.path.join(base, name)) as fh:
                values[name] = int(fh.read())
        return values
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def counting_rc_resends(dev, port=1, sysfs=SYSFS_INFINIBAND):
    """``with counting_rc_resends("rxe0") as resends:`` afterwards ``resends`` holds how much each of
    RESEND_COUNTERS grew over the block; it stays empty where the device has no such counters."""
    resends = {}
    before = rc_resends(dev, port, sysfs)
    try:
        yield resends
    finally:
        after = rc_resends(dev, port, sysfs)
        if before is not None and after is not None:
            resends.update((k, after[k] - before[k]) for k in RESEND_COUNTERS)


# perftest times its cycle counter against the clock at start-up and gives up ("Can't produce a
# report") when the two disagree, as they now and then do in the emulated VM: not a failure of the
# program on the other side.
PERFTEST_CLOCK_FAILED = "Correlation coefficient r^2"


def again_if_perftest_clock_failed(run_once, server_cmd, client_cmd, port=None, fresh_port=None, attempts=3):
    """``run_once(server_cmd, client_cmd, port)``'s result. An AssertionError that carries
    PERFTEST_CLOCK_FAILED, or a result that does (a perftest whose clock failed may still exit 0,
    with a size's row missing: ib_write_lat -a), runs it again, up to ``attempts`` times in all;
    with ``fresh_port`` (a callable) each new attempt gets a new TCP port in place of ``port`` in
    both commands, since the old one may linger."""
    for attempt in range(attempts):
        if attempt and fresh_port is not None:
            new = fresh_port()
            server_cmd, client_cmd = ([str(new) if arg == str(port) else arg for arg in cmd]
                                      for cmd in (server_cmd, client_cmd))
            port = new
        try:
            result = run_once(server_cmd, client_cmd, port)
            assert PERFTEST_CLOCK_FAILED not in str(result), f"perftest's clock failed: {result}"
            return result
        except AssertionError as exc:
            if PERFTEST_CLOCK_FAILED not in str(exc) or attempt == attempts - 1:
                raise


def count_python_calls(fn):
    """How many Python-level function calls ``fn()`` makes, ``fn`` itself included (calls of C
    functions are not counted): what a warm one-call collective costs in Python."""
    calls = [0]

    def profile(frame, event, arg):
        if event == "call":
            calls[0] += 1
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls[0]
