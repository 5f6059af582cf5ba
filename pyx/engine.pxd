# The collective engine's C types (pyx/engine.pyx -> pyrdma._engine), for the modules that drive it
# (pyx/hostcalls.pyx: the one-call host collectives).
cimport cython
from libc.stdint cimport uint8_t, uint32_t, uint64_t, int64_t
from pyrdma._verbs.libibverbs cimport ibv_qp, ibv_cq, ibv_comp_channel, ibv_wc
from pyrdma._verbs.base cimport pollfd

# schedule layout (pyrdma.collectives.schedule mirrors these; LAYOUT lets a test compare)
cdef enum:
    STEP_COLUMNS = 8
    CHUNK_COLUMNS = 3
    EXCHANGE = 0
    WAIT_SENDS = 1
    OFFER = 2                        # tell a peer where its chunks lie here, for it to read them
    FETCH = 3                        # RDMA READ the chunks a peer offers
    SPREAD = 4                       # EXCHANGE, run together with the SPREAD steps next to it
    ASK = 5                          # tell a peer where the chunks it sends here go, for it to write them
    PUT = 6                          # RDMA WRITE chunks where the peer asked
    LANDED = 7                       # take a peer's NOTICE (the one behind its PUT: its chunks are in place)
    NOTICE = 8                       # a zero-byte placed message: "I write" ahead of a PUT, "done" behind it
    CONSUME_NONE = 0
    CONSUME_COPY = 1
    CONSUME_REDUCE = 2
    CONSUME_REDUCE_LOWER = 3
    CONSUME_REDUCE_UPPER = 4
    CONSUME_COPY_UPTO = 5            # a point-to-point message of at most the chunks' length

# the wire (transport.py documents it)
cdef enum:
    KIND_DATA = 0
    KIND_CREDIT = 1
    KIND_ABORT = 2
    KIND_CONTROL = 3
    CTRL_QUERY = 0
    CTRL_REPORT = 1
    CTRL_CTS = 2                     # rendezvous: the receiver's buffer is in the sender's mailbox
    CTRL_READ = 3                    # the socket link: this many of your address frames are read
    LEN_MASK = 0x7FFFFF
    CREDIT_SHIFT = 23                # a data message's immediate returns up to CREDIT_MASK credits
    CREDIT_MASK = 0x7F
    DESC_SIZE = 44
    HEADER_SIZE = 48
    C_HEADER_ROOM = 64
    NWC = 64
    RDV_MAX_WRITE = 1 << 30          # the longest RDMA WRITE of a rendezvous (larger ones are split)
    SOCK_HEAD = 56                   # the socket link's frame head: the immediate (4), the header (48)
    ADDRESS_FRAME = 24               # an address frame's payload (txframe_t.where)
    DESC_KIND_AT = 38                # the byte of a description that says its kind
    DESC_KIND_SEND = 13              # ... for a point-to-point message (transport.base.KINDS)
    DESC_PLACED_AT = 41              # the byte of a description that marks an offer, ask or landed header

# what a wait waits for, and the kinds of failure (failure())
cdef enum:
    WAIT_CREDIT = 0
    WAIT_ARRIVAL = 1
    WAIT_SEND_QUEUE = 2
    WAIT_SENDS_DONE = 3
    WAIT_CTS = 4
    WAIT_SPREAD = 5                  # an arrival or a credit for any exchange of a spread
    FAIL_NONE = 0
    FAIL_LINK = 1
    FAIL_ABORT = 2
    FAIL_MISMATCH = 3
    FAIL_TIMEOUT = 4
    FAIL_CLOSED = 5
    FAIL_POST = 6
    FAIL_POLL = 7
    FAIL_MALFORMED = 8
    FAIL_PYTHON = 9
    FAIL_MEMORY = 10
    FAIL_ADDRESS = 11                # an address frame that points outside its sender's memory, or (a = -1)
                                     # whose sender gave up on it before it was read (Engine.live)

cdef extern from "Python.h":
    ctypedef struct PyThreadState
    PyThreadState *PyEval_SaveThread() nogil
    void PyEval_RestoreThread(PyThreadState *state) nogil


