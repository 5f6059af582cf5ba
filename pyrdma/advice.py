"""What the environment does to RDMA, and the command that fixes it.

One place for the advice that both an error at the point of failure (``pyrdma.errors.raise_errno``)
and ``pyrdma.doctor`` give: the memlock limit behind an ENOMEM from ``ibv_reg_mr``, the device file
behind a failed ``ibv_open_device``, the packages behind a missing ``libibverbs.so.1``. Pure Python:
it works where the extension or rdma-core cannot be loaded.
"""
import errno as _errno
import os
import resource

GIB = 1 << 30
CAP_IPC_LOCK = 14          # linux/capability.h: exempts a process from RLIMIT_MEMLOCK when pinning
SYSFS = "/sys"
DEV_INFINIBAND = "/dev/infiniband"

MEMLOCK_FIX = ("raise it: `ulimit -l unlimited` in the shell that starts the job (as root, or after "
               "`* - memlock unlimited` in /etc/security/limits.conf), `docker run --ulimit memlock=-1` in a "
               "container, `LimitMEMLOCK=infinity` in a systemd unit")

# (Debian/Ubuntu, RHEL/Fedora) packages per run-time library
LIBRARY_PACKAGES = {
    "libibverbs.so.1": ("libibverbs1 ibverbs-providers", "rdma-core libibverbs"),
    "librdmacm.so.1": ("librdmacm1", "librdmacm"),
}


def install_command(library):
    """The install commands for a run-time library of rdma-core, both distribution families."""
    debian, rhel = LIBRARY_PACKAGES[library]
    return f"apt-get install {debian} (Debian/Ubuntu) or dnf install {rhel} (RHEL/Fedora)"


def missing_library(exc):
    """The rdma-core library a failure to load names (``exc``: the error or the dynamic loader's
    text; librdmacm.so.1 fails when the libibverbs.so.1 it needs is missing), or None."""
    text = str(exc)
    for library in LIBRARY_PACKAGES:
        if library.split(".so")[0] in text:
            return library
    return None


def load_fix(exc):
    """The command that fixes an ImportError/OSError of pyrdma's extension."""
    library = missing_library(exc)
    if library is not None:
        return install_command(library)
    if isinstance(exc, ModuleNotFoundError):
        return "build it: `pip install .`, or `python3 setup.py build_ext --inplace` in the source tree"
    return "reinstall pyrdma (`pip install --force-reinstall .` from the source tree)"


# ---- memlock --------------------------------------------------------------------------------------

def _status_field(name, path="/proc/self/status"):
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(name + ":"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def has_ipc_lock():
    """Whether this process holds CAP_IPC_LOCK (then the kernel pins memory past RLIMIT_MEMLOCK)."""
    caps = _status_field("CapEff")
    return caps is not None and bool(int(caps, 16) >> CAP_IPC_LOCK & 1)


def locked_bytes():
    """Bytes this process has pinned or locked now (VmLck + VmPin of /proc/self/status)."""
    total = 0
    for field in ("VmLck", "VmPin"):
        value = _status_field(field)
        if value and value.endswith("kB"):
            total += int(value.split()[0]) * 1024
    return total


def format_limit(value):
    if value == resource.RLIM_INFINITY:
        return "unlimited"
    if value >= 1 << 20 and value % (1 << 20) == 0:
        return f"{value >> 20} MiB"
    if value >= 1024 and value % 1024 == 0:
        return f"{value >> 10} KiB"
    return f"{value} bytes"


def memlock_state(nbytes=GIB):
    """The memlock limit and whether registering ``nbytes`` more would fit: a dict with ``soft``,
    ``hard`` (bytes or None for unlimited), ``locked``, ``cap_ipc_lock`` and ``fits``."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    cap = has_ipc_lock()
    locked = locked_bytes()
    fits = cap or soft == resource.RLIM_INFINITY or locked + nbytes <= soft
    unlimited = resource.RLIM_INFINITY
    return {"soft": None if soft == unlimited else soft, "hard": None if hard == unlimited else hard,
            "soft_text": format_limit(soft), "hard_text": format_limit(hard), "locked": locked,
            "cap_ipc_lock": cap, "fits": fits, "nbytes": nbytes}


def memlock_advice():
    """Why a registration ran out of memory: the limit now, and how to raise it."""
    state = memlock_state(0)
    text = (f"registered memory counts against RLIMIT_MEMLOCK, which is {state['soft_text']} here "
            f"(hard limit {state['hard_text']}; {state['locked'] >> 10} KiB already locked); {MEMLOCK_FIX}")
    if state["cap_ipc_lock"]:
        text += (" (this process has CAP_IPC_LOCK, so the limit should not apply: the device itself may be out "
                 "of memory)")
    return text


# ---- device files ---------------------------------------------------------------------------------

def uverbs_files(sysfs=None):
    """{RDMA device name: its uverbs device file} from sysfs (/sys/class/infiniband_verbs/uverbsN/ibdev)."""
    root = os.path.join(sysfs or SYSFS, "class", "infiniband_verbs")
    found = {}
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return found
    for name in names:
        if not name.startswith("uverbs"):
            continue
        try:
            with open(os.path.join(root, name, "ibdev")) as f:
                found[f.read().strip()] = os.path.join(DEV_INFINIBAND, name)
        except OSError:
            continue
    return found


def device_file_advice(device, err, sysfs=None):
    """Which device file an ``ibv_open_device`` of ``device`` that failed with ``err`` needed, and
    what gives access to it."""
    path = uverbs_files(sysfs).get(device, f"{DEV_INFINIBAND}/uverbsN of {device}")
    container = (f"in a container pass it in: `docker run --device={path} --device={DEV_INFINIBAND}/rdma_cm` "
                 f"(or `--device={DEV_INFINIBAND}`)")
    if err in (_errno.EACCES, _errno.EPERM):
        return (f"opening {device} needs read and write access to {path}: run as root, or `chmod 666 {path}` "
                f"(rdma-core's udev rules make it 0666); {container}")
    return f"{path} is missing: load the module (`modprobe ib_uverbs`); {container}"


def advice(call, err, obj=None):
    """The environment advice for a failed verbs call, or None."""
    if call == "ibv_reg_mr" and err == _errno.ENOMEM:
        return memlock_advice()
    if call == "ibv_open_device" and err in (_errno.EACCES, _errno.EPERM, _errno.ENODEV, _errno.ENOENT,
                                             _errno.ENXIO):
        return device_file_advice(obj, err)
    return None
