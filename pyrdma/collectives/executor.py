"""The order in which a communicator's calls run, and the state a failure leaves (NCCL's
communicator state; gloo's context).

Calls run one at a time, in the order they were made on the calling thread: a blocking call runs
inline when nothing is queued, anything else on the communicator's own thread. Every collective
takes the next call number (the ``seq`` of every message's description; point-to-point messages
are numbered per pair of ranks instead). A call that fails halfway leaves the message streams out
of step for good: the executor tells the peers (an abort) and refuses every later call.
"""
import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor

from pyrdma.collectives.transport import LEFT, MISMATCH, NO_CULPRIT, PEER_FAILED, closed_error
from pyrdma.errors import PeerError, RDMAError, RDMATimeoutError, UsageError


class Handle:
    """A collective in flight. ``wait(timeout=None)`` returns its result (or raises its error);
    ``test()`` says whether it has finished. A wait that times out raises RDMATimeoutError and leaves
    the collective running (every collective ends by itself: its own waits have timeouts)."""

    def __init__(self, future, executor=None):
        self._future, self._executor = future, executor

    def test(self):
        return self._future.done()

    done = property(test)

    def add_done_callback(self, fn):
        """Call ``fn(handle)`` once the collective has finished (at once if it has), on the thread
        that finished it; ``fn`` then calls ``wait()`` for the result or the error without blocking."""
        self._future.add_done_callback(lambda _future: fn(self))

    def wait(self, timeout=None):
        if not self._future.done() and self._executor is not None:
            with self._executor.waiting():
                return self._result(timeout)
        return self._result(timeout)

    def _result(self, timeout):
        try:
            return self._future.result(timeout)
        except TimeoutError:
            if self._future.done():
                raise
            raise RDMATimeoutError(f"the collective is still running after {timeout} s", call="Handle.wait") from None


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
    reads ``idle`` and ``seq`` and calls ``fail``). ``idle``: no call is queued and the executor is
    neither closed nor broken (the one-call path's one check, instead of three attribute reads);
    it changes under ``_count_lock``, after the state it sums up."""

    def __init__(self, rank, size, transport, lock):
        self.rank, self.size, self.transport, self.lock = rank, size, transport, lock
        self.seq = 0
        # point-to-point messages sent to each rank so far, and received from each: their numbers
        # (per pair of ranks, apart from the collectives' call numbers ``seq``)
        self.sent = [0] * size
        self.received = [0] * size
        self.pending = 0
        self.broken = None
        self.closed = False
        self.idle = True
        self._count_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"pyrdma-comm-rank{rank}")

    def submit(self, blocking, fn, *args, seq=True):
        """Run ``fn(*args)`` after every collective submitted before it. ``seq``: it is a collective
        (it advances the call number that every rank's messages carry; point-to-point has its own
        numbers per pair of ranks)."""
        if self.closed:
            raise UsageError("the communicator is closed")
        self.raise_if_broken()
        if seq:
            self.seq += 1
        with self._count_lock:
            inline = blocking and self.pending == 0
            if not inline:
                self.pending += 1
                self.idle = False
        if inline:
            with self.lock:
                return Done(self._guarded(fn, *args))
        future = self._pool.submit(self._run_queued, fn, *args)
        return Handle(future, self)

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

    def _run_queued(self, fn, *args):
        try:
            with self.lock:
                if self.closed:
                    raise closed_error()
                self.raise_if_broken()
                self.transport.background = True
                try:
                    return self._guarded(fn, *args)
                finally:
                    self.transport.background = False
        finally:
            with self._count_lock:
                self.pending -= 1
                self._update_idle()

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
            self.idle = False
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

    def _update_idle(self):
        self.idle = self.pending == 0 and not self.closed and self.broken is None

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
            self.idle = False
        self.transport.interrupt()
        self._pool.shutdown(wait=True)
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
