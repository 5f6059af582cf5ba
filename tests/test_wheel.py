"""The binary wheel, and rdma-core opened at run time (include/pyrdma_dl.c, pyrdma._verbs.loader).

Host: the built modules need only glibc (no NEEDED libibverbs/librdmacm, no undefined verbs or
rdma_cm symbol); without libibverbs.so.1 ``import pyrdma`` works and the first call that needs a
device raises MissingLibraryError naming the library and the packages that provide it; a library
without a newer, optional entry point leaves the rest usable and the call that needs it says which.

Device (the VM): the wheel scripts/wheel.sh built into build/wheel before the VM booted, installed
into a fresh venv and used from there: the README's "Verbs in 20 lines", a 2-rank allreduce over RDMA
and pyrdma-perf write_bw against perftest's ib_write_bw. Every command runs in a private mount
namespace where rdma-core's headers (libibverbs-dev, librdmacm-dev) and the C compiler are hidden,
the state of a machine without them; nothing is removed, so the other tests of the VM boot are
unaffected whatever their order.
"""
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from pyrdma.perf.parse import parse_output
from pyrdma.testing import again_if_perftest_clock_failed, free_port, tcp_listening

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# glibc's own libraries, present on every manylinux platform (libdl and libpthread are linked only
# when the build machine's glibc is older than 2.34, where dlopen and pthread_once lived in them)
GLIBC_LIBRARIES = {"libc.so.6", "libm.so.6", "libpthread.so.0", "libdl.so.2"}
ABSENT = {"PYRDMA_LIBIBVERBS": "/nonexistent/libibverbs.so.1",
          "PYRDMA_LIBRDMACM": "/nonexistent/librdmacm.so.1"}


def _modules():
    modules = sorted(glob.glob(os.path.join(ROOT, "pyrdma", "**", "*.so"), recursive=True))
    sources = glob.glob(os.path.join(ROOT, "pyx", "*.pyx"))
    assert len(modules) == len(sources), f"one built module per pyx/*.pyx expected: {modules}"
    return modules


def _readelf(*args):
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.fail("readelf not found (binutils; Debian installs it with gcc)")
    return subprocess.run([readelf, "-W", *args], capture_output=True, text=True, check=True, timeout=60).stdout


def test_modules_need_only_glibc_and_leave_no_verbs_symbol_undefined():
    for path in _modules():
        needed = set(re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", _readelf("-d", path)))
        assert needed <= GLIBC_LIBRARIES, f"{path} needs {sorted(needed - GLIBC_LIBRARIES)}"
        undefined = [fields[7].split("@")[0] for fields in map(str.split, _readelf("--dyn-syms", path).splitlines())
                     if len(fields) >= 8 and fields[6] == "UND"]
        assert undefined, f"no undefined symbols read from {path}: readelf's format changed?"
        verbs = [name for name in undefined if name.startswith(("ibv_", "_ibv_", "rdma_"))]
        # each must be a forwarder of include/pyrdma_dl.c: else the module fails to import
        assert not verbs, f"{path} calls rdma-core entry points the loader does not define: {verbs}"


def _python(code, env):
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT, **env))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


FIRST_USE = """
import json
import pyrdma
import pyrdma.collectives, pyrdma.perf.cli      # the whole package imports
from pyrdma._verbs.loader import library_status
out = {"status": library_status()}
for name, call in [("context", pyrdma.Context), ("devices", pyrdma.get_device_list),
                   ("cm", pyrdma.CMEventChannel)]:
    try:
        call()
        out[name] = "no error"
    except pyrdma.RDMAError as exc:
        out[name] = {"type": type(exc).__name__, "text": str(exc), "library": getattr(exc, "library", None),
                     "path": getattr(exc, "path", None), "symbol": getattr(exc, "symbol", None)}
print(json.dumps(out))
"""


def test_import_works_without_rdma_core_and_first_use_names_what_to_install():
    out = _python(FIRST_USE, ABSENT)
    verbs, cm = out["status"]
    assert verbs["library"] == "libibverbs.so.1" and not verbs["loaded"]
    assert verbs["path"] == ABSENT["PYRDMA_LIBIBVERBS"] and "No such file" in verbs["error"]
    assert cm["library"] == "librdmacm.so.1" and not cm["loaded"]
    for name, call in (("context", "ibv_open_device"), ("devices", "ibv_get_device_list")):
        err = out[name]
        assert err["type"] == "MissingLibraryError" and err["library"] == "libibverbs.so.1" and err["symbol"] is None, err
        assert err["text"].startswith(f"{call}: cannot load libibverbs.so.1 ({ABSENT['PYRDMA_LIBIBVERBS']}: ")
        assert err["text"].endswith("apt-get install libibverbs1 ibverbs-providers (Debian/Ubuntu) "
                                    "or dnf install rdma-core libibverbs (RHEL/Fedora)"), err["text"]
    assert out["cm"]["type"] == "MissingLibraryError" and out["cm"]["library"] == "librdmacm.so.1"
    assert out["cm"]["text"].startswith("rdma_create_event_channel: cannot load librdmacm.so.1")
    assert out["cm"]["text"].endswith("apt-get install librdmacm1 (Debian/Ubuntu) or dnf install librdmacm (RHEL/Fedora)")


