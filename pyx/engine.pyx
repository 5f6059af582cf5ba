# cython: boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The collective engine: runs a whole collective's schedule over RC QPs, or TCP sockets, without the GIL.

A schedule (pyrdma.collectives.schedule) is a flat int64 array of steps and one of chunks, planned
in Python once per (collective, size, rank, count, ...) and cached. ``Engine.run`` executes it in
C: it posts the messages (one WRITE_WITH_IMM of the 48-byte header and the payload into the
peer's next receive slot), polls the CQ in batches (spinning briefly, then
sleeping on the completion channel), checks every received header against the collective's
description, reduces or copies the received chunks with the C kernels of pyrdma_reduce.h, returns
credits (on its own data messages to that peer where it can), answers the wait-for queries of
other ranks, and enforces the timeout. One call per collective, whatever its size and rank count.
The wire protocol is the one the transport module documents (RdmaTransport).

The GIL is taken only to run signal handlers while waiting (Ctrl-C raises KeyboardInterrupt, as in
pyzmq) and, for GPU work areas, to call the Python ``consume`` callback that runs CUDA copies and
reductions; a run may also start holding the GIL and leave it at its first wait
(Engine._execute_holding_gil, for the one-call point-to-point messages of pyx/hostcalls.pyx).
Errors are recorded in C (``failure()`` describes them) and raised by the transport in the one
exception hierarchy. The C types are declared in engine.pxd, for the modules that drive the engine.
"""
cimport cython
from cpython.exc cimport PyErr_CheckSignals
from cpython.pythread cimport PyThread_get_thread_ident
from libc.errno cimport errno, EAGAIN, EINTR, ESRCH
from posix.uio cimport iovec
from libc.stdint cimport uint8_t, uint32_t, uint64_t, int64_t, uintptr_t, INT64_MAX
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy, memcmp, memset
from pyrdma._verbs.libibverbs cimport *
from pyrdma._verbs.base cimport (VerbsObject, use, unuse, monotonic_now, pyrdma_load_flag, pyrdma_store_flag,
                                  pyrdma_bump_word, pollfd, poll, POLLIN)
from pyrdma._verbs.cq cimport CompletionQueue
from pyrdma._verbs.qp cimport QueuePair
from pyrdma._verbs.mr cimport MemoryRegion

import threading

from pyrdma.errors import UsageError

cdef unsigned long _main_thread = threading.main_thread().ident

cdef extern from "<sched.h>" nogil:
    int sched_yield()

cdef extern from "<unistd.h>" nogil:
    long sysconf(int name)
    int _SC_NPROCESSORS_ONLN

cdef extern from "<poll.h>" nogil:
    enum: POLLOUT

cdef extern from "<sys/socket.h>" nogil:
    ctypedef unsigned int socklen_t
    cdef struct msghdr:
        void *msg_name
        socklen_t msg_namelen
        iovec *msg_iov
        size_t msg_iovlen
        void *msg_control
        size_t msg_controllen
        int msg_flags
    ssize_t sendmsg(int fd, const msghdr *msg, int flags)
    ssize_t recv(int fd, void *buf, size_t n, int flags)
    int shutdown(int fd, int how)
    enum: MSG_NOSIGNAL, MSG_DONTWAIT, SHUT_RDWR

cdef extern from "<sys/uio.h>" nogil:
    ssize_t process_vm_readv(int pid, const iovec *local, unsigned long nlocal, const iovec *remote,
                             unsigned long nremote, unsigned long flags)

cdef extern from "<arpa/inet.h>" nogil:
    uint32_t htonl(uint32_t x)
    uint32_t ntohl(uint32_t x)

cdef extern from "pyrdma_reduce.h" nogil:
    int pyrdma_reduce(void *dst, const void *a, const void *b, size_t n, int dtype, int op)
    const size_t pyrdma_itemsize[8]

LAYOUT = dict(STEP_COLUMNS=STEP_COLUMNS, CHUNK_COLUMNS=CHUNK_COLUMNS, EXCHANGE=EXCHANGE, WAIT_SENDS=WAIT_SENDS,
              OFFER=OFFER, FETCH=FETCH, SPREAD=SPREAD, ASK=ASK, PUT=PUT, LANDED=LANDED, NOTICE=NOTICE,
              CONSUME_NONE=CONSUME_NONE, CONSUME_COPY=CONSUME_COPY, CONSUME_REDUCE=CONSUME_REDUCE,
              CONSUME_REDUCE_LOWER=CONSUME_REDUCE_LOWER, CONSUME_REDUCE_UPPER=CONSUME_REDUCE_UPPER,
              CONSUME_COPY_UPTO=CONSUME_COPY_UPTO, HEADER_ROOM=C_HEADER_ROOM)
WAITS = {WAIT_CREDIT: "credit", WAIT_ARRIVAL: "arrival", WAIT_SEND_QUEUE: "send queue", WAIT_SENDS_DONE: "sends",
         WAIT_CTS: "rendezvous", WAIT_SPREAD: "spread"}
FAILURES = {FAIL_LINK: "link", FAIL_ABORT: "abort", FAIL_MISMATCH: "mismatch", FAIL_TIMEOUT: "timeout",
            FAIL_CLOSED: "closed", FAIL_POST: "post", FAIL_POLL: "poll", FAIL_MALFORMED: "malformed",
            FAIL_PYTHON: "python", FAIL_MEMORY: "memory", FAIL_ADDRESS: "address"}
SEND_KIND = DESC_KIND_SEND          # transport.base.KINDS' index of "send" (a test compares them)

cdef double CLOSE_POLL = 0.2        # the longest one sleep lasts before looking at close() and signals
cdef double SIGNAL_CHECK = 0.05     # how often a wait runs the signal handlers
# A spinning wait rations its clock reads: where the clock source has no vDSO path (the Soft-RoCE
# VM's hpet) each is a system call and an emulated device access. Reading it once per poll made
# the small collectives 3-6% slower (A/B in one boot: 2 and 4 ranks, 8 B and 4 KiB).
# A wait spins before it sleeps on the completion channel, and the spin adapts: where a sleeping
# rank's wake-up takes longer than its peer's spin (the emulated VM: ~0.7 ms), one sleep makes the
# peer's next wait outlast its spin and sleep too, and a ping-pong can stay that way at 25x its
# latency (seen in 2 of 3 rounds of bench/collectives_bench.py). Doubling the spin after a sleep that
# a completion ended within SPIN_MAX brings the pair back to spinning; a sleep that lasts (a peer
# busy computing) halves it back toward the configured spin.
cdef double SPIN_MAX = 0.005
cdef int FIRST_POLLS = 64           # polls a wait makes before it first reads the clock
cdef int CLOCK_EVERY = 32           # polls of a spin between two clock reads
# the same where the spin does not yield (Engine.spin_yields): a poll alone is an order of magnitude
# quicker (8 B ping-pong in the VM: 5-15 polls per round trip with the yields, 50-190 without)
cdef int FIRST_POLLS_NO_YIELD = 1024
cdef double SETTLE_READS = 1.0      # the longest a failed run waits for its address frames' reads
cdef double KEEP_AFTER = 0.2        # a receive's wait this long copies full slots out (_keep_arrivals)
# The socket link reads ahead into a buffer per peer (a read takes many small frames at once) and
# straight into the slot a payload this long or longer (one copy less where it pays)
cdef int RXBUF = 65536
cdef uint32_t RX_DIRECT = 8192
cdef int TX_IOV = 64                # the most pieces one sendmsg() gathers
cdef enum:
    RX_IMM = 0
    RX_HEADER = 1
    RX_PAYLOAD = 2


cdef int64_t _gcd(int64_t a, int64_t b) noexcept nogil:
    while b:
        a, b = b, a % b
    return a


cdef bint _contiguous(const int64_t[:, ::1] chunks, Py_ssize_t first, Py_ssize_t n):
    """Whether chunks[first:first+n] follow one another: one span, which one RDMA READ moves
    (of at most 4 GiB - 1, the offer's length field)."""
    cdef Py_ssize_t c
    cdef int64_t end = chunks[first, 0]
    for c in range(first, first + n):
        if chunks[c, 0] != end:
            return False
        end += chunks[c, 1]
    return end - chunks[first, 0] <= <int64_t>0xFFFFFFFF


cdef inline int64_t _span(const int64_t *ch, int n) noexcept nogil:
    """The bytes from the first of n contiguous chunks to the end of the last (Program checked them)."""
    return ch[(n - 1) * CHUNK_COLUMNS] + ch[(n - 1) * CHUNK_COLUMNS + 1] - ch[0]


cdef inline bint _desc_is(const uint8_t *got, const uint8_t *want, bint placed) noexcept nogil:
    """Whether a received description is ``want``'s (``placed``: marked as an offer's, ask's or
    landed header's, Engine.placed_desc)."""
    if not placed:
        return memcmp(got, want, DESC_SIZE) == 0
    return memcmp(got, want, DESC_PLACED_AT) == 0 and got[DESC_PLACED_AT] == 1 \
        and memcmp(got + DESC_PLACED_AT + 1, want + DESC_PLACED_AT + 1, DESC_SIZE - DESC_PLACED_AT - 1) == 0


@cython.final
cdef class Program:
    """A schedule checked once for an engine's rank, size and max_message (Engine.program): every
    peer exists, every chunk is within max_message and the step's ranges. A run then only checks
    that its work area covers ``extent`` bytes and that the chunks it reduces hold whole elements
    (their sizes' gcd, ``reduce_align``, is a multiple of the itemsize)."""

    def __init__(self):
        raise TypeError("a Program comes from Engine.program(schedule)")

    cdef int _peer(self, int64_t peer, Py_ssize_t s) except -1:
        if not 0 <= peer < self.size or peer == self.rank:
            raise UsageError(f"schedule step {s} names rank {peer}, not a peer of rank {self.rank} (size {self.size})")
        return 0

    cdef int _check(self, int rank, int size, int max_message, const int64_t[:, ::1] steps,
                    const int64_t[:, ::1] chunks, object keep=None) except -1:
        cdef Py_ssize_t s, c, nchunks = chunks.shape[0]
        cdef int64_t kind, sp, rp, s0, ns, r0, nr, ck, off, n, aux
        cdef int64_t extent = 0, align = 0
        cdef Py_ssize_t spread_at = 0     # where the run of SPREAD steps that s is in began
        self.rank, self.size, self.max_message = rank, size, max_message
        if steps.shape[1] != STEP_COLUMNS or chunks.shape[1] != CHUNK_COLUMNS:
            raise UsageError("malformed schedule arrays")
        for s in range(steps.shape[0]):
            kind, sp, rp = steps[s, 0], steps[s, 1], steps[s, 2]
            s0, ns, r0, nr, ck = steps[s, 3], steps[s, 4], steps[s, 5], steps[s, 6], steps[s, 7]
            if s == 0 or kind != SPREAD or steps[s - 1, 0] != SPREAD:
                spread_at = s
            if ASK <= kind <= NOTICE:
                self.writes = True
            if kind == WAIT_SENDS:
                if sp != -1:
                    self._peer(sp, s)
                continue
            if kind == NOTICE:
                if rp != -1 or ns or nr:
                    raise UsageError(f"schedule step {s} is malformed")
                self._peer(sp, s)
                continue
            if not EXCHANGE <= kind <= LANDED or not 0 <= ck <= CONSUME_COPY_UPTO or ns < 0 or nr < 0 \
                    or s0 < 0 or r0 < 0 or s0 + ns > nchunks or r0 + nr > nchunks \
                    or (kind == SPREAD and (ck == CONSUME_COPY_UPTO or s - spread_at >= size - 1)) \
                    or (kind == OFFER and (nr or ns < 1 or not _contiguous(chunks, s0, ns))) \
                    or (kind == FETCH and (ns or nr < 1 or ck != CONSUME_COPY or not _contiguous(chunks, r0, nr))) \
                    or (kind == ASK and (ns or nr < 1 or not _contiguous(chunks, r0, nr))) \
                    or (kind == PUT and (nr or ns < 1 or not _contiguous(chunks, s0, ns))) \
                    or (kind == LANDED and (ns or nr < 1 or ck != CONSUME_COPY)):
                raise UsageError(f"schedule step {s} is malformed")
            if ns:
                self._peer(sp, s)
            if nr:
                self._peer(rp, s)
            for c in range(s0, s0 + ns):
                off, n = chunks[c, 0], chunks[c, 1]
                if off < 0 or n < 0 or n > max_message:
                    raise UsageError(f"schedule chunk {c} ({off}, {n}) is outside the work area or over max_message")
                extent = max(extent, off + n)
            for c in range(r0, r0 + nr):
                off, n, aux = chunks[c, 0], chunks[c, 1], chunks[c, 2]
                if off < 0 or n < 0 or n > max_message or (CONSUME_REDUCE_LOWER <= ck <= CONSUME_REDUCE_UPPER
                                                             and aux < 0):
                    raise UsageError(f"schedule chunk {c} ({off}, {n}, {aux}) is outside the work area or over "
                                     f"max_message")
                extent = max(extent, off + n)
                if CONSUME_REDUCE_LOWER <= ck <= CONSUME_REDUCE_UPPER:
                    extent = max(extent, aux + n)
                if CONSUME_REDUCE <= ck <= CONSUME_REDUCE_UPPER:
                    align = _gcd(align, n)
        self.extent, self.reduce_align = extent, align
        self.nsteps = steps.shape[0]
        self.steps = &steps[0, 0] if steps.shape[0] else NULL
        self.chunks = &chunks[0, 0] if nchunks else NULL
        # ``keep``: what holds both arrays' memory, where the caller has it (a new view object
        # per array costs more than the check, which an all-to-all with new counts makes per call)
        self.arrays = (steps, chunks) if keep is None else keep
        return 0

    def __repr__(self):
        return f"<Program {self.nsteps} steps, {self.extent}-byte work area, rank {self.rank} of {self.size}>"


@cython.final
cdef class Engine:
    """The data path of both transports: per-peer state in C, and ``run(schedule)``. Two links
    under one schedule interpreter: queue pairs (``Engine(...)``, RdmaTransport) and stream sockets
    (``Engine.over_sockets``, TcpTransport); the link's calls are _send_from, _post_empty and
    _progress, each with a socket form (_sock_*), and the rest is common."""

    def __cinit__(self):
        self.peers = NULL
        self.released = NULL
        self.queried = NULL
        self.visited = NULL
        self.spread_done = NULL
        self.pfds = NULL

    def __init__(self, CompletionQueue cq not None, list qps, MemoryRegion slot_mr not None,
                 MemoryRegion header_mr not None, list remotes, int rank, int size, int slots, int slot_stride,
                 int max_message, int sq_depth, double timeout, double spin, int max_inline=0,
                 int64_t rendezvous_bytes=0):
        """The verbs link. ``qps[p]``: the QueuePair to rank p (None at ``rank``); ``remotes[p]``:
        (address of our slots in p's memory, rkey). Slots of peer p here start at slot_mr's address
        plus its index among the peers (rank order, skipping ours) times slots * slot_stride; header
        staging likewise in header_mr, slots * 64 bytes per peer. ``rendezvous_bytes``: see the
        attribute; it needs a 64-byte mailbox per peer after all the slots (and a staging room after
        the headers), in the same peer order, else rendezvous stays off."""
        cdef int p, i
        if self.peers != NULL:
            raise UsageError("Engine is already initialised")
        if len(qps) != size or len(remotes) != size:
            raise UsageError("Engine: qps and remotes must have one entry per rank")
        self.cq = cq.cq
        if cq.channel is None:
            raise UsageError("Engine needs a CQ with a completion channel")
        self.channel = cq.channel.channel
        self.header_lkey = header_mr.lkey
        self.slot_base = <uint8_t *><uintptr_t>slot_mr.addr
        self.keep = [cq, cq.channel, slot_mr, header_mr]
        self._init_common(rank, size, slots, slot_stride, max_message, sq_depth, timeout, spin)
        if slot_mr.length < (size - 1) * slots * slot_stride or header_mr.length < (size - 1) * slots * C_HEADER_ROOM:
            raise UsageError("Engine: the slot or header region is too small")
        # a mailbox per peer after the slots, and a staging room per peer after the headers: the
        # regions carry them when rendezvous is wanted (the transport makes them so on every rank)
        self.mailboxes = slot_mr.length >= (size - 1) * (slots * slot_stride + C_HEADER_ROOM) and \
            header_mr.length >= (size - 1) * (slots + 1) * C_HEADER_ROOM
        self.rendezvous_bytes = rendezvous_bytes
        self.max_inline = max_inline
        i = 0
        for p in range(size):
            if p == rank:
                continue
            qp = qps[p]
            if not isinstance(qp, QueuePair):
                raise UsageError(f"Engine: qps[{p}] is not a QueuePair")
            self.keep.append(qp)
            self.peers[p].qp = (<QueuePair>qp).qp
            self.peers[p].remote = remotes[p][0]
            self.peers[p].rkey = remotes[p][1]
            self.peers[p].slots = <uint8_t *><uintptr_t>slot_mr.addr + <size_t>i * slots * slot_stride
            self.peers[p].headers = <uint8_t *><uintptr_t>header_mr.addr + <size_t>i * slots * C_HEADER_ROOM
            if self.mailboxes:
                # the peer orders its peers by rank, skipping itself, as we do
                their = rank if rank < p else rank - 1
                self.peers[p].mailbox = <uint8_t *><uintptr_t>slot_mr.addr + <size_t>(size - 1) * slots * slot_stride \
                    + <size_t>i * C_HEADER_ROOM
                self.peers[p].remote_mailbox = <uint64_t>remotes[p][0] - <uint64_t>their * slots * slot_stride \
                    + <uint64_t>(size - 1) * slots * slot_stride + <uint64_t>their * C_HEADER_ROOM
                self.peers[p].cts_staging = <uint8_t *><uintptr_t>header_mr.addr \
                    + <size_t>(size - 1) * slots * C_HEADER_ROOM + <size_t>i * C_HEADER_ROOM
            i += 1

    @staticmethod
    def over_sockets(list fds, slots_memory, int rank, int size, int slots, int slot_stride, int max_message,
                     double timeout, double spin):
        """The socket link (TcpTransport's engine): ``fds[p]`` the descriptor of a connected stream
        socket to rank p (-1 at ``rank``), kept open by the caller while the engine lives; the
        receive slots in ``slots_memory`` (writable bytes, (size - 1) * slots * slot_stride or more:
        peer p's at its index among the peers times slots * slot_stride, as on the verbs link).
        The protocol is the verbs link's, a frame per message: the 32-bit immediate (network
        order), then for data the 48-byte header and the payload, which land in the slot as a
        WRITE_WITH_IMM would put them. No rendezvous and no RDMA READ (OFFER/FETCH) here."""
        cdef Engine e = Engine.__new__(Engine)
        cdef uint8_t[::1] mem = slots_memory
        cdef int p, i = 0
        if len(fds) != size:
            raise UsageError("Engine: fds must have one entry per rank")
        e.keep = []
        e._init_common(rank, size, slots, slot_stride, max_message, 2 * slots + 8, timeout, spin)
        if mem.shape[0] < (size - 1) * slots * slot_stride:
            raise UsageError("Engine: the slot memory is too small")
        e.sockets = True
        # a pass over the sockets is a system call per peer anyway, and a spin that never yields
        # starves the peer it waits for wherever another process takes a core (2 ranks beside a
        # busy process on 2 cores: 3.8 ms per 8-byte allreduce, a scheduler tick, against 0.37 ms)
        e.spin_yields = True
        e.slot_owner = slots_memory
        e.slot_base = &mem[0] if mem.shape[0] else NULL
        e.pfds = <pollfd *>calloc(size, sizeof(pollfd))
        if e.pfds == NULL:
            raise MemoryError()
        for p in range(size):
            if p == rank:
                continue
            if not isinstance(fds[p], int) or fds[p] < 0:
                raise UsageError(f"Engine: fds[{p}] is not a file descriptor")
            e.peers[p].fd = fds[p]
            e.peers[p].slots = e.slot_base + <size_t>i * slots * slot_stride
            e.peers[p].txq = <txframe_t *>calloc(e.sq_depth, sizeof(txframe_t))
            e.peers[p].rx = <uint8_t *>malloc(RXBUF)
            if e.peers[p].txq == NULL or e.peers[p].rx == NULL:
                raise MemoryError()
            e.peers[p].rx_state, e.peers[p].rx_dst, e.peers[p].rx_need = RX_IMM, e.peers[p].rx_imm, 4
            i += 1
        return e

    cdef int _init_common(self, int rank, int size, int slots, int slot_stride, int max_message, int sq_depth,
                          double timeout, double spin) except -1:
        cdef int p
        if not 0 <= rank < size:
            raise UsageError(f"Engine: rank {rank} is not within a world of {size}")
        if slots < 1 or slot_stride < C_HEADER_ROOM + max_message or sq_depth < 3 or max_message > <int>LEN_MASK:
            raise UsageError("Engine: inconsistent slot geometry")
        self.rank, self.size, self.slots, self.slot_stride = rank, size, slots, slot_stride
        self.max_message, self.sq_depth = max_message, sq_depth
        self.credit_batch = max(1, slots // 2)
        self.signal_every = max(1, sq_depth // 4)
        self.timeout, self.spin = timeout, spin
        self.spin_adaptive = spin
        self.probe_lead = min(1.0, timeout / 4)
        self.rdv_peer = -1
        self.post_peer = -1
        self.exp_peer = -1
        self.peers = <peer_t *>calloc(size, sizeof(peer_t))
        self.queried = <uint8_t *>calloc(size, 1)
        self.visited = <uint8_t *>calloc(size, 1)
        self.spread_done = <int *>calloc(2 * size, sizeof(int))
        if self.peers == NULL or self.queried == NULL or self.visited == NULL or self.spread_done == NULL:
            raise MemoryError()
        for p in range(size):
            self.peers[p].report = -1
            self.peers[p].fd = -1
            if p == rank:
                continue
            self.peers[p].credits = slots
            self.peers[p].arrivals = <uint32_t *>calloc(slots, sizeof(uint32_t))
            if self.peers[p].arrivals == NULL:
                raise MemoryError()
        self.waiting_on = -1
        self.consume = None
        self.spin_yields = self.crowded = size > sysconf(_SC_NPROCESSORS_ONLN)
        self._by_address_bytes = INT64_MAX
        self.live = 1
        return 0

    def __dealloc__(self):
        cdef int p, c
        cdef kept_t *k
        if self.peers != NULL:
            for p in range(self.size):
                free(self.peers[p].arrivals)
                free(self.peers[p].taken)
                if self.peers[p].txq != NULL:
                    for c in range(self.sq_depth):
                        free(self.peers[p].txq[c].owned)
                free(self.peers[p].txq)
                free(self.peers[p].rx)
                for c in range(2):
                    while self.peers[p].kept[c] != NULL:
                        k = self.peers[p].kept[c]
                        self.peers[p].kept[c] = k.next
                        free(k)
            free(self.peers)
        free(self.queried)
        free(self.visited)
        free(self.spread_done)
        free(self.pfds)

    # ---- Python-level ---------------------------------------------------------------------------

    def interrupt(self):
        """Make the running (and every later) wait fail with FAIL_CLOSED within CLOSE_POLL seconds."""
        pyrdma_store_flag(&self.closing, 1)

    def failure(self):
        """None, or (kind, peer, what, a, b, description bytes) of the failure that stopped a run."""
        if self.fail_kind == FAIL_NONE:
            return None
        return (self.fail_kind, self.fail_peer, self.fail_what, self.fail_a, self.fail_b,
                bytes((<char *>self.fail_desc)[:DESC_SIZE]))

    def python_error(self):
        """The exception a callback or signal handler raised in the last run (None if none)."""
        return self.py_error

    def reports(self):
        """{peer: the rank it said it waits for}, from the last wait's queries."""
        return {p: self.peers[p].report for p in range(self.size) if p != self.rank and self.peers[p].report >= 0}

    def state(self, int peer):
        """The flow-control counters of ``peer`` (for tests and diagnosis)."""
        self._check_peer(peer)
        cdef peer_t *q = &self.peers[peer]
        return dict(credits=q.credits, unreturned=q.unreturned, send_seq=q.send_seq, recv_seq=q.recv_seq,
                    outstanding=q.outstanding, data_outstanding=q.data_outstanding, arrivals=q.arr_count,
                    pid=q.pid, addresses_to=q.addresses_to, unread=q.unread)

    def by_address(self, int peer, int pid, bint reads_ours):
        """The socket link, ``peer`` on this machine (TcpTransport checks it): read its address
        frames out of process ``pid`` (0: it sends none), and (``reads_ours``: it can read this
        process) send it payloads of at least ``by_address_bytes`` as address frames."""
        self._check_peer(peer)
        if not self.sockets:
            raise UsageError("Engine.by_address: the socket link only")
        self.peers[peer].pid, self.peers[peer].addresses_to = pid, reads_ours

    @property
    def by_address_bytes(self):
        """The least payload sent as an address frame to a peer that by_address() allows (none
        until set)."""
        return self._by_address_bytes

    @by_address_bytes.setter
    def by_address_bytes(self, int64_t nbytes):
        # (a frame whose payload is as long as an address frame's and says so is plain data: an
        # address frame is never that)
        if nbytes < 32:
            raise UsageError(f"Engine.by_address_bytes must be at least 32, got {nbytes}")
        self._by_address_bytes = nbytes

    cdef int _check_peer(self, int peer) except -1:
        if not 0 <= peer < self.size or peer == self.rank:
            raise UsageError(f"rank {peer} is not a peer of rank {self.rank} (size {self.size})")
        return 0

    def post_control(self, int peer, uint32_t imm):
        """A zero-byte message outside flow control (abort, query); dropped when the send queue is
        full or the post fails: best effort."""
        cdef int rc
        cdef double end
        cdef pollfd pfd
        self._check_peer(peer)
        if self.sockets:
            # written before returning (no run will flush it): a short wait for the socket's room
            with nogil:
                rc = self._post_empty(peer, imm)
                end = monotonic_now() + 0.5
                while rc == 0 and self.peers[peer].outstanding and not self.peers[peer].gone:
                    if self._sock_flush(peer) < 0 or monotonic_now() >= end:
                        break
                    if self.peers[peer].outstanding:
                        pfd.fd, pfd.events, pfd.revents = self.peers[peer].fd, POLLOUT, 0
                        poll(&pfd, 1, 50)
            return rc == 0
        for obj in self.keep:
            if (<VerbsObject>obj)._closed or (<VerbsObject>obj)._closing:
                return False
        return self._post_empty(peer, imm) == 0

    def program(self, schedule):
        """The Program of a schedule (pyrdma.collectives.schedule.Schedule) for this engine's rank,
        size and max_message: checked once, then kept on the schedule (its ``program`` slot) so
        that every later run of the same cached plan skips the check."""
        cdef Program prog = getattr(schedule, "program", None)
        if prog is not None and prog.rank == self.rank and prog.size == self.size \
                and prog.max_message == self.max_message:
            return prog
        prog = Program.__new__(Program)
        prog._check(self.rank, self.size, self.max_message, schedule.steps, schedule.chunks)
        self._runs_here(prog)
        try:
            schedule.program = prog
        except AttributeError:
            pass
        return prog

    def parked(self):
        """The peer of the rendezvous send a run left pending (run's ``park``), -1: none."""
        return self.rdv_peer

    def settle(self, int peer, bint background=False, bint newest=True):
        """Finish a rendezvous send to ``peer`` that a run left pending: wait for the receiver's
        answer (``newest``: it is the last one parked, which may still wait for it), write the
        message, and wait until the writes are done (its memory is the caller's again). Returns 0;
        on failure the failure kind, as run()."""
        cdef int rc = 0
        self._check_peer(peer)
        if self.fail_kind != FAIL_NONE:
            return self.fail_kind
        self._hold(background)
        try:
            with nogil:
                if newest and self.rdv_peer == peer:
                    rc = self._wait(WAIT_CTS, peer, self.rdv_len)
                if rc == 0 and self.peers[peer].data_outstanding:
                    rc = self._wait(WAIT_SENDS_DONE, peer, 0)
        finally:
            self._let_go()
        return self.fail_kind if rc < 0 else 0

    def drain(self, double seconds=0.0):
        """Wait until the sends of earlier runs have completed (a run of the one-call path returns
        without waiting for its sends from the transport's own buffer: defer_sends), before that
        buffer is written or let go. ``seconds`` > 0: at most that long instead of the timeout.
        Returns 0; on failure the failure kind, as run()."""
        cdef int rc = 0
        cdef double timeout = self.timeout
        if self.fail_kind != FAIL_NONE:
            return self.fail_kind
        if not self._sends_pending():
            return 0
        self._hold(False)
        if seconds > 0:
            self.timeout = min(seconds, timeout)
        try:
            with nogil:
                rc = self._drain()
        finally:
            self.timeout = timeout
            self._let_go()
        return self.fail_kind if rc < 0 else 0

    def description(self):
        """The description the last run expected its received messages to carry."""
        return bytes((<char *>self.rdesc)[:DESC_SIZE])

    def run(self, Program program not None, uint64_t work_addr, int64_t work_len, uint32_t work_lkey,
            bytes desc not None, int dtype, int op, consume=None, bint background=False, bytes recv_desc=None,
            uint32_t work_rkey=0, bint park=False, uint64_t out_addr=0, int64_t out_len=-1, uint32_t out_lkey=0,
            uint32_t out_rkey=0):
        """Execute a Program (see program()) on the work area [work_addr, + work_len) (registered
        with work_lkey). ``dtype``/``op``: pyrdma._reduce codes of the reductions. ``consume``: None
        (host memory: reductions and copies in C), or ``consume(kind, offset, nbytes, aux,
        slot_offset)`` called with the GIL for every received chunk (GPU memory). ``background``:
        the run overlaps the caller's work (a non-blocking collective), so it sleeps on the
        completion channel as soon as there is nothing to do instead of spinning first: the CPU
        goes to the caller's compute. ``recv_desc``: the description received messages must carry
        when it differs from the one sent (point-to-point). ``work_rkey``: the work area's remote
        key when it takes RDMA writes (a rendezvous receive is written there; 0: it does not, and a
        rendezvous message to it fails). ``park``: a rendezvous send this run begins may stay
        pending when the run ends (an isend, whose memory stays the caller's until its wait: later
        runs write it once the receiver answers, settle() finishes it; ``parks`` counts them).
        ``out_addr``/``out_len``/``out_lkey``: a second work area (out_len >= 0; host memory, no
        rendezvous or RDMA READ into it; ``out_rkey``: its remote key where a peer's PUT writes
        there, else 0), where the offsets from work_len on lie: an all-to-all sends from the
        caller's buffer and receives into its output in place.
        Returns 0; on failure returns the failure kind (see failure() and python_error()), leaving
        the error to the caller."""
        cdef int rc
        if recv_desc is None:
            recv_desc = desc
        if len(desc) != DESC_SIZE or len(recv_desc) != DESC_SIZE:
            raise UsageError(f"a description has {DESC_SIZE} bytes, got {len(desc)}")
        if self.fail_kind != FAIL_NONE:
            return self.fail_kind
        memcpy(self.rdesc, <const uint8_t *><char *>recv_desc, DESC_SIZE)
        if out_len >= 0 and consume is not None:
            raise UsageError("a second work area is host memory (no consume callback)")
        self._begin(program, work_addr, work_len + max(out_len, 0), work_lkey, <const uint8_t *><char *>desc, dtype,
                    op, consume, background, work_rkey)
        if out_len >= 0:
            self._second_area(work_len, out_addr, out_lkey, out_rkey)
        self.park = park
        try:
            with nogil:
                rc = self._execute(program.steps, program.nsteps, program.chunks)
        finally:
            self._end()
        return self.fail_kind if rc < 0 else 0

    cdef int _runs_here(self, Program prog) except -1:
        if self.sockets and prog.writes:
            raise UsageError("the schedule writes into a peer's memory (ASK, PUT): the socket link has no "
                             "remote writes; an RDMA transport runs it")
        return 0

    cdef int _begin(self, Program prog, uint64_t work_addr, int64_t work_len, uint32_t work_lkey,
                    const uint8_t *desc, int dtype, int op, object consume, bint background=False,
                    uint32_t work_rkey=0) except -1:
        """Check a run's arguments against the program, then hold the verbs objects (a close()
        elsewhere waits for _end)."""
        if not 0 <= dtype < 8 or not 0 <= op < 4:
            raise UsageError(f"bad reduction codes dtype={dtype} op={op}")
        if prog.rank != self.rank or prog.size != self.size or prog.max_message != self.max_message:
            raise UsageError("the program was checked for another rank, size or max_message")
        self._runs_here(prog)
        if work_len < prog.extent:
            raise UsageError(f"the schedule reaches byte {prog.extent} of a {work_len}-byte work area")
        if consume is None and prog.reduce_align % <int64_t>pyrdma_itemsize[dtype] != 0:
            raise UsageError(f"the schedule reduces chunks that are not whole {pyrdma_itemsize[dtype]}-byte elements")
        self.dtype, self.op, self.itemsize = dtype, op, <int>pyrdma_itemsize[dtype]
        memcpy(self.desc, desc, DESC_SIZE)
        memcpy(self.placed_desc, desc, DESC_SIZE)
        self.placed_desc[DESC_PLACED_AT] = 1
        self.work, self.work_len, self.work_lkey = <uint8_t *><uintptr_t>work_addr, work_len, work_lkey
        self.work2, self.split, self.work2_lkey, self.work2_rkey = NULL, INT64_MAX, 0, 0
        self.work_rkey = work_rkey
        self.park = self.defer_sends = False
        self.consume = consume
        self.py_error = None
        try:
            self._hold(background)
        except BaseException:
            self.consume = None
            raise
        return 0

    cdef int _hold(self, bint background) except -1:
        """Before a run or a wait outside one (settle, drain): hold the verbs objects (a close()
        elsewhere waits for _let_go), and set how its waits spin and whether they run signal
        handlers."""
        cdef int i, used = 0
        try:
            for i in range(len(self.keep)):
                use(<VerbsObject>self.keep[i])
                used += 1
        except BaseException:
            for i in range(used):
                unuse(<VerbsObject>self.keep[i])
            raise
        self.spin_now = 0.0 if background else self.spin_adaptive
        self.in_background = background
        # only the main thread runs signal handlers: elsewhere a wait never takes the GIL for them
        self.signals = PyThread_get_thread_ident() == _main_thread
        return 0

    cdef void _let_go(self) noexcept:
        cdef int i
        for i in range(len(self.keep)):
            unuse(<VerbsObject>self.keep[i])

    cdef void _second_area(self, int64_t split, uint64_t addr, uint32_t lkey, uint32_t rkey) noexcept:
        """After _begin (whose work_len counted both): the offsets from ``split`` on lie in a second
        work area at ``addr`` (host memory, registered with ``lkey``; ``rkey``: its remote key for
        a peer's PUT, 0: none)."""
        self.work_len, self.split = split, split
        self.work2, self.work2_lkey, self.work2_rkey = <uint8_t *><uintptr_t>addr, lkey, rkey

    cdef bint _sends_pending(self) noexcept nogil:
        cdef int p
        for p in range(self.size):
            if p != self.rank and self.peers[p].data_outstanding:
                return True
        return False

    cdef int _drain(self) noexcept nogil:
        """Wait (in a run, or drain()) until every send posted so far has completed: those of a
        run that deferred the wait (defer_sends) read the memory about to be written."""
        cdef int p
        for p in range(self.size):
            if p != self.rank and self.peers[p].data_outstanding and self._wait(WAIT_SENDS_DONE, p, 0) < 0:
                return -1
        return 0

    cdef void _end(self) noexcept:
        cdef int i
        cdef peer_t *p
        cdef txframe_t *f
        self._let_go()
        self.post_peer = self.exp_peer = -1
        if self.sockets:
            # a payload read straight into this run's memory (the caller's, maybe) that the run did
            # not take (it failed): the rest of it goes to its slot, never after the run
            for i in range(self.size):
                p = &self.peers[i]
                if p.rx_direct:
                    p.rx_dst = self._slot(p, p.recv_seq + <uint64_t>p.arr_count) + C_HEADER_ROOM
                p.rx_direct = p.directed = 0
        if self.sockets and self.fail_kind != FAIL_NONE:
            with nogil:
                self._settle_reads()
            # what our unread frames point to is the caller's again from here on
            pyrdma_bump_word(&self.live)
            # a failed run's frames are not written: their payloads may be the caller's memory, freed
            # once it returns. One already begun is finished from a copy, so that the stream stays
            # in step for the abort behind it (without memory for the copy: no more to that peer).
            for i in range(self.size):
                p = &self.peers[i]
                if i == self.rank or not p.outstanding:
                    continue
                f = &p.txq[p.tx_head]
                p.outstanding = p.data_outstanding = p.unread = 0
                if f.done:
                    if f.length and f.owned == NULL:
                        f.owned = <uint8_t *>malloc(f.length)
                        if f.owned == NULL:
                            p.gone = 1
                            continue
                        memcpy(f.owned, <void *><uintptr_t>f.addr, f.length)
                        f.addr = <uint64_t><uintptr_t>f.owned
                    p.outstanding, p.data_outstanding = 1, f.data
        self.consume = None
        self.runs += 1

    cdef void _settle_reads(self) noexcept nogil:
        """A failed run on the socket link: let the peers read the address frames they have (the
        memory they point into is released once the run returns), for at most SETTLE_READS: a
        peer that is alive reads them at its next wait; the rest (the failure's culprit, maybe) are
        not waited for."""
        cdef double end = monotonic_now() + SETTLE_READS
        cdef int q
        cdef bint unread = True
        while unread and monotonic_now() < end:
            unread = False
            for q in range(self.size):
                if q != self.rank and self.peers[q].unread and not self.peers[q].gone:
                    unread = True
            if unread:
                self._sock_pass()                   # (-1 after the failure; it reads all the same)
                sched_yield()

    # ---- the engine (no GIL) ----------------------------------------------------------------------

    cdef int _fail(self, int kind, int peer, int64_t a, int64_t b) noexcept nogil:
        if self.fail_kind == FAIL_NONE:
            self.fail_kind, self.fail_peer, self.fail_a, self.fail_b = kind, peer, a, b
        return -1

    cdef int _execute(self, const int64_t *steps, Py_ssize_t nsteps, const int64_t *chunks) noexcept nogil:
        cdef Py_ssize_t s = -1
        cdef const int64_t *st
        cdef int p, count
        while s + 1 < nsteps:
            s += 1
            st = steps + s * STEP_COLUMNS
            if st[0] == SPREAD:
                count = 1
                while s + count < nsteps and st[count * STEP_COLUMNS] == SPREAD:
                    count += 1
                if self._spread(st, count, chunks) < 0:
                    return -1
                s += count - 1
                continue
            if st[0] == WAIT_SENDS:
                if self.defer_sends and s == nsteps - 1:
                    continue
                for p in range(self.size):
                    if p != self.rank and (st[1] == -1 or st[1] == p) and self.peers[p].data_outstanding:
                        if self._wait(WAIT_SENDS_DONE, p, 0) < 0:
                            return -1
                continue
            if self.sockets and (st[0] == OFFER or st[0] == FETCH):
                # no RDMA READ on sockets: an offer is the send of its chunks, a fetch their receive
                if self._exchange(<int>st[1], chunks + st[3] * CHUNK_COLUMNS, <int>st[4] if st[0] == OFFER else 0,
                                  <int>st[2], chunks + st[5] * CHUNK_COLUMNS, <int>st[6] if st[0] == FETCH else 0,
                                  CONSUME_COPY) < 0:
                    return -1
                continue
            if st[0] == OFFER:
                if self._tell_chunks(<int>st[1], chunks + st[3] * CHUNK_COLUMNS, <int>st[4]) < 0:
                    return -1
                continue
            if st[0] == ASK:
                if self._tell_chunks(<int>st[2], chunks + st[5] * CHUNK_COLUMNS, <int>st[6]) < 0:
                    return -1
                continue
            if st[0] == PUT:
                if self._put(<int>st[1], chunks + st[3] * CHUNK_COLUMNS, <int>st[4]) < 0:
                    return -1
                continue
            if st[0] == NOTICE:
                if self._send_from(<int>st[1], <uint64_t><uintptr_t>self.work, self.work_lkey, 0, self.placed_desc) < 0:
                    return -1
                continue
            if st[0] == LANDED:                     # a NOTICE: behind a PUT, its chunks are in place
                if self._recv(<int>st[2], 0, False, NULL, True) == NULL or self._release(<int>st[2]) < 0:
                    return -1
                continue
            if st[0] == FETCH:
                if self._fetch(<int>st[2], chunks + st[5] * CHUNK_COLUMNS, <int>st[6]) < 0:
                    return -1
                continue
            if self._exchange(<int>st[1], chunks + st[3] * CHUNK_COLUMNS, <int>st[4],
                              <int>st[2], chunks + st[5] * CHUNK_COLUMNS, <int>st[6], <int>st[7]) < 0:
                return -1
        return 0

    cdef int _execute_holding_gil(self, Program prog) noexcept:
        """_execute, called with the GIL, which the first wait releases (nothing else in a run
        touches Python objects: signal handlers and callbacks take the GIL as they would anyway);
        the GIL is held again on return."""
        cdef int rc
        self.hold_gil = True
        rc = self._execute(prog.steps, prog.nsteps, prog.chunks)
        self.hold_gil = False
        if self.released != NULL:
            PyEval_RestoreThread(self.released)
            self.released = NULL
        return rc

    cdef int _spread(self, const int64_t *steps, int count, const int64_t *chunks) noexcept nogil:
        """``count`` SPREAD steps (at most size - 1) at once: each is an exchange, and every one's
        chunks go out as its peer's credits allow and come in as they arrive, whichever peer is
        ready first, instead of one peer after another (an all-to-all's blocks in flight to every
        peer together, as NCCL and UCX post them). A wait ends at any step's arrival or credit, so
        ranks whose spreads list their peers in different orders never wait on one another."""
        cdef int j, moved, left, peer, rc
        cdef int *sent = self.spread_done
        cdef int *got = self.spread_done + self.size
        cdef const int64_t *st
        cdef const int64_t *c
        cdef uint8_t *data
        for j in range(count):
            sent[j] = got[j] = 0
        self.spread_steps, self.spread_count = steps, count
        while True:
            moved = left = 0
            peer = -1
            for j in range(count):
                st = steps + j * STEP_COLUMNS
                while sent[j] < st[4] and self._can_send(<int>st[1]):
                    c = chunks + (st[3] + sent[j]) * CHUNK_COLUMNS
                    if self._send(<int>st[1], c[0], c[1]) < 0:
                        return -1
                    sent[j] += 1
                    moved += 1
                while got[j] < st[6]:
                    rc = self._arrived(<int>st[2])
                    if rc < 0:
                        return -1
                    if rc == 0:
                        break
                    c = chunks + (st[5] + got[j]) * CHUNK_COLUMNS
                    data = self._recv(<int>st[2], c[1], False, NULL)
                    if data == NULL or self._consume(<int>st[7], c, data) < 0 or self._release(<int>st[2]) < 0:
                        return -1
                    got[j] += 1
                    moved += 1
                if got[j] < st[6]:
                    left += 1
                    if peer < 0:
                        peer = <int>st[2]
                elif sent[j] < st[4]:
                    left += 1
                    if peer < 0:
                        peer = <int>st[1]
            if left == 0:
                self.spread_count = 0
                return 0
            if moved == 0 and self._wait(WAIT_SPREAD, peer, 0) < 0:
                self.spread_count = 0
                return -1

    cdef int _arrived(self, int peer) noexcept nogil:
        """1: _recv would take a message of the running collective from ``peer`` without waiting;
        0: none yet (a point-to-point message ahead of it is kept for its receive, as _recv would);
        -1: failure."""
        cdef peer_t *p = &self.peers[peer]
        cdef uint8_t *start
        if p.kept[0] != NULL:
            return 1
        while p.arr_count > 0:
            start = self._slot(p, p.recv_seq)
            if start[DESC_KIND_AT] != DESC_KIND_SEND:
                return 1
            if self._keep_head(peer) < 0:
                return -1
        return 0

    cdef uint8_t *_slot(self, peer_t *p, uint64_t seq) noexcept nogil:
        """The start of the slot of ``p``'s message number ``seq`` (the header, the payload from
        C_HEADER_ROOM on)."""
        return p.slots + (seq % <uint64_t>self.slots) * self.slot_stride

    cdef uint8_t *_take_head(self, peer_t *p, uint32_t *got) noexcept nogil:
        """Take ``p``'s first arrival: the start of its slot; ``got``: the payload's length."""
        cdef uint8_t *start = self._slot(p, p.recv_seq)
        got[0] = p.arrivals[p.arr_head]
        p.arr_head = (p.arr_head + 1) % self.slots
        p.arr_count -= 1
        p.recv_seq += 1
        return start

    cdef int _keep_head(self, int peer) noexcept nogil:
        """Keep ``peer``'s first arrival for its own receive (_keep) and return its slot."""
        cdef uint32_t got
        cdef uint8_t *start = self._take_head(&self.peers[peer], &got)
        if self._keep(&self.peers[peer], start, got) < 0:
            return -1
        return self._return_slot(peer)

    cdef int _exchange(self, int sp, const int64_t *sch, int ns, int rp, const int64_t *rch, int nr,
                       int ck) noexcept nogil:
        """Send ns chunks to sp while receiving nr from rp; sends run up to ``slots`` chunks ahead
        of the consumption of received ones, so that transfers overlap it, as many as the credits
        allow without waiting. Chunk k+1 is always out before chunk k+1 is awaited, but one that
        has to wait for a credit goes only after chunk k is released: otherwise, with one slot per
        peer, every rank of a ring (or both sides of an exchange) would wait for a credit that its
        neighbour returns only after its own blocked send. A step's send chunks must not depend on
        its received ones (they may leave first). tests/flowmodel.py models this order."""
        cdef int sent = 0, k, last
        cdef uint8_t *data
        if ck == CONSUME_COPY_UPTO:
            return self._exchange_message(sp, sch, ns, rp, rch, nr)
        if ns == 1 and nr == 1:
            self._expect(rp, ck, rch, 0, 1)
            if self._send(sp, sch[0], sch[1]) < 0:
                return -1
            data = self._recv(rp, rch[1], False, self._dst(ck, rch))
            self.exp_peer = -1
            if data == NULL or self._consume(ck, rch, data) < 0:
                return -1
            return self._release(rp)
        if nr:
            self._expect(rp, ck, rch, 0, nr)
        if ns:
            if self._send(sp, sch[0], sch[1]) < 0:
                return -1
            sent = 1
        last = ns if ns > nr else nr
        for k in range(last):
            if k < nr:
                self._expect(rp, ck, rch, k, nr)
            if self._send_ahead(sp, sch, ns, &sent, k) < 0:
                return -1
            if k < nr:
                data = self._recv(rp, rch[k * CHUNK_COLUMNS + 1], False, self._dst(ck, rch + k * CHUNK_COLUMNS))
                if data == NULL or self._send_ahead(sp, sch, ns, &sent, k) < 0:
                    return -1
                if self._consume(ck, rch + k * CHUNK_COLUMNS, data) < 0 or self._release(rp) < 0:
                    return -1
            if sent < ns and sent < k + 2:
                if self._send(sp, sch[sent * CHUNK_COLUMNS], sch[sent * CHUNK_COLUMNS + 1]) < 0:
                    return -1
                sent += 1
        self.exp_peer = -1
        return 0

    cdef void _expect(self, int peer, int ck, const int64_t *chunks, int k, int count) noexcept nogil:
        """On the socket link: the chunks k.. of ``count`` that the exchange receives from ``peer``
        are read straight into their places (_sock_piece), not into slots to be copied out, from
        now on: said once, where the next message from ``peer`` can only be chunk k (none arrived
        and not taken, none kept, none being read)."""
        cdef peer_t *p = &self.peers[peer]
        if not self.sockets or self.exp_peer == peer or p.arr_count or p.kept[0] != NULL \
                or p.rx_state == RX_PAYLOAD or self._dst(ck, chunks) == NULL:
            return
        self.exp_peer, self.exp_chunks, self.exp_next, self.exp_count, self.exp_ck = peer, chunks, k, count, ck

    cdef int _exchange_message(self, int sp, const int64_t *sch, int ns, int rp, const int64_t *rch,
                               int nr) noexcept nogil:
        """_exchange whose receive is one point-to-point message of at most the chunks' total length:
        its first header says how long it is (the description's count), and the receive ends with
        its last chunk. ``received`` holds its length afterwards.
        A send of rendezvous_bytes or more goes by rendezvous: a header alone (RTS), then, once the
        receiver has written its buffer's address into our mailbox (CTS), RDMA WRITEs straight into
        that buffer and a second header (FIN) behind them. The writes go from whichever wait sees
        the CTS (_progress), so two ranks that send to each other this way never wait on each other."""
        cdef int sent = 0, k, last
        cdef bint rts, began = False
        cdef uint8_t *data
        cdef int64_t total = 0, capacity = 0, got = 0, send_len = 0
        for k in range(nr):
            capacity += rch[k * CHUNK_COLUMNS + 1]
        for k in range(ns):
            send_len += sch[k * CHUNK_COLUMNS + 1]
        # one rendezvous send at a time: while one is parked, the others go through the slots
        # (from the first work area only: a second one has no remote key)
        if ns and self.rendezvous_bytes > 0 and self.mailboxes and send_len >= self.rendezvous_bytes \
                and self.rdv_peer < 0 and sch[0] + send_len <= self.work_len:
            if self._send(sp, sch[0], 0) < 0:            # the RTS: its description's count is the length
                return -1
            self.rdv_peer, self.rdv_len, began = sp, send_len, True
            self.rdv_addr, self.rdv_lkey = <uint64_t><uintptr_t>(self.work + sch[0]), self.work_lkey
            memcpy(self.rdv_desc, self.desc, DESC_SIZE)
            ns = 0
        elif ns:
            if self._send(sp, sch[0], sch[1]) < 0:
                return -1
            sent = 1
        last = ns if ns > nr else nr
        for k in range(last):
            if self._send_ahead(sp, sch, ns, &sent, k) < 0:
                return -1
            if k < nr:
                data = self._recv(rp, rch[k * CHUNK_COLUMNS + 1], True,
                                  self._dst(CONSUME_COPY, rch + k * CHUNK_COLUMNS))
                if data == NULL:
                    return -1
                if k == 0:
                    total = <int64_t>self.last_count
                rts = k == 0 and self.last_length == 0 and total > 0
                # every chunk but the last is full, and the message fits the receive's chunks
                if total > capacity or (not rts and (got + self.last_length > total or (
                        self.last_length < rch[k * CHUNK_COLUMNS + 1] and got + self.last_length != total))):
                    memcpy(self.fail_desc, self.rdesc, DESC_SIZE)
                    memcpy(self.fail_desc + 8, &total, 8)
                    return self._fail(FAIL_MISMATCH, rp, total, capacity)
                if self._send_ahead(sp, sch, ns, &sent, k) < 0:
                    return -1
                if rts:
                    if self._rendezvous_receive(rp, rch[0], total) < 0:
                        return -1
                    got = total
                else:
                    if self.last_length:
                        if self.consume is not None:
                            if self._callback(CONSUME_COPY, rch[k * CHUNK_COLUMNS], self.last_length, 0, data) < 0:
                                return -1
                        elif data != self._at(rch[k * CHUNK_COLUMNS]):      # (else read straight there)
                            memcpy(self._at(rch[k * CHUNK_COLUMNS]), data, self.last_length)
                    got += self.last_length
                    if self._release(rp) < 0:
                        return -1
                if got == total:
                    nr = k + 1                      # the message is complete: no more chunks from rp
            if sent < ns and sent < k + 2:
                if self._send(sp, sch[sent * CHUNK_COLUMNS], sch[sent * CHUNK_COLUMNS + 1]) < 0:
                    return -1
                sent += 1
        if began and self.rdv_peer >= 0:
            if self.park:
                self.parks += 1
            elif self._wait(WAIT_CTS, sp, send_len) < 0:
                return -1
        self.received = got
        return 0

    cdef int _rendezvous_receive(self, int peer, int64_t off, int64_t total) noexcept nogil:
        """After the RTS of ``total`` bytes from ``peer``: tell it where to write (the work area at
        ``off``), then wait for its FIN."""
        cdef peer_t *p = &self.peers[peer]
        cdef uint64_t addr = <uint64_t><uintptr_t>(self.work + off)
        cdef ibv_sge sge
        cdef ibv_send_wr wr
        cdef ibv_send_wr *bad = NULL
        if self.work_rkey == 0 or self.consume is not None or p.mailbox == NULL or off + total > self.work_len:
            return self._fail(FAIL_MALFORMED, peer, total, 1)   # no remote access here: never asked for
        if self._release(peer) < 0:                             # the RTS's slot
            return -1
        if p.outstanding >= self.sq_depth and self._wait(WAIT_SEND_QUEUE, peer, 0) < 0:
            return -1
        memcpy(p.cts_staging, &addr, 8)
        memcpy(p.cts_staging + 8, &self.work_rkey, 4)
        memset(&wr, 0, sizeof(wr))
        sge.addr, sge.length, sge.lkey = <uint64_t><uintptr_t>p.cts_staging, 16, self.header_lkey
        wr.sg_list, wr.num_sge = &sge, 1
        wr.wr_id = <uint64_t>peer << 2
        wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM
        wr.send_flags = IBV_SEND_SIGNALED
        wr.imm_data = htonl((KIND_CONTROL << 30) | (CTRL_CTS << 28))
        wr.wr.rdma.remote_addr, wr.wr.rdma.rkey = p.remote_mailbox, p.rkey
        if ibv_post_send(p.qp, &wr, &bad):
            return self._fail(FAIL_POST, peer, errno, 0)
        p.outstanding += 1
        if self._recv(peer, 0, True) == NULL:                   # the FIN: a header alone
            return -1
        if self.last_length != 0 or <int64_t>self.last_count != total:
            memcpy(self.fail_desc, self.rdesc, DESC_SIZE)
            return self._fail(FAIL_MISMATCH, peer, <int64_t>self.last_count, total)
        return self._release(peer)

    cdef int _rendezvous_write(self) noexcept nogil:
        """The WRITEs and the FIN of the pending rendezvous send once its CTS is in; they wait (0)
        while the peer has no credit or the send queue no room for them."""
        cdef int peer = self.rdv_peer
        cdef peer_t *p = &self.peers[peer]
        cdef uint64_t addr
        cdef uint32_t rkey
        cdef int64_t done = 0, n
        cdef int nwr = <int>((self.rdv_len + RDV_MAX_WRITE - 1) // RDV_MAX_WRITE)
        if not p.cts or not self._can_send(peer) or p.outstanding + nwr + 1 > self.sq_depth:
            return 0
        memcpy(&addr, p.mailbox, 8)
        memcpy(&rkey, p.mailbox + 8, 4)
        p.cts = 0
        while done < self.rdv_len:
            n = min(<int64_t>RDV_MAX_WRITE, self.rdv_len - done)
            if self._post_rdma(peer, IBV_WR_RDMA_WRITE, self.rdv_addr + <uint64_t>done, self.rdv_lkey,
                               addr + <uint64_t>done, rkey, n) < 0:
                return -1
            done += n
        self.rdv_peer = -1
        # the FIN, behind the writes (RC keeps order), with the send's own description
        return self._send_from(peer, self.rdv_addr, self.rdv_lkey, 0, self.rdv_desc)

    cdef int _tell_chunks(self, int peer, const int64_t *ch, int n) noexcept nogil:
        """OFFER or ASK: a 16-byte message to ``peer`` saying where chunks lie in our work area
        (address, remote key, length): for it to READ them (FETCH), or to WRITE the chunks it sends
        us there (PUT). On Soft-RoCE the poster's CPU does an RDMA operation's copying at both ends,
        so with an offer the reader, not the root, pays for it (a scatter's n-1 blocks are copied
        by n-1 CPUs instead of one); with an ask nothing passes through a slot, so nothing is copied
        out of one (an all-to-all's blocks). A message through the slots, not the mailbox, so that
        its header is checked against the peer's call like any other."""
        cdef peer_t *p = &self.peers[peer]
        cdef uint32_t length = <uint32_t>_span(ch, n)
        cdef bint second = ch[0] >= self.split
        cdef uint32_t rkey = self.work2_rkey if second else self.work_rkey
        cdef uint64_t addr = <uint64_t><uintptr_t>self._at(ch[0])
        # (a span in the second area lies within it: _begin checked the program's extent)
        if rkey == 0 or self.consume is not None or (not second and ch[0] + <int64_t>length > self.work_len) \
                or p.cts_staging == NULL:
            return self._fail(FAIL_MALFORMED, peer, length, 2)     # no remote access here
        # (the staging room is free: the peer read our last message from it before the message
        # that let this call begin, or before its FIN)
        memcpy(p.cts_staging, &addr, 8)
        memcpy(p.cts_staging + 8, &rkey, 4)
        memcpy(p.cts_staging + 12, &length, 4)
        return self._send_from(peer, <uint64_t><uintptr_t>p.cts_staging, self.header_lkey, 16, self.placed_desc)

    cdef int _take_place(self, int peer, int64_t total, uint64_t *addr, uint32_t *rkey) noexcept nogil:
        """The OFFER or ASK from ``peer`` of the ``total`` bytes we move: its address and key; a
        length that is not ours is a disagreement (FAIL_MISMATCH), found before any READ or WRITE."""
        cdef uint32_t length
        cdef uint8_t *data = self._recv(peer, 16, False, NULL, True)
        if data == NULL:
            return -1
        memcpy(addr, data, 8)
        memcpy(rkey, data + 8, 4)
        memcpy(&length, data + 12, 4)
        if self._release(peer) < 0:
            return -1
        if <int64_t>length != total:
            memcpy(self.fail_desc, self.rdesc, DESC_SIZE)
            return self._fail(FAIL_MISMATCH, peer, length, total)
        return 0

    cdef int _post_rdma(self, int peer, int opcode, uint64_t local, uint32_t lkey, uint64_t addr, uint32_t rkey,
                        int64_t n) noexcept nogil:
        """One signaled RDMA WRITE or READ (``opcode``) of ``n`` bytes (at most RDV_MAX_WRITE)
        between our ``local`` and the peer's ``addr``, counted with the payloads (WAIT_SENDS_DONE
        waits for it); the send queue has room for it."""
        cdef peer_t *p = &self.peers[peer]
        cdef ibv_sge sge
        cdef ibv_send_wr wr
        cdef ibv_send_wr *bad = NULL
        memset(&wr, 0, sizeof(wr))
        sge.addr, sge.length, sge.lkey = local, <uint32_t>n, lkey
        wr.sg_list, wr.num_sge = &sge, 1
        wr.wr_id = (<uint64_t>peer << 2) | 1          # a payload moved from or into the work area
        wr.opcode = opcode
        wr.send_flags = IBV_SEND_SIGNALED
        wr.wr.rdma.remote_addr, wr.wr.rdma.rkey = addr, rkey
        if ibv_post_send(p.qp, &wr, &bad):
            return self._fail(FAIL_POST, peer, errno, 0)
        p.outstanding += 1
        p.data_outstanding += 1
        return 0

    cdef int _fetch(self, int peer, const int64_t *ch, int n) noexcept nogil:
        """FETCH: take ``peer``'s offer of our chunks and RDMA READ them into the work area; returns
        once they are in. The peer may reuse its memory only after our next message to it."""
        cdef peer_t *p = &self.peers[peer]
        cdef int64_t total = _span(ch, n)
        cdef uint64_t addr
        cdef uint32_t rkey
        if self.consume is not None or ch[0] + total > self.work_len or self.sockets:
            return self._fail(FAIL_MALFORMED, peer, total, 3)      # a GPU work area is not read into
        if self._take_place(peer, total, &addr, &rkey) < 0:
            return -1
        if total == 0:
            return 0
        if p.outstanding >= self.sq_depth and self._wait(WAIT_SEND_QUEUE, peer, 0) < 0:
            return -1
        if self._post_rdma(peer, IBV_WR_RDMA_READ, <uint64_t><uintptr_t>(self.work + ch[0]), self.work_lkey, addr,
                           rkey, total) < 0:
            return -1
        return self._wait(WAIT_SENDS_DONE, peer, total)

    cdef int _put(self, int peer, const int64_t *ch, int n) noexcept nogil:
        """PUT: take ``peer``'s ASK for our chunks and RDMA WRITE them there; a NOTICE behind them
        tells the peer (its LANDED: RC keeps the order, so the chunks are in place when it
        arrives). The writes complete as sends do (WAIT_SENDS). A forged address or key fails our
        WRITE's completion, which names the peer."""
        cdef peer_t *p = &self.peers[peer]
        cdef int64_t total = _span(ch, n), done = 0, k
        cdef uint64_t addr, src = <uint64_t><uintptr_t>self._at(ch[0])
        cdef uint32_t rkey, lkey = self.work_lkey if ch[0] < self.split else self.work2_lkey
        if self.consume is not None or (ch[0] < self.split and ch[0] + total > self.work_len):
            return self._fail(FAIL_MALFORMED, peer, total, 5)      # a GPU work area is not written from
        if self._take_place(peer, total, &addr, &rkey) < 0:
            return -1
        while done < total:
            k = min(<int64_t>RDV_MAX_WRITE, total - done)
            if p.outstanding >= self.sq_depth and self._wait(WAIT_SEND_QUEUE, peer, 0) < 0:
                return -1
            if self._post_rdma(peer, IBV_WR_RDMA_WRITE, src + <uint64_t>done, lkey, addr + <uint64_t>done, rkey, k) < 0:
                return -1
            done += k
        return 0

    cdef int _send_ahead(self, int sp, const int64_t *sch, int ns, int *sent, int k) noexcept nogil:
        """Send the chunks after sent[0], up to k + slots, while sp takes them without a credit wait."""
        while sent[0] < ns and sent[0] <= k + self.slots and self._can_send(sp):
            if self._send(sp, sch[sent[0] * CHUNK_COLUMNS], sch[sent[0] * CHUNK_COLUMNS + 1]) < 0:
                return -1
            sent[0] += 1
        return 0

    cdef bint _can_send(self, int peer) noexcept nogil:
        return self.peers[peer].credits > 0 and self.peers[peer].outstanding < self.sq_depth

    cdef int _send(self, int peer, int64_t off, int64_t n) noexcept nogil:
        """One WRITE_WITH_IMM of two gather entries, the header's room and the payload, into the
        peer's next slot: one packet for a small message (a separate header WRITE doubled the
        packets, and rxe's work, of every small collective)."""
        return self._send_from(peer, <uint64_t><uintptr_t>self._at(off), self.work_lkey if off < self.split
                               else self.work2_lkey, n, self.desc)

    cdef int _send_from(self, int peer, uint64_t addr, uint32_t lkey, int64_t n, const uint8_t *desc) noexcept nogil:
        """_send of the payload at ``addr`` (registered under ``lkey``) behind ``desc``."""
        cdef peer_t *p = &self.peers[peer]
        cdef ibv_sge sge[2]
        cdef ibv_send_wr wr
        cdef ibv_send_wr *bad = NULL
        cdef uint64_t slot
        cdef uint8_t *hdr
        cdef uint32_t len32 = <uint32_t>n, back
        cdef int rc
        if self.sockets:
            return self._sock_send(peer, addr, n, desc)
        if not self._can_send(peer):
            if self._wait(WAIT_CREDIT, peer, n) < 0:
                return -1
        slot = p.send_seq % <uint64_t>self.slots
        hdr = p.headers + slot * C_HEADER_ROOM
        memcpy(hdr, desc, DESC_SIZE)
        memcpy(hdr + DESC_SIZE, &len32, 4)                # little-endian, as struct "<44sI"
        memset(&wr, 0, sizeof(wr))
        sge[0].addr, sge[0].length, sge[0].lkey = <uint64_t><uintptr_t>hdr, C_HEADER_ROOM, self.header_lkey
        sge[1].addr, sge[1].length, sge[1].lkey = addr, len32, lkey
        wr.sg_list, wr.num_sge = sge, 2 if n else 1
        wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM
        if C_HEADER_ROOM + n <= self.max_inline:
            # copied at the post: the work area is free at once (no WAIT_SENDS for the ACK). One
            # in signal_every asks for a completion, which stands for the unsignaled ones before it
            # (RC completes in order; its wr_id carries their count for ``outstanding``): the
            # others cost neither the completion's making nor its handling. An error completes
            # every send, signaled or not.
            p.unsignaled += 1
            if p.unsignaled >= self.signal_every:
                wr.wr_id = (<uint64_t>p.unsignaled << 32) | (<uint64_t>peer << 2)
                wr.send_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE
                p.unsignaled = 0
            else:
                wr.wr_id = <uint64_t>peer << 2
                wr.send_flags = IBV_SEND_INLINE
        else:
            wr.wr_id = (<uint64_t>peer << 2) | 1
            wr.send_flags = IBV_SEND_SIGNALED
        # the slots consumed since the last return ride along: with an exchange (recursive
        # doubling, halving-doubling, the barrier) no credit message of its own, whose posting and
        # completion cost the peer a wake-up where ranks outnumber cores
        back = <uint32_t>min(p.unreturned, CREDIT_MASK)
        wr.imm_data = htonl((KIND_DATA << 30) | (back << CREDIT_SHIFT) | len32)
        wr.wr.rdma.remote_addr = p.remote + slot * <uint64_t>self.slot_stride
        wr.wr.rdma.rkey = p.rkey
        rc = ibv_post_send(p.qp, &wr, &bad)
        if rc:
            return self._fail(FAIL_POST, peer, rc, 0)
        p.outstanding += 1
        p.data_outstanding += <int>(wr.wr_id & 1)
        p.credits -= 1
        p.unreturned -= <int>back
        p.send_seq += 1
        return 0

    cdef int _post_empty(self, int peer, uint32_t imm) noexcept nogil:
        """A zero-byte WRITE_WITH_IMM (credits, aborts, queries, reports); -1 when it cannot post."""
        cdef peer_t *p = &self.peers[peer]
        cdef ibv_send_wr wr
        cdef ibv_send_wr *bad = NULL
        if self.sockets:
            return self._sock_queue(peer, imm, NULL, 0, 0)
        if p.outstanding >= self.sq_depth:
            return -1
        memset(&wr, 0, sizeof(wr))
        wr.wr_id = <uint64_t>peer << 2
        wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM
        wr.send_flags = IBV_SEND_SIGNALED
        wr.imm_data = htonl(imm)
        wr.wr.rdma.remote_addr, wr.wr.rdma.rkey = p.remote, p.rkey
        if ibv_post_send(p.qp, &wr, &bad):
            return -1
        p.outstanding += 1
        return 0

    cdef uint8_t *_recv(self, int peer, int64_t n, bint upto=False, uint8_t *dst=NULL,
                        bint placed=False) noexcept nogil:
        """The payload of the next message from ``peer`` once it has arrived and its header
        matches this collective; NULL on failure. ``upto``: a point-to-point chunk, at most ``n``
        bytes, whose description's count (the whole message's length) is the sender's to say.
        ``dst``: where the caller copies it (_dst); on the socket link a message that arrives while
        this receive waits for it is read straight there, and the payload returned is ``dst``.
        ``placed``: an offer, ask or landed header (placed_desc), which a block's own message is not
        taken for, nor it for one: ranks whose counts disagree over the size from which a pair's
        block is written fail at the call, whatever the lengths."""
        cdef peer_t *p = &self.peers[peer]
        cdef uint32_t got, length
        cdef uint8_t *start
        cdef uint8_t *data
        cdef int rc
        cdef kept_t *k = p.kept[<int>upto]
        if k != NULL:                   # kept while a call of the other class ran: it came first
            p.kept[<int>upto] = k.next
            if k.next == NULL:
                p.kept_last[<int>upto] = NULL
            p.taken = k
            got, start, data = k.length, k.header, <uint8_t *>(k + 1)
        else:
            while True:
                if p.arr_count == 0:
                    if dst != NULL and n > 0:
                        self.post_peer, self.post_dst, self.post_len, self.post_upto = peer, dst, n, upto
                    rc = self._wait(WAIT_ARRIVAL, peer, n)
                    self.post_peer = -1
                    if rc < 0:
                        return NULL
                start = self._take_head(p, &got)
                if (start[DESC_KIND_AT] == DESC_KIND_SEND) == upto:
                    break
                # a point-to-point message during a collective (an isend before it), or a later
                # collective's during a point-to-point receive: kept for its own receive, its slot
                # freed, so neither holds up the other (MPI's progress rule)
                if self._keep(p, start, got) < 0 or self._return_slot(peer) < 0:
                    return NULL
            data = start + C_HEADER_ROOM
            if p.directed:              # (_sock_piece directs only behind arrivals it directed)
                p.directed -= 1
                if dst == NULL:
                    self._fail(FAIL_MALFORMED, peer, 0, 2)
                    return NULL
                data = dst
        memcpy(&length, start + DESC_SIZE, 4)
        if upto:
            if memcmp(start, self.rdesc, 8) != 0 or memcmp(start + 16, self.rdesc + 16, DESC_SIZE - 16) != 0 \
                    or length > n or got != length:
                if self.fail_kind == FAIL_NONE:
                    memcpy(self.fail_desc, start, DESC_SIZE)
                    self._fail(FAIL_MISMATCH, peer, length if got == length else got, n)
                return NULL
            memcpy(&self.last_count, start + 8, 8)
            self.last_length = length
        elif not _desc_is(start, self.rdesc, placed) or length != n or got != n:
            if self.fail_kind == FAIL_NONE:
                memcpy(self.fail_desc, start, DESC_SIZE)
                if placed:              # (the run is over: description() says what was expected)
                    self.rdesc[DESC_PLACED_AT] = 1
                self._fail(FAIL_MISMATCH, peer, length if length != n else got, n)
            return NULL
        return data

    cdef int _keep(self, peer_t *p, const uint8_t *start, uint32_t got) noexcept nogil:
        """Keep the message at ``start`` (``got`` payload bytes) in its class's queue."""
        cdef int c = start[DESC_KIND_AT] == DESC_KIND_SEND
        cdef kept_t *k = <kept_t *>malloc(sizeof(kept_t) + got)
        self.keeps += 1
        if k == NULL:
            return self._fail(FAIL_MEMORY, -1, got, 0)
        k.next, k.length = NULL, got
        memcpy(k.header, start, C_HEADER_ROOM)
        memcpy(<uint8_t *>(k + 1), start + C_HEADER_ROOM, got)
        if p.kept_last[c] != NULL:
            p.kept_last[c].next = k
        else:
            p.kept[c] = k
        p.kept_last[c] = k
        return 0

    cdef int _release(self, int peer) noexcept nogil:
        """The message _recv returned is consumed: its slot goes back (a kept one is freed)."""
        cdef peer_t *p = &self.peers[peer]
        if p.taken != NULL:
            free(p.taken)
            p.taken = NULL
            return 0
        return self._return_slot(peer)

    cdef int _return_slot(self, int peer) noexcept nogil:
        cdef peer_t *p = &self.peers[peer]
        p.held -= 1
        p.unreturned += 1
        if p.unreturned >= self.credit_batch:
            if p.outstanding >= self.sq_depth:
                if self._wait(WAIT_SEND_QUEUE, peer, 0) < 0:
                    return -1
            if self._post_empty(peer, (KIND_CREDIT << 30) | <uint32_t>p.unreturned) < 0:
                return self._fail(FAIL_POST, peer, errno, 0)
            p.unreturned = 0
        return 0

    cdef int _consume(self, int kind, const int64_t *chunk, uint8_t *data) noexcept nogil:
        cdef int64_t off = chunk[0], n = chunk[1], aux = chunk[2]
        cdef size_t count
        if kind == CONSUME_NONE or n == 0:
            return 0
        if self.consume is not None:
            return self._callback(kind, off, n, aux, data)
        count = <size_t>(n // self.itemsize)
        if kind == CONSUME_COPY:
            if data != self._at(off):          # (else the socket link read it straight there)
                memcpy(self._at(off), data, <size_t>n)
        elif kind == CONSUME_REDUCE:
            pyrdma_reduce(self._at(off), self._at(off), data, count, self.dtype, self.op)
        elif kind == CONSUME_REDUCE_LOWER:
            pyrdma_reduce(self._at(off), self._at(aux), data, count, self.dtype, self.op)
        else:
            pyrdma_reduce(self._at(off), data, self._at(aux), count, self.dtype, self.op)
        return 0

    cdef int _callback(self, int kind, int64_t off, int64_t n, int64_t aux, uint8_t *data) noexcept nogil:
        with gil:
            try:
                self.consume(kind, off, n, aux, <int64_t>(data - self.slot_base))
            except BaseException as exc:
                self.py_error = exc
                return self._fail(FAIL_PYTHON, -1, 0, 0)
        return 0

    cdef int _check_signals(self) noexcept nogil:
        with gil:
            try:
                PyErr_CheckSignals()
            except BaseException as exc:
                self.py_error = exc
                return self._fail(FAIL_PYTHON, -1, 0, 0)
        return 0

    cdef bint _ready(self, int what, int peer) noexcept nogil:
        cdef peer_t *p = &self.peers[peer]
        if what == WAIT_CREDIT:
            return self._can_send(peer)
        if what == WAIT_ARRIVAL:
            return p.arr_count > 0
        if what == WAIT_SEND_QUEUE:
            return p.outstanding < self.sq_depth
        if what == WAIT_CTS:
            return self.rdv_peer < 0
        if what == WAIT_SPREAD:
            return self._spread_ready()
        return p.data_outstanding == 0

    cdef bint _spread_ready(self) noexcept nogil:
        """Whether a step of the running spread can go on: a message from its receive peer (any:
        _arrived sorts them), or a credit for its sends."""
        cdef int j
        cdef const int64_t *st
        for j in range(self.spread_count):
            st = self.spread_steps + j * STEP_COLUMNS
            if self.spread_done[self.size + j] < st[6] and (self.peers[st[2]].arr_count > 0
                                                             or self.peers[st[2]].kept[0] != NULL):
                return True
            if self.spread_done[j] < st[4] and self._can_send(<int>st[1]):
                return True
        return False

    cdef int _chain_end(self, int peer) noexcept nogil:
        """Follow "X waits for Y" reports from ``peer`` to the rank at the end of the chain."""
        cdef int cur = peer, nxt
        memset(self.visited, 0, self.size)
        self.visited[cur] = 1
        while True:
            nxt = self.peers[cur].report
            if nxt < 0 or nxt >= self.size or nxt == self.rank or self.visited[nxt]:
                return cur
            self.visited[nxt] = 1
            cur = nxt

    cdef int _wait(self, int what, int peer, int64_t n) noexcept nogil:
        """Make progress until ready; on timeout fail with FAIL_TIMEOUT (the transport names the
        rank to blame from the reports gathered by the queries sent shortly before)."""
        cdef double start, deadline, probe_at, now, next_signals
        cdef int suspect, q, i, handled
        if self._ready(what, peer):
            return 0
        self.epoch = (self.epoch + 1) & 0xFFF
        for q in range(self.size):
            self.peers[q].report = -1
        memset(self.queried, 0, self.size)
        self.waiting_on = peer
        if self.spin_now > 0:
            for i in range(FIRST_POLLS if self.spin_yields else FIRST_POLLS_NO_YIELD):   # before a clock read
                handled = self._progress(0.0)
                if handled == 0:
                    if self.spin_yields:
                        sched_yield()
                elif handled < 0 or self._ready(what, peer):
                    self.waiting_on = -1
                    return 0 if handled > 0 else -1
        # a run holding the GIL keeps it through the short spin above (a wait of a ping-pong ends
        # there: the release and retake cost ~1 us in the VM) and lets it go before it may sleep
        if self.hold_gil and self.released == NULL:
            self.released = PyEval_SaveThread()     # taken back at the run's end
        start = monotonic_now()
        deadline = start + self.timeout
        probe_at = deadline - self.probe_lead
        next_signals = start + SIGNAL_CHECK
        while True:
            if self.fail_kind != FAIL_NONE:
                break
            if pyrdma_load_flag(&self.closing):
                self._fail(FAIL_CLOSED, -1, 0, 0)
                break
            now = monotonic_now()
            if now >= deadline:
                self.fail_what = what
                # (b: our messages by address it has not read, where we waited for our sends)
                self._fail(FAIL_TIMEOUT, peer, n, self.peers[peer].unread if what == WAIT_SENDS_DONE else 0)
                break
            if self.signals and now >= next_signals:
                next_signals = now + SIGNAL_CHECK
                if self._check_signals() < 0:
                    break
            if now >= probe_at:
                suspect = self._chain_end(peer)
                if not self.queried[suspect] and suspect != self.rank:
                    self.queried[suspect] = 1
                    self._post_empty(suspect, (KIND_CONTROL << 30) | (CTRL_QUERY << 28) | (self.epoch << 16))
                self._progress(min(deadline - now, 0.05))
            else:
                self._progress(min(min(probe_at, deadline) - now, SIGNAL_CHECK))
            if self._ready(what, peer):
                self.waiting_on = -1
                return 0
            if self.peers[peer].gone:           # the socket link: its stream ended, this will not come
                self._fail(FAIL_LINK, peer, 0, 0)
                break
            # past the spin: a peer that filled our slots may wait for us as we wait for its credit
            # (or its rendezvous answer); a receive waits longer first: another peer's full slots are
            # most often just its next collective's sends ahead. (A wait for our sends' completion
            # never depends on the peer's receives: the credits bound what is in flight.)
            if (what == WAIT_CREDIT or what == WAIT_CTS or (what == WAIT_ARRIVAL or what == WAIT_SPREAD)
                    and now - start > KEEP_AFTER) \
                    and self._keep_arrivals() < 0:
                break
        self.waiting_on = -1
        return -1

    cdef int _progress(self, double seconds) noexcept nogil:
        """Handle what the link has (completions, or frames read and written); if nothing, wait up
        to ``seconds`` for something: spin first, then sleep (on the completion channel, or in
        poll() on the sockets). The number handled, or -1 on failure."""
        cdef int n, k = 0
        cdef double end, spin = self.spin_now
        if spin == 0 and self.in_background and self.waiters > 0:
            spin = self.spin_adaptive
        n = self._poll_link()
        if n == 0 and seconds > 0:
            if spin > 0:
                end = monotonic_now() + min(spin, seconds)
                while n == 0 and (k % CLOCK_EVERY != 0 or monotonic_now() < end):
                    # yield between polls: where ranks outnumber cores (4 ranks on the VM's 2 vCPUs)
                    # the peer we wait for gets the CPU now, not after our spin (8 B allreduce, 4
                    # ranks: 809 us without, 421 us with a 200 us spin; 2 ranks: no difference)
                    if self.spin_yields:
                        sched_yield()
                    n = self._poll_link()
                    k += 1
            if n == 0 and seconds > spin:
                n = self._sleep_link(seconds)
        if n >= 0 and self.rdv_peer >= 0 and self.peers[self.rdv_peer].cts and self._rendezvous_write() < 0:
            return -1
        return n

    cdef int _poll_link(self) noexcept nogil:
        """One look at the link: the completions polled and handled, or a pass over the sockets."""
        cdef int n
        if self.sockets:
            return self._sock_pass()
        n = ibv_poll_cq(self.cq, NWC, self.wcs)
        self.polls += 1
        if n < 0:
            return self._fail(FAIL_POLL, -1, errno, 0)
        return self._handle(n) if n else 0

    cdef int _sleep_link(self, double seconds) noexcept nogil:
        """Sleep until the link has something (at most ``seconds``, and CLOSE_POLL), then handle it
        (_poll_link); the spin adapts to how soon that came."""
        cdef int n, m = 0, q
        cdef double slept
        cdef pollfd pfd
        cdef ibv_cq *ev_cq
        cdef void *ev_ctx
        if self.sockets:
            for q in range(self.size):
                if q != self.rank and not self.peers[q].gone:
                    self.pfds[m].fd = self.peers[q].fd
                    self.pfds[m].events = POLLIN | (POLLOUT if self.peers[q].outstanding else 0)
                    self.pfds[m].revents = 0
                    m += 1
        else:
            ibv_req_notify_cq(self.cq, 0)
            n = self._poll_link()                       # one that came before the arming
            if n != 0:
                return n
        self.sleeps += 1
        slept = monotonic_now()
        if self.sockets:
            poll(self.pfds, m, <int>(min(seconds, CLOSE_POLL) * 1000.0) + 1)
        else:
            pfd.fd = self.channel.fd
            pfd.events = POLLIN
            pfd.revents = 0
            if poll(&pfd, 1, <int>(min(seconds, CLOSE_POLL) * 1000.0) + 1) > 0 \
                    and ibv_get_cq_event(self.channel, &ev_cq, &ev_ctx) == 0:
                ibv_ack_cq_events(ev_cq, 1)
        n = self._poll_link()
        self._adapt_spin(n > 0, slept)
        return n

    cdef int _handle(self, int n) noexcept nogil:
        cdef int i, peer
        cdef ibv_wc *wc
        cdef peer_t *p
        cdef ibv_recv_wr rwr
        cdef ibv_recv_wr *bad = NULL
        for i in range(n):
            wc = &self.wcs[i]
            peer = <int>((wc.wr_id & <uint64_t>0xFFFFFFFF) >> 2)      # above: a signaled send's count
            if peer < 0 or peer >= self.size or peer == self.rank:
                self._fail(FAIL_MALFORMED, -1, <int64_t>wc.wr_id, 0)
                continue
            p = &self.peers[peer]
            if wc.status != IBV_WC_SUCCESS:
                self._fail(FAIL_LINK, peer, wc.status, wc.vendor_err)
                continue
            if wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM:
                memset(&rwr, 0, sizeof(rwr))
                rwr.wr_id = <uint64_t>peer << 2       # WRITE_WITH_IMM consumes a receive, no buffer
                if ibv_post_recv(p.qp, &rwr, &bad):
                    self._fail(FAIL_POST, peer, errno, 1)
                self._on_imm(peer, ntohl(wc.imm_data))
            else:
                p.outstanding -= <int>(wc.wr_id >> 32) if wc.wr_id >> 32 else 1
                if wc.wr_id & 1:                  # a payload read from the work area (not inline)
                    p.data_outstanding -= 1
        return n if self.fail_kind == FAIL_NONE else -1

    cdef inline uint8_t *_at(self, int64_t off) noexcept nogil:
        """The address of work-area offset ``off`` (in the second area from ``split`` on; a chunk
        never straddles it: the planner of a two-area run keeps them apart)."""
        return self.work + off if off < self.split else self.work2 + (off - self.split)

    cdef int _on_imm(self, int peer, uint32_t imm) noexcept nogil:
        """A message from ``peer`` is in, by the immediate it carries (both links): a data message's
        arrival (its slot holds it), credits, an abort, or a control message. -1 on failure."""
        cdef peer_t *p = &self.peers[peer]
        cdef int kind = imm >> 30, sub, epoch, value
        if kind == KIND_DATA:
            if p.held >= self.slots or (imm & LEN_MASK) > <uint32_t>self.max_message:
                return self._fail(FAIL_MALFORMED, peer, imm, 0)    # more than its credits, or too long
            p.arrivals[(p.arr_head + p.arr_count) % self.slots] = imm & LEN_MASK
            p.arr_count += 1
            p.held += 1
            p.credits += (imm >> CREDIT_SHIFT) & CREDIT_MASK
            if p.credits > self.slots:
                return self._fail(FAIL_MALFORMED, peer, imm, 0)
        elif kind == KIND_CREDIT:
            p.credits += imm & 0xFFFF
            if p.credits > self.slots:
                return self._fail(FAIL_MALFORMED, peer, imm, 0)
        elif kind == KIND_ABORT:
            return self._fail(FAIL_ABORT, peer, imm & 0xFFFFFF, (imm >> 24) & 0x3F)
        else:
            sub, epoch, value = (imm >> 28) & 3, (imm >> 16) & 0xFFF, imm & 0xFFFF
            if sub == CTRL_QUERY and self.waiting_on >= 0:
                self._post_empty(peer, (KIND_CONTROL << 30) | (CTRL_REPORT << 28) | (epoch << 16)
                                 | <uint32_t>self.waiting_on)
            elif sub == CTRL_REPORT and epoch == self.epoch:
                p.report = value
            elif sub == CTRL_CTS:
                p.cts += 1
                if p.cts > 1 or self.rdv_peer != peer:    # an answer to no RTS of ours
                    return self._fail(FAIL_MALFORMED, peer, imm, 0)
            elif sub == CTRL_READ:
                # (at most what is unread: a failed run forgot its frames, which the peer may
                # still read and report)
                value = min(value, p.unread)
                p.unread -= value
                p.data_outstanding -= value
        return 0

    cdef int _keep_arrivals(self) noexcept nogil:
        """Copy out (as _recv keeps a message of the other class) the messages of every peer that
        has no credit left (its slots here full, or freed but not yet credited: the credits go back
        in batches), and return the slots, the last batch too: a peer that sends more than they
        hold before we receive from it (an eager isend longer than the slots, ahead of a collective
        or of its own receive) must not wait for our credits while we wait for it. (5 slots full
        and 3 freed of 8 left a peer without credit, past a check for full slots only: 3 ranks
        in CI, two of them waiting for each other's credit.) Only where no credit message would
        have to wait for send queue room."""
        cdef int q
        cdef peer_t *p
        for q in range(self.size):
            p = &self.peers[q]
            if q == self.rank or p.held + p.unreturned < self.slots or p.rx_direct or p.directed:
                continue            # (a payload read straight into a receive's destination is that receive's)
            while p.arr_count > 0 and p.outstanding < self.sq_depth:
                if self._keep_head(q) < 0:
                    return -1
            if p.unreturned > 0 and p.outstanding < self.sq_depth:
                if self._post_empty(q, (KIND_CREDIT << 30) | <uint32_t>p.unreturned) < 0:
                    return self._fail(FAIL_POST, q, errno, 0)
                p.unreturned = 0
        return 0

    # ---- the socket link --------------------------------------------------------------------------

    cdef int _sock_send(self, int peer, uint64_t addr, int64_t n, const uint8_t *desc) noexcept nogil:
        """_send_from on the socket link: the frame is queued (credits as on the verbs link) and
        written as far as the socket takes it now; the rest goes out from later progress."""
        cdef peer_t *p = &self.peers[peer]
        cdef uint32_t back
        cdef bint by_address
        if not self._can_send(peer):
            if self._wait(WAIT_CREDIT, peer, n) < 0:
                return -1
        back = <uint32_t>min(p.unreturned, CREDIT_MASK)
        # (a point-to-point send too: it completes once the receiver has read it, which it does at
        # any call of its own, keeping it for its receive as an early eager message is kept)
        by_address = p.addresses_to and n >= self._by_address_bytes \
            and self.consume is None        # (a GPU work area's staging memory is reused at its own pace)
        if self._sock_queue(peer, (KIND_DATA << 30) | (back << CREDIT_SHIFT)
                            | <uint32_t>(ADDRESS_FRAME if by_address else n),
                            desc, addr, <uint32_t>n, by_address) < 0:
            return -1
        p.credits -= 1
        p.unreturned -= <int>back
        p.send_seq += 1
        return 0

    cdef int _sock_queue(self, int peer, uint32_t imm, const uint8_t *desc, uint64_t addr, uint32_t n,
                         bint by_address=False) noexcept nogil:
        """Queue a frame (a data message when ``desc`` is given, else the immediate alone) and write
        what the socket takes now. -1 when the queue is full or the peer is gone (a frame of no data
        to a gone peer is dropped: 0). ``by_address``: its payload is ``addr`` and where the word
        ``live`` lies, with its value (24 bytes; the header says ``n``), for the peer to read the
        ``n`` bytes there out of this process, and then that word."""
        cdef peer_t *p = &self.peers[peer]
        cdef txframe_t *f
        cdef uint32_t nimm = htonl(imm)
        if p.gone or p.deaf:
            return 0 if desc == NULL else self._fail(FAIL_LINK, peer, 0, 0)
        if p.outstanding >= self.sq_depth:
            return -1
        f = &p.txq[(p.tx_head + p.outstanding) % self.sq_depth]
        memcpy(f.head, &nimm, 4)
        if desc != NULL:
            memcpy(f.head + 4, desc, DESC_SIZE)
            memcpy(f.head + 4 + DESC_SIZE, &n, 4)          # little-endian, as struct "<44sI"
            f.head_len = 4 + HEADER_SIZE
        else:
            f.head_len = 4
        free(f.owned)                                   # (a dropped frame's copy)
        f.addr, f.length, f.done, f.owned = addr, n, 0, NULL
        f.by_address = by_address
        if by_address:
            f.where[0], f.where[1], f.where[2] = addr, <uint64_t><uintptr_t>&self.live, self.live
            f.addr, f.length = <uint64_t><uintptr_t>f.where, ADDRESS_FRAME
        f.data = desc != NULL
        p.outstanding += 1
        p.data_outstanding += f.data
        return 0 if self._sock_flush(peer) >= 0 else -1

    cdef int _sock_flush(self, int peer) noexcept nogil:
        """Write what the queued frames to ``peer`` have left, as far as the socket takes it
        without blocking (one sendmsg gathers many frames). The frames done, or -1 on failure."""
        cdef peer_t *p = &self.peers[peer]
        cdef iovec iov[128]
        cdef msghdr msg
        cdef txframe_t *f
        cdef int niov, i, frames = 0
        cdef ssize_t n
        cdef size_t want
        cdef uint64_t off, left
        while p.outstanding > 0 and not p.gone and not p.deaf:
            niov, want, i = 0, 0, 0
            while i < p.outstanding and niov < 2 * TX_IOV - 1:
                f = &p.txq[(p.tx_head + i) % self.sq_depth]
                off = f.done
                if off < f.head_len:
                    iov[niov].iov_base = f.head + off
                    iov[niov].iov_len = f.head_len - off
                    want += iov[niov].iov_len
                    niov += 1
                    off = f.head_len
                if off < f.head_len + f.length:
                    iov[niov].iov_base = <void *><uintptr_t>(f.addr + off - f.head_len)
                    iov[niov].iov_len = f.head_len + f.length - off
                    want += iov[niov].iov_len
                    niov += 1
                i += 1
            memset(&msg, 0, sizeof(msg))
            msg.msg_iov, msg.msg_iovlen = iov, niov
            n = sendmsg(p.fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT)
            if n < 0:
                if errno == EINTR:
                    continue
                if errno == EAGAIN:            # (EWOULDBLOCK on Linux)
                    break
                return self._sock_lost(peer, errno)
            while n > 0:
                f = &p.txq[p.tx_head]
                left = f.head_len + f.length - f.done
                if <uint64_t>n < left:
                    f.done += <uint64_t>n
                    break
                n -= <ssize_t>left
                if f.owned != NULL:
                    free(f.owned)
                    f.owned = NULL
                p.tx_head = (p.tx_head + 1) % self.sq_depth
                p.outstanding -= 1
                if f.by_address:
                    p.unread += 1                       # done once the peer says it read it
                else:
                    p.data_outstanding -= f.data
                frames += 1
            if <size_t>n < want and p.outstanding:
                break                                   # the socket's buffer is full
        return frames

    cdef int _sock_lost(self, int peer, int err) noexcept nogil:
        """A write to ``peer`` failed: it closed. A failure if it had messages still to take (it is
        gone), once what it sent before it went is read: an abort there (it failed, and said why
        before it closed) is the failure named, not the broken connection. Else (credits, a
        query's answer: a peer that closed after its last call, while we still read its last
        messages) it is only deaf: what it sent is read until its stream ends."""
        cdef peer_t *p = &self.peers[peer]
        if p.data_outstanding:
            p.gone = 1                 # (first: what the read handles writes nothing to it again)
            self._sock_read(peer, True)
            return self._fail(FAIL_LINK, peer, err, 0)
        p.deaf = 1
        p.outstanding = 0
        return 0

    cdef int _sock_read(self, int peer, bint last_words) noexcept nogil:
        """Read what ``peer``'s socket has, without blocking, into the places of the frames'
        pieces. The frames completed, or -1 on failure. The end of the stream marks the peer gone
        (a wait for it fails; what it sent before is all here). ``last_words``: read although the
        peer is gone already (a write to it failed)."""
        cdef peer_t *p = &self.peers[peer]
        cdef ssize_t n
        cdef uint32_t take
        cdef int frames = 0, rc
        cdef bint direct
        while last_words or not p.gone:
            if p.rx_lo < p.rx_hi:
                take = min(p.rx_need - p.rx_got, <uint32_t>(p.rx_hi - p.rx_lo))
                memcpy(p.rx_dst + p.rx_got, p.rx + p.rx_lo, take)
                p.rx_lo += <int>take
                p.rx_got += take
            else:
                direct = p.rx_state == RX_PAYLOAD and p.rx_need - p.rx_got >= RX_DIRECT
                if direct:
                    n = recv(p.fd, p.rx_dst + p.rx_got, p.rx_need - p.rx_got, MSG_DONTWAIT)
                else:
                    n = recv(p.fd, p.rx, RXBUF, MSG_DONTWAIT)
                if n < 0:
                    if errno == EINTR:
                        continue
                    if errno != EAGAIN:
                        p.gone = 1
                    break
                if n == 0:
                    p.gone = 1
                    break
                if not direct:
                    p.rx_lo, p.rx_hi = 0, <int>n
                    continue
                p.rx_got += <uint32_t>n
            if p.rx_got == p.rx_need:
                rc = self._sock_piece(peer)
                if rc < 0:
                    return -1
                frames += rc
        return frames

    cdef int _sock_piece(self, int peer) noexcept nogil:
        """A piece of a frame is in (its immediate, header or payload): on to the next. 1 when the
        frame is complete, 0 when more of it is to come, -1 on failure (a frame its credits did not
        allow, or longer than max_message, is malformed: the connection is dropped, before any of
        it was written into a slot)."""
        cdef peer_t *p = &self.peers[peer]
        cdef uint32_t imm, length, said
        cdef uint8_t *dst
        memcpy(&imm, p.rx_imm, 4)
        imm = ntohl(imm)
        length = imm & LEN_MASK
        if p.rx_state == RX_IMM and imm >> 30 == KIND_DATA:
            if p.held >= self.slots or length > <uint32_t>self.max_message:
                shutdown(p.fd, SHUT_RDWR)
                p.gone = 1
                return self._fail(FAIL_MALFORMED, peer, imm, 0)
            p.rx_state, p.rx_need, p.rx_got = RX_HEADER, HEADER_SIZE, 0
            p.rx_dst = self._slot(p, p.recv_seq + <uint64_t>p.arr_count)
            return 0
        if p.rx_state == RX_HEADER and length:
            p.rx_state, p.rx_need, p.rx_got = RX_PAYLOAD, length, 0
            memcpy(&said, p.rx_dst + DESC_SIZE, 4)
            if p.pid and length == ADDRESS_FRAME and said != ADDRESS_FRAME:
                # an address frame: its payload is where the data lies in the peer's process
                if said > <uint32_t>self.max_message:
                    shutdown(p.fd, SHUT_RDWR)
                    p.gone = 1
                    return self._fail(FAIL_MALFORMED, peer, imm, said)
                p.rx_by_address, p.rx_length, p.rx_header = 1, said, p.rx_dst
                p.rx_dst = <uint8_t *>p.rx_where
                return 0
            dst = self._rx_place(peer, p.rx_dst, length)
            if dst != NULL:
                p.rx_direct, p.rx_dst = 1, dst
                self.directs += 1
            else:
                p.rx_dst += C_HEADER_ROOM
            return 0
        # the frame is in: handled as the verbs link handles its completion
        if p.rx_by_address:
            p.rx_by_address = 0
            if self._read_by_address(peer) < 0:
                return -1
            imm = (imm & ~(<uint32_t>LEN_MASK)) | p.rx_length
        elif p.rx_direct:
            p.rx_direct = 0
            p.directed += 1
        p.rx_state, p.rx_dst, p.rx_need, p.rx_got = RX_IMM, p.rx_imm, 4, 0
        return 1 if self._on_imm(peer, imm) == 0 else -1

    cdef uint8_t *_rx_place(self, int peer, const uint8_t *header, uint32_t length) noexcept nogil:
        """Where the payload of ``length`` bytes behind ``header`` (a frame from ``peer``) goes
        straight, or NULL: into its slot."""
        cdef peer_t *p = &self.peers[peer]
        cdef const int64_t *chunk
        cdef uint8_t *dst = NULL
        if self.exp_peer == peer and self.exp_next < self.exp_count:
            chunk = self.exp_chunks + self.exp_next * CHUNK_COLUMNS
            if self._is_chunk(header, length, chunk[1]):
                # the exchange's next chunk: into its place, if it is the next one taken
                self.exp_next += 1
                if p.arr_count == p.directed:
                    dst = self._dst(self.exp_ck, chunk)
        elif self.post_peer == peer and p.arr_count == 0 and self._direct_ok(header, length):
            # the message the waiting receive takes next
            dst = self.post_dst
            self.post_peer = -1
        return dst

    cdef int _read_by_address(self, int peer) noexcept nogil:
        """An address frame from ``peer`` is in: copy its data out of the peer's process into the
        place _rx_place gives it (or its slot), then say so (the peer's send completes then)."""
        cdef peer_t *p = &self.peers[peer]
        cdef uint8_t *dst = self._rx_place(peer, p.rx_header, p.rx_length)
        cdef ssize_t n
        cdef uint64_t live = 0
        if dst != NULL:
            p.directed += 1
            self.directs += 1
        else:
            dst = p.rx_header + C_HEADER_ROOM
        # the data, then the sender's word that says it is still the message (one call, in order)
        n = _read_from(p.pid, dst, p.rx_where[0], p.rx_length, p.rx_where[1], &live)
        if n != <ssize_t>p.rx_length + 8:
            shutdown(p.fd, SHUT_RDWR)
            p.gone = 1
            if n < 0 and errno == ESRCH:            # its process ended (it died after sending)
                return self._fail(FAIL_LINK, peer, 0, 0)
            return self._fail(FAIL_ADDRESS, peer, errno if n < 0 else 0, p.rx_length)
        if live != p.rx_where[2]:
            # its call failed before we read it (its abort may be behind, or lost): not the message
            return self._fail(FAIL_ADDRESS, peer, -1, p.rx_length)
        self.reads += 1
        p.reads_owed += 1
        return self._say_read(peer)

    cdef int _say_read(self, int peer) noexcept nogil:
        """Tell ``peer`` how many of its address frames were read here since the last time, if its
        queue has room (else at a later pass: _sock_pass)."""
        cdef peer_t *p = &self.peers[peer]
        if p.outstanding >= self.sq_depth:
            return 0
        if self._sock_queue(peer, (KIND_CONTROL << 30) | (CTRL_READ << 28) | <uint32_t>p.reads_owed,
                            NULL, 0, 0) < 0:
            return -1
        p.reads_owed = 0
        return 0

    cdef bint _is_chunk(self, const uint8_t *header, uint32_t length, int64_t n) noexcept nogil:
        """Whether a message of ``length`` payload bytes whose header is ``header`` is a chunk of
        ``n`` bytes of the running collective (the checks _recv then makes)."""
        cdef uint32_t said
        memcpy(&said, header + DESC_SIZE, 4)
        return said == length and length == n and memcmp(header, self.rdesc, DESC_SIZE) == 0

    cdef bint _direct_ok(self, const uint8_t *header, uint32_t length) noexcept nogil:
        """Whether a message of ``length`` payload bytes whose header (in its slot) is ``header``
        is what the posted receive takes (the checks _recv then makes, so no other message's
        bytes ever land in the receive's destination, and never more than it posted)."""
        cdef uint32_t said
        memcpy(&said, header + DESC_SIZE, 4)
        if said != length:
            return False
        if self.post_upto:
            return length <= self.post_len and memcmp(header, self.rdesc, 8) == 0 \
                and memcmp(header + 16, self.rdesc + 16, DESC_SIZE - 16) == 0
        return length == self.post_len and memcmp(header, self.rdesc, DESC_SIZE) == 0

    cdef uint8_t *_dst(self, int kind, const int64_t *chunk) noexcept nogil:
        """Where a received chunk is copied (for _recv's ``dst``), or NULL: not a copy into host
        memory, or not the socket link."""
        if not self.sockets or kind != CONSUME_COPY or self.consume is not None:
            return NULL
        return self._at(chunk[0])

    cdef int _sock_pass(self) noexcept nogil:
        """Write and read what every peer's socket takes and has now; the frames done, -1 on failure."""
        cdef int q, n, total = 0
        for q in range(self.size):
            if q == self.rank or self.peers[q].gone:
                continue
            if self.peers[q].reads_owed and self._say_read(q) < 0:
                return -1
            if self.peers[q].outstanding:
                n = self._sock_flush(q)
                if n < 0:
                    return -1
                total += n
            n = self._sock_read(q, False)
            if n < 0:
                return -1
            total += n
        self.polls += 1
        return total if self.fail_kind == FAIL_NONE else -1

    cdef void _adapt_spin(self, bint woken, double slept) noexcept nogil:
        """After a foreground sleep that began at ``slept``: double the spin when what ended it came
        within SPIN_MAX (``woken``) and the ranks do not outnumber the CPUs (``crowded``), else
        halve it back toward the configured spin (both links)."""
        if self.spin_now > 0:
            if woken and not self.crowded and monotonic_now() - slept < SPIN_MAX:
                self.spin_adaptive = min(2 * self.spin_adaptive, SPIN_MAX)
            else:
                self.spin_adaptive = max(self.spin_adaptive / 2, self.spin)
            self.spin_now = self.spin_adaptive


def read_memory_of(int pid, uint64_t addr, Py_ssize_t n):
    """``n`` bytes at ``addr`` in process ``pid`` (process_vm_readv), or None where this process
    may not read it (another machine's or namespace's, no permission, a seccomp filter)."""
    cdef bytearray out = bytearray(n)
    cdef char *dst = out
    cdef ssize_t got
    if n <= 0 or pid <= 0:
        return None
    with nogil:
        got = _read_from(pid, dst, addr, n, 0, NULL)
    return bytes(out) if got == n else None


cdef inline ssize_t _read_from(int pid, void *dst, uint64_t src, size_t n, uint64_t word,
                               uint64_t *word_dst) noexcept nogil:
    """Copy ``n`` bytes at ``src`` in process ``pid`` to ``dst`` here, then (``word`` not 0) the 8
    bytes at ``word`` there to ``word_dst``: the bytes copied, or -1 (errno)."""
    cdef iovec here[2]
    cdef iovec there[2]
    here[0].iov_base, here[0].iov_len = dst, n
    there[0].iov_base, there[0].iov_len = <void *><uintptr_t>src, n
    here[1].iov_base, here[1].iov_len = word_dst, 8
    there[1].iov_base, there[1].iov_len = <void *><uintptr_t>word, 8
    return process_vm_readv(pid, here, 2 if word else 1, there, 2 if word else 1, 0)


@cython.final
cdef class HostRegion:
    """Memory the one-call path (pyx/hostcalls.pyx) works in where nothing is registered (the
    socket link's): what it reads of a MemoryRegion (address, length, keys 0), and ``closed`` once
    its owner let it go (the transport's own buffer grew)."""


    def __init__(self, memory):
        cdef const uint8_t[::1] view = memory
        self.memory = memory
        self.addr = <uint64_t><uintptr_t>&view[0] if view.shape[0] else 0
        self.length = view.shape[0]
