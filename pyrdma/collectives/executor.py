"""The order in which a communicator's calls run, and the state a failure leaves (NCCL's
communicator state; gloo's context).

Calls run one at a time, in the order they were made on the calling thread: a blocking call runs
inline when nothing is queued, anything else on the communicator's own thread (or on a thread that
waits for it, if that thread has not started it: _Queue). Every collective
takes the next call number (the ``seq`` of every message's description; point-to-point messages
are numbered per pair of ranks instead). A call that fails halfway leaves the message streams out
of step for good: the executor tells the peers (an abort) and refuses every later call.
"""
import atexit
import collections
import contextlib
import logging
import threading
import weakref

from pyrdma._hostcalls import ExecState, Waker
from pyrdma.collectives.transport import LEFT, MISMATCH, NO_CULPRIT, PEER_FAILED, closed_error
from pyrdma.errors import PeerError, RDMAError, RDMATimeoutError, UsageError

_log = logging.getLogger("pyrdma")

# How long a queued call waits for its caller to run it (Handle.wait) before the communicator's own
# thread is woken to run it: a caller that waits at once (most non-blocking calls) runs it without
# a thread switch; one that goes on working (DDP's bucket allreduces) has it started this late.
WAKE_DELAY = 0.0002


class _Job:
    """A call queued on the communicator's thread, and its outcome: what concurrent.futures' Future
    is to a ThreadPoolExecutor, for one queue (a plain lock, held until the job has run, instead of
    a Condition: a tenth of the Python). ``fn(background, *args)`` runs it."""
    __slots__ = ("fn", "args", "_finished", "_done", "_result", "_error", "_callbacks", "_callback_lock")

    def __init__(self, fn, args):
        self.fn, self.args = fn, args
        self._finished = threading.Lock()
        self._finished.acquire()
        self._done = False
        self._result = self._error = None
        self._callbacks = []
        self._callback_lock = threading.Lock()

    def run(self, background):
        try:
            self._result = self.fn(background, *self.args)
        except BaseException as exc:     # noqa: BLE001 -- the waiter's to raise
            self._error = exc
        self.fn = self.args = None
        self._finished.release()
        with self._callback_lock:
            self._done = True
            callbacks, self._callbacks = self._callbacks, None
        for fn in callbacks:
            try:
                fn(self)
            except Exception:            # as a Future's callback: logged, the thread goes on
                _log.exception("a callback of a pyrdma collective raised")

    def done(self):
        return self._done

    def add_done_callback(self, fn):
        with self._callback_lock:
            if not self._done:
                self._callbacks.append(fn)
                return
        fn(self)

    def result(self, timeout=None):
        if not self._done:
            if not self._finished.acquire(timeout=-1 if timeout is None else max(timeout, 0)):
                raise TimeoutError
            self._finished.release()
        if self._error is not None:
            raise self._error
        return self._result


class _Queue:
    """The queued calls of a communicator, run one at a time in order by whoever holds ``_runner``:
    the communicator's thread, or a caller that waits for one of them (``help``) and runs the queue
    up to it itself. Python threads share one GIL, so the communicator's thread seldom gets to start
    a call before its caller blocks in wait() anyway; the caller running it spares two thread
    wake-ups (over TCP, 2 ranks on 2 cores, a torch all_to_all_single of 128 KiB with async_op=True
    waited for at once: 1.64x gloo's time when the thread ran it, 1.03-1.51x in two runs since).
    So the thread is not woken at each put, which took the GIL from the caller all the same, but
    WAKE_DELAY after it by a Waker (a timer in C), and not at all if a waiter emptied the queue
    first (a numpy iallreduce of 8 B waited for at once: 16 -> 8 us).
    The thread is a daemon, so that an unclosed communicator does not hold the interpreter up; at
    exit the calls queued so far still run (as a ThreadPoolExecutor's would)."""
    _live = weakref.WeakSet()

    def __init__(self, name):
        self._jobs = collections.deque()
        self._waker = Waker(WAKE_DELAY)
        self._runner = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._started = self._stopping = False
        self._start_lock = threading.Lock()

    def put(self, job):
        if not self._started:
            with self._start_lock:
                if not self._started:
                    self._waker.start()
                    self._thread.start()
                    self._started = True
                    _Queue._live.add(self)
        self._jobs.append(job)
        self._waker.arm()

    def help(self, job):
        """Run the queue up to ``job`` on this thread, if no other runs it now; whether it did."""
        if not self._runner.acquire(blocking=False):
            return False
        try:
            jobs = self._jobs
            while not job._done and jobs:       # (_run's loop, written out: one Python call less per wait)
                jobs.popleft().run(False)
            if not self._jobs:
                # nothing left for the thread to wake up for (a job put meanwhile arms it again)
                self._waker.disarm()
                if self._jobs:
                    self._waker.arm()
        finally:
            self._runner.release()
        return True

    def _run(self, background, until=None):
        jobs = self._jobs
        while until is None or not until._done:
            try:
                job = jobs.popleft()
            except IndexError:
                return
            job.run(background)

    def _loop(self):
        while True:
            self._waker.sleep()
            with self._runner:
                self._run(True)
                if self._stopping:          # (a call queued before stop() began runs still)
                    self._run(True)
                    return

    def stop(self, timeout=None):
        """Stop once the jobs queued so far have run; wait for that (``timeout``: at most so long)."""
        with self._start_lock:
            started, self._started = self._started, True     # a put after this would start nothing
        if started:
            self._stopping = True
            self._waker.wake()
            if self._thread is not threading.current_thread():
                self._thread.join(timeout)
        self._waker.close()