def test_a_library_without_the_versioned_symbols_is_refused():
    # libc is a library, but has no ibv_*@IBVERBS_1.x: as good as absent
    out = _python(FIRST_USE, {"PYRDMA_LIBIBVERBS": "libc.so.6"})
    assert re.search(r"libc\.so\.6 lacks \w+@IBVERBS_1\.\d+", out["status"][0]["error"]), out["status"]
    assert out["context"]["type"] == "MissingLibraryError"
    assert "cannot load libibverbs.so.1 (libc.so.6 lacks " in out["context"]["text"]


def _loader_table():
    """(library, name, version, optional) of each entry point include/pyrdma_dl.c forwards."""
    text = open(os.path.join(ROOT, "include", "pyrdma_dl.c")).read()
    table = [(lib, name, version, optional == "1") for lib, name, version, optional
             in re.findall(r'\bF\((VERBS|RDMACM), [^,]+, (\w+), "([\w.]+)", ([01]),', text)]
    table += [(lib, name, version, False) for lib, name, version in re.findall(r'\bV\((VERBS|RDMACM), (\w+), "([\w.]+)",', text)]
    assert len(table) > 50 and any(optional for *_, optional in table), "the loader's table was not read"
    return table


def test_an_older_library_lacking_an_optional_entry_point_is_usable(tmp_path):
    """A stand-in libibverbs.so.1 with the required versioned symbols and none of the optional ones
    (an rdma-core older than IBVERBS_1.12's dma-buf registration, say)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.fail("no C compiler to build the stand-in library (scripts/setup.sh installs gcc)")
    required = [(name, version) for lib, name, version, optional in _loader_table() if lib == "VERBS" and not optional]
    versions = {}
    for name, version in required:
        versions.setdefault(version, []).append(name)
    (tmp_path / "stub.c").write_text("".join(f"int {name}(void) {{ return 0; }}\n" for name, _ in required))
    (tmp_path / "stub.map").write_text("".join(f"{v} {{ global: {'; '.join(names)}; }};\n"
                                               for v, names in versions.items()))
    lib = tmp_path / "libibverbs.so.1"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(tmp_path / "stub.c"),
                    f"-Wl,--version-script={tmp_path / 'stub.map'}"], check=True, timeout=60)
    out = _python("""
import json
import pyrdma
from pyrdma._verbs.loader import library_status, entry_point_available
names = ["ibv_reg_dmabuf_mr", "ibv_qp_to_qp_ex", "_ibv_query_gid_ex", "ibv_open_device"]
out = {"status": library_status()[0], "available": {n: entry_point_available(n) for n in names}}
try:
    pyrdma.MemoryRegion.from_dmabuf(pyrdma.ProtectionDomain.__new__(pyrdma.ProtectionDomain), -1, 0, 4096, 0)
except pyrdma.MissingLibraryError as exc:
    out["dmabuf"] = {"text": str(exc), "symbol": exc.symbol}
