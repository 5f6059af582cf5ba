"""Traffic under faults on the multi-host test bed (``python -m pyrdma.testing.vm --hosts N``): an RC
WRITE stream between two hosts' devices and a two-rank allreduce with ``tc netem`` on host 1's wire.
tests/test_multihost.py checks them at sizes CI can afford; bench/fault_bench.py times them at the
sizes of #19 and reports each fault's slowdown against no fault.

Both check every byte: a fault may cost time, never data.
"""
import os
import subprocess
import time

import numpy as np

from pyrdma.testing import hosts as testbed

# Faults on a host's wire (both directions), as (name, netem spec); None: no fault.
FAULTS = [("none", None), ("loss 1%", "loss 1%"), ("loss 5%", "loss 5%"),
          ("reorder", "delay 2ms reorder 25% 50%")]
# 4.096 us * 2^14 = 67 ms before an RC resend (perftest's default): loss costs little wall time.
FAST_QP_TIMEOUT = 14
# Any single completion wait.
WAIT_S = 60


def poll(cq, n, timeout=WAIT_S):
    """``n`` completions from ``cq`` within ``timeout`` seconds, each status checked (CompletionError)."""
    import pyrdma as rd
    wcs = np.empty(max(n, 16), rd.WC_DTYPE)
    got, out = 0, []
    deadline = time.monotonic() + timeout
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise rd.RDMATimeoutError(f"{n - got} of {n} completions missing after {timeout} s", call="poll")
        k = cq.poll_wait(wcs, 1, timeout=left)
        rd.check_wcs(wcs[:k])
        out.append(wcs[:k].copy())
        got += k
    return np.concatenate(out) if out else wcs[:0]


def write_stream(a, b, nbytes, chunk=1 << 16, depth=16, qp_timeout=FAST_QP_TIMEOUT, retry_cnt=7, wait=120):
    """RC WRITEs of ``nbytes`` from host ``a``'s device to host ``b``'s in ``chunk`` pieces, ``depth`` in
    flight; returns (seconds, path MTUs) after checking every byte (AssertionError naming how many
    differ). CompletionError or RDMATimeoutError when the wire fails them."""
    import pyrdma as rd
    with rd.Context(a.device) as ctx_a, rd.Context(b.device) as ctx_b:
        pd_a, pd_b = rd.ProtectionDomain(ctx_a), rd.ProtectionDomain(ctx_b)
        cq_a, cq_b = rd.CompletionQueue(ctx_a, 4 * depth), rd.CompletionQueue(ctx_b, 16)
        qp_a = rd.QueuePair(pd_a, rd.QPT_RC, cq_a, max_send_wr=2 * depth)
        qp_b = rd.QueuePair(pd_b, rd.QPT_RC, cq_b)
        src = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
        dst = np.zeros(nbytes, np.uint8)
        mr_a = rd.MemoryRegion(pd_a, src, rd.ACCESS_ALL)
        mr_b = rd.MemoryRegion(pd_b, dst, rd.ACCESS_ALL)
        ep_a, ep_b = qp_a.endpoint(mr=mr_a), qp_b.endpoint(mr=mr_b)
        qp_a.connect(ep_b, timeout=qp_timeout, retry_cnt=retry_cnt)
        qp_b.connect(ep_a, timeout=qp_timeout, retry_cnt=retry_cnt)
        mtus = (qp_a.query().path_mtu, qp_b.query().path_mtu)
        start = time.monotonic()
        posted = done = 0
        chunks = -(-nbytes // chunk)
        try:
            while done < chunks:
                while posted < chunks and posted - done < depth:
                    off = posted * chunk
                    n = min(chunk, nbytes - off)
                    qp_a.post_write(mr_a, off, n, ep_b.addr + off, ep_b.rkey, wr_id=posted)
                    posted += 1
                done += len(poll(cq_a, 1, timeout=wait))
            elapsed = time.monotonic() - start
        finally:
            # Error state first: it flushes what is outstanding. Destroying a QP that rxe is still
            # resending on a dead path can hang in the kernel (seen once in the VM after the MTU test).
            for qp in (qp_a, qp_b):
                try:
                    qp.to_error()
                except rd.RDMAError:
                    pass
            pd_a.close()
            pd_b.close()
        assert np.array_equal(dst, src), f"{int((dst != src).sum())} bytes differ"
        return elapsed, mtus


def allreduce_under_faults(rank, size, port, hosts_path, faults, nbytes, qp_timeout=FAST_QP_TIMEOUT):
    """One rank of two, on hosts 1 and 2 (call it in one process per rank). For each (name, spec) of
    ``faults`` rank 0 puts netem on host 1's wire (both directions) between barriers and both time a ring
    allreduce of ``nbytes`` (float32; an int, or {fault name: bytes}); returns ({name: seconds},
    {name: result exact})."""
    hosts = testbed.load(hosts_path)
    os.environ.update(hosts[rank].env())
    from pyrdma.collectives import Communicator
    times, correct = {}, {}
    with Communicator(rank, size, f"{hosts[0].address}:{port}", transport="rdma", timeout=120,
                      qp_timeout=qp_timeout) as comm:
        for name, spec in faults:
            comm.barrier()
            if rank == 0 and spec:
                for cmd in testbed.netem_commands(hosts[0], spec)[0]:
                    testbed.run_ip(*cmd)
            comm.barrier()
            n = (nbytes[name] if isinstance(nbytes, dict) else nbytes) // 4
            x = (np.arange(n) % 4093 + rank).astype(np.float32)
            start = time.monotonic()
            try:
                comm.allreduce(x, algorithm="ring")
            finally:
                times[name] = time.monotonic() - start
                if rank == 0 and spec:
                    for cmd in testbed.netem_commands(hosts[0], spec)[1]:
                        subprocess.run(cmd, capture_output=True, timeout=testbed.COMMAND_TIMEOUT_S)
            correct[name] = bool(np.array_equal(x, (2 * (np.arange(n) % 4093) + 1).astype(np.float32)))
    return times, correct