@atexit.register
def _stop_queues():
    for jobs in list(_Queue._live):
        jobs.stop()


class Handle:
    """A collective in flight. ``wait(timeout=None)`` returns its result (or raises its error);
    ``test()`` says whether it has finished. A wait that times out raises RDMATimeoutError and leaves
    the collective running (every collective ends by itself: its own waits have timeouts)."""

    def __init__(self, job, executor=None):
        self._job, self._executor = job, executor

    def test(self):
        return self._job.done()

    done = property(test)

    def add_done_callback(self, fn):
        """Call ``fn(handle)`` once the collective has finished (at once if it has), on the thread
        that finished it; ``fn`` then calls ``wait()`` for the result or the error without blocking."""
        self._job.add_done_callback(lambda _job: fn(self))

    def wait(self, timeout=None):
        executor = self._executor
        if not self._job._done and executor is not None:
            # without a timeout, run it here if the communicator's thread has not started it
            # (with one, it must go on running after the wait: on that thread)
            if timeout is None and executor.queue.help(self._job):
                return self._result(None)
            with executor.waiting():
                return self._result(timeout)
        return self._result(timeout)

    def _result(self, timeout):
        try:
            return self._job.result(timeout)
        except TimeoutError:
            if self._job.done():
                raise
            raise RDMATimeoutError(f"the collective is still running after {timeout} s", call="Handle.wait") from None


class PairHandle(Handle):
    """The Handle of a non-blocking batch of one send and one receive run as one exchange (one C
    call, as isendrecv): wait() gives the batch's list, None for the send and the elements
    received for the receive, in the order of the batch's ops."""

    def __init__(self, handle, send_first):
        super().__init__(handle._job, handle._executor)
        self._send_first = send_first

    def _result(self, timeout):
        got = super()._result(timeout)
        return [None, got] if self._send_first else [got, None]


class SendHandle:
    """The Handle of a call that sends point-to-point messages (isend, batch). Over RDMA a message
    of rendezvous size from the caller's memory leaves its turn once the receiver is told of it (a
    parked send: the transport's ``parked_ticket``), so that the calls after it run meanwhile, as
    MPI's progress rule wants (an isend, then a collective, then the receive on the other side).
    Their waits write it when the receiver answers; wait() finishes it. The job returns (result,
    tickets of its parked sends). Its memory is the caller's again once wait() returns or test()
    says True."""

    def __init__(self, handle, executor, transport):
        self._handle, self._executor, self._transport = handle, executor, transport

    def _pending(self, tickets=None):
        """The tickets of its parked sends (``tickets``, else the call's, which must have left its
        turn) not finished yet."""
        if tickets is None:
            _, tickets = self._handle.wait()
        return [t for t in tickets if not self._transport.finished(t)]

    def test(self):
        if not self._handle.test():
            return False
        try:
            return not self._pending()
        except BaseException:
            return True

    done = property(test)

    def add_done_callback(self, fn):
        """``fn(handle)`` once the call is done, its parked sends included: those are settled by a
        call queued behind the ones made meanwhile, never waited for here (this runs on the
        communicator's own thread, which must go on to run them)."""
        def left_its_turn(_handle):
            try:
                pending = self._pending()
                if pending:
                    self._executor.submit(False, self._settle, pending, seq=False).add_done_callback(
                        lambda _settled: fn(self))
                    return
            except BaseException:     # the error is wait()'s to raise
                pass
            fn(self)
        self._handle.add_done_callback(left_its_turn)

    def _settle(self, tickets):
        for ticket in tickets:
            self._transport.settle(ticket)

    def wait(self, timeout=None):
        result, tickets = self._handle.wait(timeout)
        pending = self._pending(tickets)
        if pending:
            self._executor.submit(True, self._settle, pending, seq=False).wait(timeout)
        return result


class Done:
    """A Handle-like result of a call that ran inline: its ``result``, or the ``error`` it raised,
    which wait() raises (as a queued call's Handle does)."""

    def __init__(self, result=None, error=None):
        self._result, self._error = result, error

    def test(self):
        return True

    done = property(test)

    def add_done_callback(self, fn):
        fn(self)

    def wait(self, timeout=None):
        if self._error is not None:
            raise self._error
        return self._result