print(json.dumps(out))
""", {"PYRDMA_LIBIBVERBS": str(lib)})
    assert out["status"]["loaded"] and out["status"]["path"] == str(lib), out["status"]
    assert out["available"] == {"ibv_reg_dmabuf_mr": False, "ibv_qp_to_qp_ex": False,
                                "_ibv_query_gid_ex": False, "ibv_open_device": True}
    assert out["dmabuf"]["symbol"] == "ibv_reg_dmabuf_mr@IBVERBS_1.12"
    assert out["dmabuf"]["text"].startswith(f"ibv_reg_dmabuf_mr: {lib} has no ibv_reg_dmabuf_mr@IBVERBS_1.12")


# --- the wheel, installed and used in the VM ---------------------------------------------------

HIDDEN_HEADER_DIRS = ("/usr/include/infiniband", "/usr/include/rdma")
COMPILERS = ("cc", "gcc", "c++", "g++", "clang")
STEP_TIMEOUT = 240


def _bare(cmd):
    """``cmd`` in a private mount namespace where rdma-core's headers and the C compilers are hidden
    (an empty tmpfs on each header directory, /dev/null on each compiler's binary)."""
    hide = [f"mount -t tmpfs -o size=64k none {d}" for d in HIDDEN_HEADER_DIRS if os.path.isdir(d)]
    binaries = sorted({os.path.realpath(shutil.which(c)) for c in COMPILERS if shutil.which(c)})
    hide += [f"mount --bind /dev/null {b}" for b in binaries]
    userns = [] if os.geteuid() == 0 else ["--map-root-user"]
    return ["unshare", "--mount", "--propagation", "private", *userns, "sh", "-ec",
            "; ".join(hide + ['exec "$@"']), "sh", *map(str, cmd)]


class _Runner:
    """Starts commands in the bare namespace, with no PYTHONPATH (the venv's pyrdma, not the tree's),
    each in its own session, and kills the sessions still running at the end."""

    def __init__(self, cwd):
        self.cwd = cwd
        self.env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self.procs = []

    def start(self, cmd):
        proc = subprocess.Popen(_bare(cmd), cwd=self.cwd, env=self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.procs.append(proc)
        return proc

    def finish(self, proc, timeout=STEP_TIMEOUT):
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill(proc)
            pytest.fail(f"{proc.args[-1]}... timed out after {timeout} s:\n{proc.communicate()[0]}")
        return proc.returncode, out

    def run(self, cmd, timeout=STEP_TIMEOUT):
        rc, out = self.finish(self.start(cmd), timeout)
        assert rc == 0, f"{cmd} failed ({rc}):\n{out}"
        return out

    def kill(self, proc):
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()

    def close(self):
        for proc in self.procs:
            self.kill(proc)
            if proc.stdout:
                proc.stdout.close()


@pytest.fixture
def runner(tmp_path):
    r = _Runner(tmp_path)
    yield r
    r.close()


def _readme_block(heading):
    text = open(os.path.join(ROOT, "README.md")).read()
    section = text.split(f"\n## {heading}\n", 1)[1]
    return re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)


ALLREDUCE = """
import multiprocessing as mp
import socket
import numpy as np
from pyrdma.collectives import Communicator

def rank(r, size, master):
    with Communicator(r, size, master, transport="rdma", timeout=60) as comm:
        x = np.arange(10_000, dtype=np.float32) * (r + 1)
        comm.allreduce(x)
        return type(comm.transport).__name__, bool(np.array_equal(x, np.arange(10_000, dtype=np.float32) * 3))

if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.get_context("spawn").Pool(2) as pool:
        print(pool.starmap(rank, [(r, 2, f"127.0.0.1:{port}") for r in range(2)]))
"""


@pytest.mark.device
def test_wheel_installs_and_runs_without_headers_or_compiler(runner, tmp_path, rdma_device_name, gid_index):
    wheels = glob.glob(os.path.join(ROOT, "build", "wheel", "pyrdma-*.whl"))
    if len(wheels) != 1:
        pytest.fail(f"expected one wheel in build/wheel, found {wheels}: scripts/wheel.sh builds it "
                    f"(scripts/setup.sh runs it before the VM boots)")
    assert "manylinux" in os.path.basename(wheels[0]), wheels[0]
    assert runner.run(["sh", "-c", "test ! -e /usr/include/infiniband/verbs.h && test ! -e /usr/include/rdma/rdma_cma.h"
                       " && ! cc --version >/dev/null 2>&1 && echo hidden"]).strip() == "hidden"

    venv = tmp_path / "venv"
    python = venv / "bin" / "python"
    started = time.monotonic()
    # --system-site-packages: numpy (and pip) come from the system; the venv gets only pyrdma
    runner.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv])
    runner.run([python, "-m", "pip", "install", "--no-index", "--no-cache-dir", "--disable-pip-version-check",
                "-q", wheels[0]])
    where = runner.run([python, "-c", "import pyrdma; print(pyrdma.__file__)"]).strip().splitlines()[-1]
    assert where.startswith(str(venv)), where
    print(f"venv + install: {time.monotonic() - started:.0f} s")

    (tmp_path / "verbs20.py").write_text(_readme_block("Verbs in 20 lines"))
    assert "RDMA WRITE of 4096 bytes done" in runner.run([python, "verbs20.py"])

    (tmp_path / "allreduce.py").write_text(ALLREDUCE)
    assert runner.run([python, "allreduce.py"]).strip().splitlines()[-1] == \
        "[('RdmaTransport', True), ('RdmaTransport', True)]"

    perftest = shutil.which("ib_write_bw")
    if perftest is None:
        pytest.fail("ib_write_bw not found: scripts/setup.sh installs Debian's perftest")
    port = free_port()
    common = ["-d", rdma_device_name, "-x", str(gid_index), "-s", "65536", "-n", "200", "-p", str(port)]

    def pair(server_cmd, client_cmd, port):
        server = runner.start(server_cmd)
        deadline = time.monotonic() + 60
        while not tcp_listening(port) and server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        rc_c, out_c = runner.finish(runner.start(client_cmd))
        rc_s, out_s = runner.finish(server, 60)
        assert rc_c == 0 and rc_s == 0, f"client ({rc_c}):\n{out_c}\nserver ({rc_s}):\n{out_s}"
        return out_s, out_c

    out_s, out_c = again_if_perftest_clock_failed(
        pair, [perftest, *common],
        [venv / "bin" / "pyrdma-perf", "write_bw", "--perftest-compat", "--mode", "batched", *common, "127.0.0.1"],
        port, free_port)
    (ours,) = parse_output(out_c).rows_for("batched")
    (theirs,) = parse_output(out_s).rows_for(None)      # perftest's server prints our client's report
    assert ours.size == theirs.size == 65536 and theirs.iters == 200
    assert ours.bw_avg > 0 and theirs.bw_avg == pytest.approx(ours.bw_avg, abs=0.01)
