"""The Python model of the C engine's schedule interpreter (pyx/engine.pyx: _execute, _exchange),
for the flow-control tests: the same steps, posted in the same order, over an in-process
transport whose credits are counted exactly like the engine's. A credit cycle in a planner shows
here as a timeout, in seconds and without a VM. The model runs EXCHANGE, SPREAD (one by one, in
the pairwise order), OFFER/FETCH (a send and a receive, as on sockets) and WAIT_SENDS; it has no
COPY_UPTO (point-to-point messages) nor ASK/PUT/LANDED (RDMA WRITEs), which the engine's tests
cover.

The transport contract the model runs on:

    t.send(peer, offset, nbytes)         post work[offset:offset+nbytes] as the next message to peer
    t.can_send(peer) -> bool             whether send(peer, ...) would post without waiting
    t.send_window                        how many messages a step may send to a peer ahead of the
                                         one it is consuming (when they post without waiting)
    t.recv(peer, nbytes) -> uint8 view   wait for the next message from peer (messages arrive in
                                         the order they were sent); valid until release(peer)
    t.release(peer)                      that view has been consumed (its slot may be reused)
    t.wait_sends(peer=None)              every posted send has left local memory (work may change)
"""
from pyrdma.collectives.schedule import ASK, COPY_UPTO, WAIT_SENDS


def execute(t, schedule, consume):
    """Run ``schedule`` over ``t``; ``consume(kind, chunk, data)`` handles each received chunk."""
    steps, chunks = schedule.steps.tolist(), schedule.chunks.tolist()
    for kind, sp, rp, s0, ns, r0, nr, ck in steps:
        if kind == WAIT_SENDS:
            t.wait_sends(None if sp < 0 else sp)
            continue
        assert ck != COPY_UPTO, "the flow model has no point-to-point messages"
        assert kind < ASK, "the flow model has no RDMA WRITEs (ASK, PUT, LANDED)"
        pipelined_step(t, sp, chunks[s0:s0 + ns], rp, chunks[r0:r0 + nr],
                       lambda chunk, data, ck=ck: consume(ck, chunk, data))


def pipelined_step(t, send_peer, send_chunks, recv_peer, recv_chunks, consume):
    """Send ``send_chunks`` to send_peer while receiving as many chunks from recv_peer, in the
    engine's order of posts (Engine._exchange says why): while chunk k is awaited and consumed,
    chunks up to k + ``t.send_window`` go out, as many as the transport takes without waiting for a
    credit; chunk k+1 is always out before chunk k+1 is awaited, but when it has to wait for a
    credit it goes only after chunk k is released."""
    nsend, nrecv = len(send_chunks), len(recv_chunks)
    sent = 0

    def send_next():
        nonlocal sent
        off, n, _ = send_chunks[sent]
        t.send(send_peer, off, n)
        sent += 1

    def send_ahead(k):
        # chunks k+1 .. k+window, while the transport can take them without waiting
        while sent < nsend and sent <= k + t.send_window and t.can_send(send_peer):
            send_next()

    if nsend:
        send_next()
    for k in range(max(nsend, nrecv)):
        send_ahead(k)
        if k < nrecv:
            chunk = recv_chunks[k]
            data = t.recv(recv_peer, chunk[1])
            send_ahead(k)
            if len(data):
                consume(chunk, data)
            t.release(recv_peer)
        if sent < min(nsend, k + 2):
            send_next()
