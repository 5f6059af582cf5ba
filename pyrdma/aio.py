"""asyncio: await completions and asynchronous events on the event loop, without a thread.

A CompletionQueue made with a CompChannel, and a Context's async-event fd, are file descriptors;
these coroutines wait for them with ``loop.add_reader`` and then take what is there with the
non-blocking forms of the same calls (``poll_into``, ``wait(timeout=0)``,
``get_async_event(timeout=0)``). Bound a wait with ``asyncio.wait_for``.

    n = await pyrdma.aio.poll(cq, wcs, check=True)     # like cq.poll_wait(wcs, check=True)
    event = await pyrdma.aio.async_event(ctx)          # like ctx.get_async_event()
"""
import asyncio

from pyrdma.errors import UsageError

# (loop, fd) -> futures waiting for fd to be readable; one reader per fd, whoever waits on it
_waiters = {}


def _wake(key):
    loop, fd = key
    loop.remove_reader(fd)
    for fut in _waiters.pop(key, ()):
        if not fut.done():
            fut.set_result(None)


def _wake_all(fd):
    """Wake every coroutine waiting on ``fd`` on this loop, as if it had become readable."""
    key = (asyncio.get_running_loop(), fd)
    if key in _waiters:
        _wake(key)


async def readable(fd):
    """Return once ``fd`` is readable (several coroutines may wait on one fd, e.g. a shared channel)."""
    loop = asyncio.get_running_loop()
    key = (loop, fd)
    fut = loop.create_future()
    waiters = _waiters.get(key)
    if waiters is None:
        waiters = _waiters[key] = []
        loop.add_reader(fd, _wake, key)
    waiters.append(fut)
    try:
        await fut
    finally:
        waiters = _waiters.get(key)
        if waiters is not None and fut in waiters:     # cancelled before the fd woke it
            waiters.remove(fut)
            if not waiters:
                del _waiters[key]
                loop.remove_reader(fd)


async def poll(cq, wcs, min_entries=1, check=False):
    """Poll ``cq`` into the WC_DTYPE array ``wcs`` until ``min_entries`` completions are there,
    awaiting the CQ's completion channel in between; returns how many landed (up to len(wcs)).
    ``check=True`` raises CompletionError for a failed completion, as poll_wait(check=True) does."""
    if cq.channel is None:
        raise UsageError("pyrdma.aio.poll needs a CompletionQueue created with a CompChannel", obj=repr(cq))
    if not 1 <= min_entries <= len(wcs):
        raise UsageError(f"min_entries={min_entries} outside 1..{len(wcs)} (the size of wcs)")
    channel = cq.channel
    fd = channel.fileno()
    got = cq.poll_into(wcs, check)
    while got < min_entries:
        cq.req_notify()
        more = cq.poll_into(wcs[got:], check)     # what completed before the CQ was armed
        if more:
            got += more
            continue
        while True:
            redelivered = channel.redelivered
            if cq.wait(timeout=0):                  # the event may already be ours (a shared channel)
                break
            if channel.redelivered != redelivered:
                # we read another CQ's event off the fd: its waiter would sleep on past it
                _wake_all(fd)
            await readable(fd)
        got += cq.poll_into(wcs[got:], check)
    return got


async def async_event(context):
    """The next asynchronous event of ``context`` (an AsyncEvent, acknowledged)."""
    fd = context.fileno()
    while True:
        event = context.get_async_event(timeout=0)
        if event is not None:
            return event
        await readable(fd)
