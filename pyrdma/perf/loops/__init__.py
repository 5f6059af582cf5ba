"""The measurement loops of pyrdma-perf, one function per (test kind, role), in two modes.

``loop``    one public-API call per operation: ``qp.post_write(...)`` / ``post_read`` / ``post_send_buf``
            / ``post_atomic_*`` per WR and ``cq.poll_into(wcs, check=True)`` to reap — what a user's own Python
            loop gets from pyrdma.
``batched`` the binding's ceiling: prebuilt ``SendWRList``/``RecvWRList`` posted with one call per
            list (perftest's --post_list), and ``cq.poll_wait`` reaping many completions per call
            with the GIL released.

The loops copy perftest's structure (src/perftest_resources.c: run_iter_bw, run_iter_bw_server,
run_iter_lat_write, run_iter_lat, run_iter_lat_send) so their time stamps mean the same thing and
pyrdma.perf.stats turns them into the same columns:

* BW sender: keep up to tx_depth WRs outstanding per QP; only every cq_mod-th WR (and the last) is
  signaled; stamp tposted[k] before posting WR k (batched: before each list, at its first index),
  stamp tcompleted[k] for the last WR a completion covers.
* BW receiver (send_bw server): pre-post rx_depth receives, re-post as they complete; the run is
  timed from the first receive completion to the last (no peak), as perftest does.
* write_lat: ping-pong; each side RDMA-writes its counter into the last byte of the peer's buffer
  and spins on the last byte of its own; the server sends first.
* send_lat: ping-pong of SENDs; the client sends first.
* read_lat / atomic_lat: post one op, spin on its completion, repeat.
"""
from pyrdma.perf.loops.common import (POLL_TIMEOUT, Resources, RunError, SampleWindow, drain_receives,
                                      ensure_receives, pattern)
from pyrdma.perf.loops.bw import BWRun, bw_receiver, bw_report_from, bw_sender
from pyrdma.perf.loops.lat import op_lat, send_lat, write_lat

__all__ = ["POLL_TIMEOUT", "Resources", "RunError", "SampleWindow", "drain_receives", "ensure_receives", "pattern",
           "BWRun", "bw_receiver", "bw_report_from", "bw_sender", "op_lat", "send_lat", "write_lat"]
