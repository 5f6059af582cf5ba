"""Point-to-point channels the collective algorithms are written against (gloo's "pair"/"buffer").

A transport executes schedules (schedule.py); it never knows the algorithm.

    t.rank, t.size, t.max_message        who we are; the largest message in bytes
    t.work_area(nbytes, lend=None, start=0, kind=HOST) -> the work area of the next collective: the
                                         transport's own buffer, or lend[start:start+nbytes] in
                                         place (zero copy; registered once over RDMA), memory of
                                         ``kind`` (work.HostMemory: how to register, sync, read,
                                         write it, and whether chunks are consumed in Python)
    t.buffer(nbytes) -> uint8 array      work_area(nbytes): the own buffer (registered once,
                                         reused; grows on demand), never memory lent before
    t.set_tag(desc)                      the description of the collective now running (describe();
                                         every message carries it, the receiver compares it exactly)
    t.run(schedule, dtype, op, consume)  execute a schedule on the work area in the C engine (one call
                                         without the GIL, over queue pairs or sockets)
    t.abort(culprit, reason)             best effort: tell every peer this group is failing
    t.interrupt(), t.close()

RdmaTransport: one RC QP per peer. Each rank registers, once, ``slots`` receive slots of
``max_message`` bytes per peer. A message is one RDMA WRITE_WITH_IMM into the receiver's next slot
(slot = message number mod slots: RC delivers in order, so the slot index need not travel) that
gathers a 64-byte header room and the payload, straight from the sender's registered work buffer:
the header is the collective's full description and the length, which the receiver compares
exactly with its own; the payload lands 64 bytes into the slot. The 32-bit immediate carries the
kind (2 bits), credits returned (7 bits) and the length (23 bits).
Flow control is by credits: a sender starts with ``slots`` credits, spends one per message and
waits when it has none; the receiver returns consumed slots as credits, so a slot is never
overwritten before it was consumed. They ride on its next data message to that peer, or, once half
the slots wait to be returned, go in a zero-byte WRITE_WITH_IMM of their own.
Rendezvous (a point-to-point message of ``rendezvous_bytes``, the Communicator's zero_copy_bytes,
or more): the sender's first message is a header alone whose description carries the length
(RTS); the receiver writes its buffer's address and rkey into the sender's 64-byte mailbox for it
(a WRITE_WITH_IMM whose immediate is a CONTROL of sub-kind CTS: after every peer's slots, out of the
slot stream, so it never queues behind the receiver's own messages); the sender RDMA WRITEs the
payload there and sends a second header (FIN), which RC delivers after the writes. A CTS nobody
asked for fails the group as a malformed message.

TcpTransport: the same contract over one TCP connection per pair of ranks, for machines without
RDMA and for host tests, and the same C engine (Engine.over_sockets, its socket link): each message
is a frame of the immediate (network order), the header and the payload, read into the receiver's
next slot as the WRITE_WITH_IMM would have put it; the same credits, kinds, rendezvous-free. The
sockets are non-blocking and polled without the GIL; a frame is written by one gathering sendmsg()
(many frames at once where they queue) and a large payload read straight into its slot. Every
length is bounded before anything is read into a slot (a frame by max_message, data by the credits
the peer was given): a malformed frame drops the connection and fails the group with PeerError. A
peer whose slots are all full while we wait has its messages copied out (Engine._keep_arrivals), so
an eager isend longer than the slots never waits on a receiver that waits on it (both links).

Closing. ``interrupt()`` (Communicator.close from another thread) makes every wait raise
UsageError within CLOSE_POLL seconds; waits sleep in slices that short, so Ctrl-C
(KeyboardInterrupt) gets through as quickly.

Failures. Every wait gives up after ``timeout`` seconds with a PeerError. A peer that disconnects,
fails a work completion or reports an abort raises PeerError at once. Whom to blame on a timeout
is found out, not guessed: shortly before the deadline the waiting rank asks the peer it waits for
what *it* is waiting for (a QUERY, answered from that peer's own wait loop with a REPORT), and
follows the chain; the rank at its end, one that does not answer, is the one that stalled or
died. So in a ring where rank 2 hangs, ranks 3 and 0 both name rank 2, not their neighbour.
"""

from pyrdma.collectives.transport.base import *  # noqa: F401,F403 - the package's names, as before the split
from pyrdma.collectives.transport.base import (_KIND_ABORT, _KIND_CONTROL, _KIND_CREDIT, _KIND_DATA,  # noqa: F401
                                               _as_desc, _grow, _malformed, _Waits)
from pyrdma.collectives.transport.rdma import HEADER_ROOM, RdmaTransport  # noqa: F401
from pyrdma.collectives.transport.tcp import (_HELLO, _HELLO_MAGIC, _HELLO_VERSION, HELLO_TIMEOUT,  # noqa: F401
                                              MAX_TCP_MESSAGE, TcpTransport)