# A message taken out of its slot to wait for a receive of its class (MPI's unexpected-message
# queue): a point-to-point message that arrived while a collective ran, or a collective's that
# arrived while a point-to-point receive ran. Its payload follows the struct.
cdef struct kept_t:
    kept_t *next
    uint32_t length
    uint8_t header[C_HEADER_ROOM]


# A frame queued on the socket link (its head, then ``length`` bytes at ``addr``), written as the
# socket takes it.
cdef struct txframe_t:
    uint8_t head[SOCK_HEAD]
    uint32_t head_len
    uint32_t length
    uint64_t addr
    uint64_t done            # bytes of head and payload written so far
    int data                 # the payload is read from the work area (data_outstanding counts it)
    uint8_t *owned           # a copy of the payload the engine owns (a failed run's frame mid-write)
    int by_address           # an address frame: its payload is ``where``, the peer reads the data
    uint64_t where[3]        # (in place of the data: process_vm_readv): the data's address, then
                             # the address and value of the word that says it is still there (live)


cdef struct peer_t:
    ibv_qp *qp
    uint64_t remote          # our receive slots in the peer's memory
    uint32_t rkey
    uint8_t *slots           # the peer's receive slots here
    uint8_t *headers         # our header staging for messages to the peer (one per slot)
    int credits
    int unreturned
    uint64_t send_seq
    uint64_t recv_seq
    int outstanding          # posted send WRs not completed yet
    int unsignaled           # inline sends posted unsignaled since the last signaled one
    int data_outstanding     # payloads among them
    uint32_t *arrivals       # lengths of arrived messages, a ring of ``slots`` entries
    int arr_head
    int arr_count
    int report               # the rank this peer says it waits for (this wait's epoch), -1: none
    uint8_t *mailbox         # where the peer writes its rendezvous answer (CTS) to us
    uint64_t remote_mailbox  # where we write ours in the peer's memory
    uint8_t *cts_staging     # our answer's source (registered with the headers)
    int cts                  # answers arrived and not yet acted on (0 or 1)
    kept_t *kept[2]          # kept messages, oldest first: [0] collectives', [1] point-to-point
    kept_t *kept_last[2]
    kept_t *taken            # the kept message _recv returned, freed by _release
    int held                 # slots that hold a message not returned yet (a peer never fills more)
    # the socket link (Engine.over_sockets); fd is -1 on the verbs link
    int fd
    int gone                 # the peer's end closed (EOF or a read error; a failed write of data)
    int deaf                 # a write of no data failed (the peer closed after its last call):
                             # nothing more is written to it, what it sent before is still read
    txframe_t *txq           # frames to write, a ring of sq_depth (``outstanding`` of them queued)
    int tx_head
    uint8_t *rx              # bytes read ahead of the frame being parsed
    int rx_lo, rx_hi
    int rx_state             # which piece of a frame is read: its immediate, header or payload
    uint8_t rx_imm[4]
    uint8_t *rx_dst          # where that piece goes
    uint32_t rx_need, rx_got
    int rx_direct            # the payload being read goes straight into its receive's destination
    int directed             # the first arrivals (not taken yet) whose payloads went there (a
                             # receive takes its message's from its destination, not the slot)
    # Same machine (Engine.read_memory_of): a payload of at least ``by_address_bytes``
    # goes as an address frame, whose receiver copies it out of the sender's memory itself (one
    # copy, where a socket makes two) and says so (CTRL_READ); the send completes then.
    int pid                  # the peer's process, whose memory its address frames point into (0: none)
    int addresses_to         # the peer reads ours: large payloads go to it as address frames
    int unread               # our address frames it has not said it read (data_outstanding counts them)
    int reads_owed           # its address frames read here and not yet said (CTRL_READ)
    int rx_by_address        # the frame being read is an address frame (rx_where its payload)
    uint32_t rx_length       # ... of that many bytes (its header's length)
    uint8_t *rx_header       # ... whose header is here (its slot)
    uint64_t rx_where[3]


@cython.final
cdef class Program:
    cdef object arrays                # the schedule's arrays, kept alive for the pointers below
    cdef const int64_t *steps
    cdef const int64_t *chunks
    cdef Py_ssize_t nsteps
    cdef int rank, size, max_message
    cdef readonly int64_t extent
    cdef readonly int64_t reduce_align
    cdef readonly bint writes         # it has ASK, PUT or LANDED steps: RDMA only

    cdef int _peer(self, int64_t peer, Py_ssize_t s) except -1
    cdef int _check(self, int rank, int size, int max_message, const int64_t[:, ::1] steps,
                    const int64_t[:, ::1] chunks, object keep=*) except -1


