"""The one exception hierarchy of pyrdma.

Every error raised by the library is an RDMAError; the subclasses say what kind of
failure it was so callers can catch narrowly (``except pyrdma.CompletionError``).
"""
import errno as _errno
import os as _os


class RDMAError(Exception):
    """A verbs call or an RDMA operation failed.

    ``errno`` is the OS error number when the failure came from C (else None),
    ``call`` names the verbs call or operation, ``obj`` describes the object involved.
    """

    def __init__(self, message, errno=None, call=None, obj=None):
        self.errno = errno
        self.call = call
        self.obj = obj
        parts = []
        if call:
            parts.append(call)
        if obj:
            parts.append("on " + obj)
        prefix = " ".join(parts)
        text = f"{prefix}: {message}" if prefix else message
        if errno:
            name = _errno.errorcode.get(errno, str(errno))
            text += f" [errno {errno} {name}: {_os.strerror(errno)}]"
        super().__init__(text)


class UsageError(RDMAError, ValueError):
    """Bad input caught before it reached C: wrong bounds, flags, state or closed object."""


class CompletionError(RDMAError):
    """A work completion came back with a status other than SUCCESS."""

    def __init__(self, status, status_name, wr_id=None, opcode=None, qp_num=None, message=None):
        self.status = int(status)
        self.status_name = status_name
        self.wr_id = wr_id
        self.opcode = opcode
        self.qp_num = qp_num
        text = message or (f"work completion failed with status {status_name} ({self.status})"
                           f" for wr_id={wr_id} opcode={opcode} qp_num={qp_num}")
        super().__init__(text, call="ibv_poll_cq")


class RDMATimeoutError(RDMAError, TimeoutError):
    """A blocking wait ran past its timeout."""


class WireFormatError(RDMAError):
    """An out-of-band message was malformed, foreign or of an unsupported version."""


class PeerError(RDMAError):
    """A remote peer died, stalled or misbehaved; ``peer`` names it (rank or address)."""

    def __init__(self, message, peer=None, **kwargs):
        self.peer = peer
        super().__init__(message, **kwargs)


class MissingLibraryError(RDMAError):
    """rdma-core's libibverbs.so.1 or librdmacm.so.1 cannot be loaded, or lacks an entry point a call
    needs. pyrdma opens them on first use, so ``import pyrdma`` works without them.

    ``library`` is the soname, ``path`` the file pyrdma tried (``$PYRDMA_LIBIBVERBS`` /
    ``$PYRDMA_LIBRDMACM`` name another), ``symbol`` the missing entry point (None when the library
    itself is missing), ``reason`` what the dynamic loader said."""

    def __init__(self, library, reason, path=None, symbol=None, call=None):
        self.library = library
        self.path = path
        self.symbol = symbol
        self.reason = reason
        from pyrdma.advice import install_command
        if symbol:
            message = f"{path or library} has no {symbol}: this call needs a newer rdma-core; {install_command(library)}"
        else:
            message = f"cannot load {library} ({reason}); {install_command(library)}"
        super().__init__(message, call=call)


def raise_errno(call, err, obj=None, message=None):
    """Raise RDMAError for a failed C call that reported error number ``err``."""
    # verbs calls either return the error number or set errno; 0 means the provider said nothing.
    from pyrdma.advice import advice
    text = message or (_os.strerror(err) if err else "failed")
    hint = advice(call, err, obj)      # the environment's usual culprit, and the command that fixes it
    if hint:
        text += "; " + hint
    raise RDMAError(text, errno=err or None, call=call, obj=obj)
