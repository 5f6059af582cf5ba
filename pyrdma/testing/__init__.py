"""Helpers for tests and benchmarks that run pyrdma against real devices and other programs."""


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