@cython.final
cdef class Engine:
    cdef peer_t *peers
    cdef int rank, size, slots, slot_stride, max_message, sq_depth, credit_batch
    cdef int signal_every            # an inline send asks for a completion once in this many
    cdef double timeout, probe_lead, spin
    cdef double spin_now             # this run's spin: ``spin_adaptive``, or 0 in the background
    # the spin of a foreground wait: ``spin`` at first, doubled (up to SPIN_MAX) after a sleep that
    # a completion ended soon, halved back toward ``spin`` after one that lasted
    cdef readonly double spin_adaptive
    cdef int max_inline              # a message this long (header room included) is posted inline
    cdef ibv_cq *cq
    cdef ibv_comp_channel *channel
    cdef uint32_t header_lkey
    cdef uint8_t *slot_base
    cdef ibv_wc wcs[NWC]
    cdef uint8_t *queried
    cdef uint8_t *visited
    # the spread that runs (_spread): its steps, how many, and per step the chunks sent and received
    cdef const int64_t *spread_steps
    cdef int spread_count
    cdef int *spread_done
    cdef int closing
    cdef bint signals
    cdef int epoch
    cdef int waiting_on
    # the collective now running
    cdef uint8_t desc[DESC_SIZE]     # what its messages carry
    cdef uint8_t placed_desc[DESC_SIZE]   # desc, marked: what its offers, asks and landed headers carry
    cdef uint8_t rdesc[DESC_SIZE]    # what the messages it receives must carry (point-to-point: the
                                     # sender's own sequence and count; else the same as desc)
    cdef readonly int64_t received   # bytes of the last point-to-point message (CONSUME_COPY_UPTO)
    cdef uint32_t last_length        # of the message _recv returned
    cdef uint64_t last_count         # the count field of its description
    cdef uint8_t *work
    cdef int64_t work_len
    cdef uint32_t work_lkey
    # a run may have a second work area (run's ``out``): the offsets from ``split`` on lie in it
    cdef uint8_t *work2
    cdef int64_t split
    cdef uint32_t work2_lkey
    cdef uint32_t work2_rkey
    cdef int dtype, op, itemsize
    cdef object consume              # None, or the Python callback of GPU work areas
    cdef object py_error             # an exception raised in a callback or a signal handler
    # the failure (sticky: the message streams are out of step after one)
    cdef int fail_kind, fail_peer, fail_what
    cdef int64_t fail_a, fail_b
    cdef uint8_t fail_desc[DESC_SIZE]
    cdef list keep                   # the verbs objects whose handles the engine uses
    cdef readonly unsigned long long runs
    # rendezvous: a point-to-point message of at least this many bytes (0: none) is written straight
    # into the receiver's buffer, whose address the receiver sends when the header (RTS) arrives
    cdef public int64_t rendezvous_bytes
    cdef bint mailboxes              # the regions have them (else rendezvous stays off)
    cdef uint32_t work_rkey
    cdef int rdv_peer                # the send waiting for its receiver's answer, -1: none
    cdef int64_t rdv_len
    cdef uint64_t rdv_addr           # its payload (registered under rdv_lkey) and description, kept
    cdef uint32_t rdv_lkey           # so that a later run may write it once parked
    cdef uint8_t rdv_desc[DESC_SIZE]
    cdef bint park                   # this run's rendezvous send may stay pending after it (isend)
    # this run returns without waiting for its sends to complete (its final WAIT_SENDS): they read
    # the transport's own buffer, and whatever writes there next drains them first (_drain)
    cdef bint defer_sends
    cdef readonly unsigned long long parks     # rendezvous sends left pending by a run, so far
    cdef bint hold_gil               # the run holds the GIL until a wait (_execute_holding_gil)
    cdef PyThreadState *released     # the thread state a wait of such a run saved, releasing the GIL
    cdef readonly unsigned long long polls      # CQ polls, and sleeps on the completion channel, so far
    cdef readonly unsigned long long sleeps
    # A spin yields the CPU between polls only where the ranks may outnumber this machine's CPUs
    # (size > online CPUs): there the peer waited for gets the CPU now. Elsewhere each yield is just
    # a system call (~2 us in the Soft-RoCE VM) between two polls, on the path of every wake-up.
    cdef public bint spin_yields
    # The ranks outnumber the CPUs (the same measure): the spin never grows past ``spin``, since a
    # longer one spends the core a peer needs (4 ranks on 2 cores, 128 MiB all-to-all over TCP:
    # 213 ms with the spin grown, 170 ms without spinning)
    cdef public bint crowded
    # Threads waiting for a result of this communicator (Executor.waiting): a background run
    # (spin 0, leaving the CPU to the caller's work) spins while one waits, since nothing of the
    # caller's then runs (128 KiB ibroadcast().wait() over TCP, 2 ranks: 134-147 -> 55 us)
    cdef public int waiters
    cdef bint in_background          # this run's or wait's (_hold)
    cdef readonly bint sockets       # the socket link: peers' fd, not qp (Engine.over_sockets)
    cdef pollfd *pfds                # its poll() set, one per rank
    cdef object slot_owner           # the memory of its slots
    # a receive waiting on the socket link for a message of its call, whose payload may be read
    # straight into its destination (the work area), not into the slot: peer (-1: none), where, how
    # long (``post_upto``: at most that long, a point-to-point message's)
    cdef int post_peer
    cdef uint8_t *post_dst
    cdef int64_t post_len
    cdef bint post_upto
    # an exchange's chunks from ``exp_peer`` (-1: none), ``exp_count`` of them at ``exp_chunks``
    # (consumed as ``exp_ck``): each arriving message of the call that has the length of chunk
    # ``exp_next`` is that chunk (a peer sends them in order), read straight into its place while
    # every earlier arrival from that peer was too
    cdef int exp_peer, exp_next, exp_count, exp_ck
    cdef const int64_t *exp_chunks
    cdef readonly unsigned long long directs    # payloads read straight into place so far
    cdef readonly unsigned long long keeps      # messages copied out of their slots (_keep) so far
    cdef readonly unsigned long long reads      # payloads copied out of a peer's memory (address frames)
    cdef int64_t _by_address_bytes
    # what this process's address frames point to is theirs while this word holds the value they
    # carry: a failed run changes it before the caller has its memory back, so a reader that comes
    # later (its abort not yet read) finds the word changed and fails instead of taking the bytes
    cdef uint64_t live

    cdef int _check_peer(self, int peer) except -1
    cdef int _runs_here(self, Program prog) except -1
    cdef int _begin(self, Program prog, uint64_t work_addr, int64_t work_len, uint32_t work_lkey,
                    const uint8_t *desc, int dtype, int op, object consume, bint background=*,
                    uint32_t work_rkey=*) except -1
    cdef int _hold(self, bint background) except -1
    cdef void _let_go(self) noexcept
    cdef void _second_area(self, int64_t split, uint64_t addr, uint32_t lkey, uint32_t rkey) noexcept
    cdef bint _sends_pending(self) noexcept nogil
    cdef int _drain(self) noexcept nogil
    cdef void _end(self) noexcept
    cdef void _settle_reads(self) noexcept nogil
    cdef int _fail(self, int kind, int peer, int64_t a, int64_t b) noexcept nogil
    cdef int _execute(self, const int64_t *steps, Py_ssize_t nsteps, const int64_t *chunks) noexcept nogil
    cdef int _execute_holding_gil(self, Program prog) noexcept
    cdef int _spread(self, const int64_t *steps, int count, const int64_t *chunks) noexcept nogil
    cdef int _arrived(self, int peer) noexcept nogil
    cdef bint _spread_ready(self) noexcept nogil
    cdef int _exchange(self, int sp, const int64_t *sch, int ns, int rp, const int64_t *rch, int nr,
                       int ck) noexcept nogil
    cdef int _exchange_message(self, int sp, const int64_t *sch, int ns, int rp, const int64_t *rch,
                               int nr) noexcept nogil
    cdef int _rendezvous_receive(self, int peer, int64_t off, int64_t total) noexcept nogil
    cdef int _rendezvous_write(self) noexcept nogil
    cdef int _send_ahead(self, int sp, const int64_t *sch, int ns, int *sent, int k) noexcept nogil
    cdef bint _can_send(self, int peer) noexcept nogil
    cdef int _send(self, int peer, int64_t off, int64_t n) noexcept nogil
    cdef int _send_from(self, int peer, uint64_t addr, uint32_t lkey, int64_t n, const uint8_t *desc) noexcept nogil
    cdef int _tell_chunks(self, int peer, const int64_t *ch, int n) noexcept nogil
    cdef int _fetch(self, int peer, const int64_t *ch, int n) noexcept nogil
    cdef int _take_place(self, int peer, int64_t total, uint64_t *addr, uint32_t *rkey) noexcept nogil
    cdef int _post_rdma(self, int peer, int opcode, uint64_t local, uint32_t lkey, uint64_t addr, uint32_t rkey,
                        int64_t n) noexcept nogil
    cdef int _put(self, int peer, const int64_t *ch, int n) noexcept nogil
    cdef int _post_empty(self, int peer, uint32_t imm) noexcept nogil
    cdef uint8_t *_recv(self, int peer, int64_t n, bint upto=*, uint8_t *dst=*, bint placed=*) noexcept nogil
    cdef int _keep(self, peer_t *p, const uint8_t *start, uint32_t got) noexcept nogil
    cdef uint8_t *_slot(self, peer_t *p, uint64_t seq) noexcept nogil
    cdef uint8_t *_take_head(self, peer_t *p, uint32_t *got) noexcept nogil
    cdef int _keep_head(self, int peer) noexcept nogil
    cdef int _release(self, int peer) noexcept nogil
    cdef int _return_slot(self, int peer) noexcept nogil
    cdef int _consume(self, int kind, const int64_t *chunk, uint8_t *data) noexcept nogil
    cdef int _callback(self, int kind, int64_t off, int64_t n, int64_t aux, uint8_t *data) noexcept nogil
    cdef int _check_signals(self) noexcept nogil
    cdef bint _ready(self, int what, int peer) noexcept nogil
    cdef int _chain_end(self, int peer) noexcept nogil
    cdef int _wait(self, int what, int peer, int64_t n) noexcept nogil
    cdef int _progress(self, double seconds) noexcept nogil
    cdef int _handle(self, int n) noexcept nogil
    cdef uint8_t *_at(self, int64_t off) noexcept nogil
    cdef int _on_imm(self, int peer, uint32_t imm) noexcept nogil
    cdef int _init_common(self, int rank, int size, int slots, int slot_stride, int max_message, int sq_depth,
                          double timeout, double spin) except -1
    cdef int _keep_arrivals(self) noexcept nogil
    cdef int _sock_send(self, int peer, uint64_t addr, int64_t n, const uint8_t *desc) noexcept nogil
    cdef int _sock_queue(self, int peer, uint32_t imm, const uint8_t *desc, uint64_t addr, uint32_t n,
                         bint by_address=*) noexcept nogil
    cdef uint8_t *_rx_place(self, int peer, const uint8_t *header, uint32_t length) noexcept nogil
    cdef int _read_by_address(self, int peer) noexcept nogil
    cdef int _say_read(self, int peer) noexcept nogil
    cdef int _sock_flush(self, int peer) noexcept nogil
    cdef int _sock_read(self, int peer, bint last_words) noexcept nogil
    cdef int _sock_piece(self, int peer) noexcept nogil
    cdef bint _direct_ok(self, const uint8_t *header, uint32_t length) noexcept nogil
    cdef bint _is_chunk(self, const uint8_t *header, uint32_t length, int64_t n) noexcept nogil
    cdef void _expect(self, int peer, int ck, const int64_t *chunks, int k, int count) noexcept nogil
    cdef uint8_t *_dst(self, int kind, const int64_t *chunk) noexcept nogil
    cdef int _sock_lost(self, int peer, int err) noexcept nogil
    cdef int _sock_pass(self) noexcept nogil
    cdef int _poll_link(self) noexcept nogil
    cdef int _sleep_link(self, double seconds) noexcept nogil
    cdef void _adapt_spin(self, bint woken, double slept) noexcept nogil


@cython.final
cdef class HostRegion:
    cdef readonly uint64_t addr, length
    cdef readonly uint32_t lkey, rkey
    cdef public bint closed
    cdef readonly object memory