class Executor:
    """Runs a communicator's calls (see the module's docstring). ``lock`` is held while a call runs
    (reentrant: close() from inside a call's own thread, a signal handler, must not deadlock; over
    RDMA an ExecLock, which pyrdma._hostcalls.HostCollectives takes without a Python call, and which
    reads ``state`` and calls ``fail``). ``state`` (pyrdma._hostcalls.ExecState: C fields, which
    the one-call path reads without a dict lookup; a plain attribute here, as a base class it would
    slow every attribute of this class): ``idle``, no call is queued and the executor is neither
    closed nor broken (the one-call path's one check, instead of three attribute reads), which
    changes under ``_count_lock``, after the state it sums up; ``seq``, the next call number."""

    def __init__(self, rank, size, transport, lock):
        self.rank, self.size, self.transport, self.lock = rank, size, transport, lock
        self.state = ExecState()       # idle, call number 0
        # point-to-point messages sent to each rank so far, and received from each: their numbers
        # (per pair of ranks, apart from the collectives' call numbers ``seq``)
        self.sent = [0] * size
        self.received = [0] * size
        self.pending = 0
        self.broken = None
        self.closed = False
        self._count_lock = threading.Lock()
        self.queue = _Queue(f"pyrdma-comm-rank{rank}")

    def submit(self, blocking, fn, *args, seq=True):
        """Run ``fn(*args)`` after every collective submitted before it. ``seq``: it is a collective
        (it advances the call number that every rank's messages carry; point-to-point has its own
        numbers per pair of ranks)."""
        if self.closed:
            raise UsageError("the communicator is closed")
        if self.broken is not None:
            self.raise_if_broken()
        if seq:
            self.state.seq += 1
        with self._count_lock:
            inline = blocking and self.pending == 0
            if not inline:
                self.pending += 1
                self.state.idle = False
        if inline:
            with self.lock:
                return Done(self._guarded(fn, *args))
        job = _Job(self._run_queued, (fn,) + args)
        self.queue.put(job)
        return Handle(job, self)

    @contextlib.contextmanager
    def waiting(self):
        """While a thread waits for a queued call: the engine's background runs spin (Engine.waiters)."""
        engine = getattr(self.transport, "engine", None)
        if engine is None:
            yield
            return
        with self._count_lock:
            engine.waiters += 1
        try:
            yield
        finally:
            with self._count_lock:
                engine.waiters -= 1

    def _run_queued(self, background, fn, *args):
        # (every queued call runs this: _guarded written out, a Python call less each time)
        try:
            with self.lock:
                if self.closed:
                    raise closed_error()
                if self.broken is not None:
                    self.raise_if_broken()
                self.transport.background = background
                try:
                    return fn(*args)
                except BaseException as exc:
                    self.fail(exc)
                    raise
                finally:
                    self.transport.background = False
        finally:
            with self._count_lock:
                self.pending -= 1
                self.state.idle = self.pending == 0 and not self.closed and self.broken is None

    def _guarded(self, fn, *args):
        try:
            return fn(*args)
        except BaseException as exc:
            self.fail(exc)
            raise

    def fail(self, exc):
        """A collective failed halfway: the message streams are out of step for good. Tell the
        peers (so they fail now rather than at their timeout) and refuse further collectives."""
        if self.broken is not None:
            return
        self.broken = exc
        with self._count_lock:
            self.state.idle = False
        culprit = getattr(exc, "peer", None)
        if not isinstance(culprit, int) or not 0 <= culprit < self.size:
            culprit = self.rank if not isinstance(exc, RDMAError) else NO_CULPRIT
        if getattr(exc, "closed", False) or isinstance(exc, KeyboardInterrupt):
            culprit, reason = self.rank, LEFT      # closed (or interrupted) here: this rank leaves
        else:
            reason = MISMATCH if isinstance(exc, UsageError) else PEER_FAILED
        try:
            self.transport.abort(culprit, reason)
        except Exception:
            pass

    def raise_if_broken(self):
        exc = self.broken
        if exc is None:
            return
        cls = UsageError if isinstance(exc, UsageError) else PeerError
        err = cls(f"the communicator is unusable after an earlier failure: {exc}")
        err.peer = getattr(exc, "peer", None)
        raise err

    def close(self, timeout):
        """Stop taking calls, make the running one leave (its next wait raises "closed"), wait for
        the queued ones to finish that way, then close the transport."""
        if self.closed:
            return
        # a blocking call that returned may have left its sends in flight (over RDMA): they go
        # before the connections do, unless a call of another thread holds the transport
        if not self.broken and self.lock.acquire(blocking=False):
            try:
                self.transport.finish_sends(min(timeout, 5.0))
            finally:
                self.lock.release()
        self.closed = True
        with self._count_lock:
            self.state.idle = False
        self.transport.interrupt()
        self.queue.stop()
        # a blocking call of another thread leaves at its next wait (CLOSE_POLL), or at its timeout
        # if it sits in a send that cannot finish
        if self.lock.acquire(timeout=timeout):
            try:
                self.transport.close()
            finally:
                self.lock.release()
        else:
            raise UsageError("close(): a collective of another thread did not leave within the timeout; "
                             "the transport stays open")
