"""Run a command where a real RDMA device exists: on the host if it has an ACTIVE RDMA port,
otherwise inside a virtme-ng VM with the kernel's Soft-RoCE driver (rxe0 on lo).

    python -m pyrdma.testing.vm [--rwdir DIR] [--timeout S] [--hosts N [--mtu 1500|9000]] [--no-cache] -- CMD [ARGS...]

The VM boots the newest /boot/vmlinuz-* that has the rdma_rxe module, with this machine's files
as its root filesystem (read-only, with a throw-away overlay; each ``--rwdir`` directory is writable
and shared back to the host; Python's directories and the current one are read through a cached
read-only export, ``cached_dirs``, unless ``--no-cache``). A guest script loads rdma_rxe, creates
rxe0 on lo, waits for its port to be ACTIVE, then runs CMD from the current directory with the
caller's environment variables (PYTHONPATH, PYRDMA_*, ... see ``PASSED_ENV``; the guest's PATH is its
own, so name the host's Python by absolute path, e.g. ``sys.executable``). CMD's output streams through.

``--hosts N`` (2..4) also builds a multi-host test bed in the guest (``topology_script``): N "hosts",
each the end of a veth pair whose other end is a port of one bridge, with its own address
198.18.0.k/24, Ethernet MTU ``--mtu`` and Soft-RoCE device rxehk; policy routing sends the
traffic between two hosts' addresses across the veths and the bridge instead of lo. rxe0 on lo stays
the first device. The hosts are described in the JSON file named by ``PYRDMA_TEST_HOSTS``
(pyrdma.testing.hosts reads it).

Exit status: CMD's own; 125 (``VM_FAILED``) when the VM did not boot or rxe0 did not come up;
124 (``TIMED_OUT``) when the timeout expired (the VM is killed).
"""
import argparse
import glob
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

from pyrdma.testing import SYSFS_INFINIBAND

VM_FAILED = 125
TIMED_OUT = 124
DEFAULT_TIMEOUT = 3600
# Host environment variables the guest gets (it starts with a clean environment), plus every PYRDMA_*.
PASSED_ENV = ("PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "PYTEST_ADDOPTS", "HOME", "LANG",
              "LC_ALL", "TERM", "COLUMNS", "MPLBACKEND", "CI")
# Default for ``stream``: the sys.stdout of the moment of the call (pytest swaps it).
STDOUT = "stdout"
# How long the guest waits for rxe0's port to become ACTIVE (software emulation is slow).
PORT_ACTIVE_WAIT_S = 60
# The multi-host test bed (--hosts): at most this many hosts, addresses HOST_NET.k/24 (198.18.0.0/15
# is the benchmarking range, RFC 2544; only 198.18.0.0/24 is used), one bridge joining them.
MAX_HOSTS = 4
HOST_NET = "198.18.0"
HOST_BRIDGE = "rdbr0"
HOST_MTUS = (1500, 9000)
# Policy-routing preferences: the per-pair rules come before the local table, which moves from 0 to here.
LOCAL_RULE_PREF = 1000
HOSTS_ENV = "PYRDMA_TEST_HOSTS"
# The cached view of the host's files (``cached_dirs``): a second 9p export of /, mounted in the guest
# with the page and attribute cache (cache=loose) and bound over the directories Python imports from.
CACHED_TAG = "pyrdma.cached"
CACHED_MOUNT = "/run/pyrdma-cached"


def cached_dirs(cwd, *, paths=None):
    """The directories the guest sees through the cached export: the interpreter's own (stdlib and
    site-packages, by ``sysconfig``) and ``cwd`` (the tree under test), outermost first, without
    one inside another (guest_script brings back the writable directories inside them).

    Why: vng's root is 9p without a cache, so each stat, open and read of a file goes to the host,
    and under emulation that is most of a Python process's start-up (``import numpy`` 24 s,
    ``import pyrdma.collectives`` 41 s in a CI-sized VM); the device tests start hundreds of them. The
    export is read-only and nothing changes these files while the VM runs, so a cache cannot go stale."""
    import sysconfig
    if paths is None:
        paths = [sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")]
        paths.append(cwd)
    dirs = []
    for d in sorted({os.path.realpath(p) for p in paths if p and os.path.isdir(p)}, key=lambda p: (len(p), p)):
        if d != "/" and not any(_inside(d, o) for o in dirs):
            dirs.append(d)
    return dirs


def _inside(path, top):
    """Whether ``path`` is ``top`` or lies under it (both real, absolute paths)."""
    return path == top or path.startswith(top.rstrip("/") + "/")


def host_layout(n, mtu=1500):
    """The hosts of a ``--hosts n`` test bed, as pyrdma.testing.hosts describes them (GID index
    excepted: the guest reads it from sysfs once the device has its address)."""
    if not 2 <= n <= MAX_HOSTS:
        raise ValueError(f"--hosts wants 2..{MAX_HOSTS}, got {n}")
    if mtu not in HOST_MTUS:
        raise ValueError(f"--mtu wants one of {', '.join(map(str, HOST_MTUS))}, got {mtu}")
    return [{"name": f"h{k}", "netdev": f"rdh{k}", "bridge_port": f"rdh{k}b", "address": f"{HOST_NET}.{k}",
             "prefix": 24, "mac": f"02:00:c6:12:00:{k:02x}", "device": f"rxeh{k}", "table": 100 + k, "mtu": mtu}
            for k in range(1, n + 1)]


def topology_script(n, mtu, hosts_json, sysfs=SYSFS_INFINIBAND):
    """Bash (run as root in the guest, after rxe0 is up) that builds the ``n``-host test bed and
    writes its description to ``hosts_json``; it calls ``fail`` (defined by guest_script) on error.

    Why it is built so: rxe's UDP socket lives in the initial network namespace only, so every host
    lives in the one namespace; a host is a veth end with its address and rxe device. Without more,
    a packet between two local addresses goes through lo: the rules at preference 100 (``iif lo``:
    locally generated only) send it out of the source host's veth, to the bridge, into the
    destination's veth, ahead of the local table (moved to LOCAL_RULE_PREF). The receiving end must
    accept a local source address (accept_local) and skip the reverse-path check (rp_filter). The
    neighbours are static, so no ARP reply can come from the wrong veth. ``sysfs``: where the devices'
    ports are read (a fake one in tests)."""
    hosts = host_layout(n, mtu)
    q = shlex.quote
    lines = [f"# the {n}-host test bed (pyrdma.testing.vm.topology_script)",
             "sysctl -qw net.ipv4.conf.all.rp_filter=0 net.ipv4.conf.default.rp_filter=0 || fail sysctl rp_filter",
             f"ip link add {HOST_BRIDGE} mtu {mtu} type bridge || fail cannot add bridge {HOST_BRIDGE}",
             f"ip link set {HOST_BRIDGE} up || fail cannot set {HOST_BRIDGE} up"]
    for h in hosts:
        dev, port = h["netdev"], h["bridge_port"]
        lines += [
            f"ip link add {dev} mtu {mtu} address {h['mac']} type veth peer name {port} mtu {mtu} "
            f"|| fail cannot add veth {dev}",
            f"ip link set {port} master {HOST_BRIDGE} up || fail cannot attach {port} to {HOST_BRIDGE}",
            f"sysctl -qw net.ipv4.conf.{dev}.rp_filter=0 net.ipv4.conf.{dev}.accept_local=1 "
            f"net.ipv4.conf.{dev}.arp_ignore=1 net.ipv4.conf.{dev}.arp_announce=2 || fail sysctl {dev}",
            f"ip addr add {h['address']}/{h['prefix']} dev {dev} || fail cannot address {dev}",
            f"ip link set {dev} up || fail cannot set {dev} up",
            f"ip route add {HOST_NET}.0/{h['prefix']} dev {dev} src {h['address']} table {h['table']} "
            f"|| fail cannot add the route of table {h['table']}",
        ]
    for h in hosts:
        for other in hosts:
            if other is h:
                continue
            lines += [
                f"ip rule add pref 100 iif lo from {h['address']} to {other['address']} lookup {h['table']} "
                f"|| fail cannot add the rule {h['name']} to {other['name']}",
                f"ip neigh replace {other['address']} lladdr {other['mac']} dev {h['netdev']} nud permanent "
                f"|| fail cannot add the neighbour {other['address']} on {h['netdev']}",
            ]
    lines += [f"ip rule add pref {LOCAL_RULE_PREF} lookup local || fail cannot add the local rule",
              "ip rule del pref 0 lookup local || fail cannot move the local rule"]
    for h in hosts:
        lines.append(f"rdma link add {h['device']} type rxe netdev {h['netdev']} "
                     f"|| fail cannot add {h['device']} on {h['netdev']}")
    # Each device's port must be ACTIVE and its RoCE v2 GID for the host's IPv4 present; its index goes
    # to the JSON (sysfs: gids/<i> is the GID as 8 colon-separated groups, gid_attrs/types/<i> its type).
    lines += [
        "roce_v2_ipv4_gid_index() {  # device address: the index of the RoCE v2 GID ::ffff:address",
        "  local want i",
        "  want=$(printf '0000:0000:0000:0000:0000:ffff:%02x%02x:%02x%02x' ${2//./ })",
        f"  for i in $(ls {sysfs}/$1/ports/1/gids 2>/dev/null | sort -n); do",
        f"    [ \"$(cat {sysfs}/$1/ports/1/gids/$i 2>/dev/null)\" = \"$want\" ] || continue",
        f"    [ \"$(cat {sysfs}/$1/ports/1/gid_attrs/types/$i 2>/dev/null)\" = \"RoCE v2\" ] "
        "&& { echo $i; return 0; }",
        "  done",
        "  return 1",
        "}",
    ]
    entries = []
    for h in hosts:
        dev, gid_var = h["device"], f"gid_{h['name']}"
        lines += [
            f"for _ in $(seq {PORT_ACTIVE_WAIT_S * 10}); do",
            f"  grep -q ACTIVE {sysfs}/{dev}/ports/1/state 2>/dev/null "
            f"&& {gid_var}=$(roce_v2_ipv4_gid_index {dev} {h['address']}) && break",
            "  sleep 0.1",
            "done",
            f"[ -n \"${{{gid_var}:-}}\" ] || fail \"{dev} not ACTIVE with a RoCE v2 GID for {h['address']} "
            f"after {PORT_ACTIVE_WAIT_S} s: $(cat {sysfs}/{dev}/ports/1/state 2>&1)\"",
        ]
        fields = ", ".join(f'"{k}": "{h[k]}"' for k in ("name", "netdev", "bridge_port", "address", "mac", "device"))
        entries.append("{" + fields + f', "prefix": {h["prefix"]}, "mtu": {mtu}, "port": 1, '
                       f'"gid_index": ${gid_var}' + "}")
    body = '{"bridge": "' + HOST_BRIDGE + '", "hosts": [' + ", ".join(entries) + "]}"
    lines += [f"cat > {q(hosts_json)} <<PYRDMA_HOSTS_EOF", body, "PYRDMA_HOSTS_EOF",
              "ibv_devices 2>/dev/null | awk 'NR>2 {print $1}' | head -1 | grep -qx rxe0 "
              "|| fail \"rxe0 is not the first device: $(ibv_devices 2>&1)\"",
              f"echo \"pyrdma-vm: {n} hosts on {HOST_BRIDGE} (MTU {mtu}): "
              + ", ".join(f"{h['name']}={h['address']}/{h['device']}" for h in hosts) + "\"",
              f"export {HOSTS_ENV}={q(hosts_json)}"]
    return "\n".join(lines) + "\n"


def active_rdma_devices(sysfs=SYSFS_INFINIBAND):
    """Names of the RDMA devices that have at least one ACTIVE port, from sysfs."""
    names = []
    for state in sorted(glob.glob(os.path.join(sysfs, "*", "ports", "*", "state"))):
        try:
            with open(state) as f:
                active = "ACTIVE" in f.read()
        except OSError:
            continue
        name = state.split(os.sep)[-4]
        if active and name not in names:
            names.append(name)
    return names


def host_has_active_rdma_port(sysfs=SYSFS_INFINIBAND):
    return bool(active_rdma_devices(sysfs))


def _version_key(path):
    return [(0, int(x), "") if x.isdigit() else (1, 0, x) for x in re.split(r"(\d+)", os.path.basename(path))]


def kernel_has_rxe(version, modules="/lib/modules"):
    """Whether /lib/modules/<version> has the rdma_rxe module (any compression)."""
    moddir = os.path.join(modules, version)
    if glob.glob(os.path.join(moddir, "kernel", "drivers", "infiniband", "sw", "rxe", "rdma_rxe.ko*")):
        return True
    try:
        with open(os.path.join(moddir, "modules.dep")) as f:
            return any(re.search(r"/rdma_rxe\.ko(\.\w+)?:", line) for line in f)
    except OSError:
        return False


def find_rxe_kernel(boot="/boot", modules="/lib/modules"):
    """The newest /boot/vmlinuz-<version> whose modules include rdma_rxe, or None."""
    kernels = [k for k in glob.glob(os.path.join(boot, "vmlinuz-*")) if os.path.isfile(k)]
    for kernel in sorted(kernels, key=_version_key, reverse=True):
        if kernel_has_rxe(os.path.basename(kernel)[len("vmlinuz-"):], modules):
            return kernel
    return None


def guest_environment(env=None, environ=None):
    """The variables exported in the guest: PASSED_ENV and PYRDMA_* from the host, updated by ``env``."""
    environ = os.environ if environ is None else environ
    out = {k: v for k, v in environ.items() if k in PASSED_ENV or k.startswith("PYRDMA_")}
    out.update(env or {})
    return out


def guest_script(cmd, cwd, env, state_dir, hosts=0, mtu=1500, cached=(), rwdirs=()):
    """The bash script the guest runs: bring up rxe0 (and with ``hosts`` the test bed of
    topology_script), run ``cmd`` in ``cwd`` with ``env``, and leave markers in ``state_dir`` (shared
    with the host): ``booted``, then either ``vm-error`` (the set-up failed, with the reason) or
    ``status`` (cmd's exit status). The kernel's log streams to ``kernel.log`` there, with soft
    lockups and hung tasks reported with their stacks, so a VM that hangs leaves its cause behind.
    ``cached``: the directories to see through the cached export (cached_dirs; vng_command(cached=True)
    exports it); a writable directory (``rwdirs``, ``state_dir``) inside one is bound back over its
    cached view. Should the export not mount, the guest says so and runs on the uncached root."""
    state = shlex.quote(state_dir)
    q = shlex.quote
    binds = []
    for d in cached:
        inner = [w for w in dict.fromkeys([state_dir, *rwdirs]) if _inside(w, d)]
        binds += [f"mkdir -p {CACHED_MOUNT}-rw/{i} && mount --bind {q(w)} {CACHED_MOUNT}-rw/{i} || fail cannot keep {q(w)}"
                  for i, w in enumerate(inner)]
        binds.append(f"mount --bind {CACHED_MOUNT}{q(d)} {q(d)} || fail cannot bind the cached view of {q(d)}")
        binds += [f"mount --bind {CACHED_MOUNT}-rw/{i} {q(w)} && umount -l {CACHED_MOUNT}-rw/{i} || fail cannot bring back {q(w)}"
                  for i, w in enumerate(inner)]
    cache = (f"""mkdir -p {CACHED_MOUNT}
if mount -t 9p -o ro,trans=virtio,version=9p2000.L,msize=524288,cache=loose {CACHED_TAG} {CACHED_MOUNT}; then
""" + "".join(f"  {b}\n" for b in binds) + """else
  echo "pyrdma-vm: the cached export did not mount; the command reads the uncached root"
fi
""" if cached else "")
    port_state = "/sys/class/infiniband/rxe0/ports/1/state"
    exports = "\n".join(f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items()))
    topology = topology_script(hosts, mtu, os.path.join(state_dir, "hosts.json")) if hosts else ""
    return f"""exec 2>&1   # one ordered stream back to the host
set -u
echo booted > {state}/booted
sysctl -q -w kernel.softlockup_all_cpu_backtrace=1 kernel.hung_task_timeout_secs=30 2>/dev/null
dmesg -w > {state}/kernel.log 2>&1 &
fail() {{ echo "pyrdma-vm: $*"; echo "$*" > {state}/vm-error; sync; exit {VM_FAILED}; }}
ip link set lo up || fail "ip link set lo up failed"
modprobe rdma_rxe || fail "modprobe rdma_rxe failed"
rdma link add rxe0 type rxe netdev lo || fail "rdma link add rxe0 type rxe netdev lo failed"
for _ in $(seq {PORT_ACTIVE_WAIT_S * 10}); do
  grep -q ACTIVE {port_state} 2>/dev/null && break
  sleep 0.1
done
grep -q ACTIVE {port_state} 2>/dev/null || fail "rxe0 port 1 not ACTIVE after {PORT_ACTIVE_WAIT_S} s: $(cat {port_state} 2>&1)"
ibv_devices 2>/dev/null | grep -q rxe0 || fail "ibv_devices does not list rxe0"
echo "pyrdma-vm: rxe0 is ACTIVE on lo"
{cache}{exports}
{topology}
cd {shlex.quote(cwd)} || fail cannot cd to {shlex.quote(cwd)}
{shlex.join(cmd)}
status=$?
echo $status > {state}/status
sync
exit $status
"""


def vng_command(kernel, script_path, rwdirs, memory="4G", cpus=2, kvm=False, cached=False):
    """The virtme-ng command line that boots ``kernel`` and runs ``bash script_path``; with ``cached``
    also the read-only export of / that the guest mounts with a cache (``CACHED_TAG``, see cached_dirs)."""
    vng = shutil.which("vng")
    if vng is None:
        raise FileNotFoundError("vng (virtme-ng) not found on PATH; pip install virtme-ng")
    argv = [vng, "--run", kernel, "--user", "root", "--memory", memory, "--cpus", str(cpus)]
    if not kvm:
        # /dev/kvm may exist and still hang (nested virtualisation); software emulation always works.
        # Emulated, the guest kernel picks the HPET as its clock: every clock_gettime is then a
        # system call and an emulated device read (1.3 us a time.perf_counter() against 0.5 us on
        # the TSC, and the 8 B send/recv ping-pong 26-29 us against 24 us), which a real host does
        # not pay. QEMU's emulated TSC follows the host's, so the guest may trust it.
        argv += ["--disable-kvm", "--append", "tsc=reliable clocksource=tsc"]
    for d in rwdirs:
        argv += ["--rwdir", d]
    if cached:
        # one =-joined argument: a value that starts with "-" is an option to vng's parser
        argv.append(f"--qemu-opts=-fsdev local,id=pyrdmacached,path=/,security_model=none,readonly=on,"
                    f"multidevs=remap -device virtio-9p-pci,fsdev=pyrdmacached,mount_tag={CACHED_TAG}")
    return argv + ["--exec", f"bash {shlex.quote(script_path)}"]


def _as_list(rwdir):
    if rwdir is None:
        return []
    if isinstance(rwdir, (str, os.PathLike)):
        return [os.fspath(rwdir)]
    return [os.fspath(d) for d in rwdir]


def _kill_group(proc):
    """Stop a process started with start_new_session and everything it started (vng, qemu)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


def _run_streaming(argv, timeout, stream, env=None):
    """Run argv in its own session, echo its merged output to ``stream`` line by line.
    Returns (returncode or None on timeout, output)."""
    stream = sys.stdout if stream is STDOUT else stream
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=env, text=True, errors="replace", start_new_session=True)
    output = []

    def pump():
        for line in proc.stdout:
            output.append(line)
            if stream is not None:
                stream.write(line)
                stream.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    code = None
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    finally:
        if code is None:   # timeout, or an exception such as KeyboardInterrupt: never leave a VM behind
            _kill_group(proc)
        reader.join(timeout=10)
        proc.stdout.close()
    return code, "".join(output)


def _say(stream, msg):
    """Echo one of our own messages like the command's output; return it for ``output``."""
    line = f"pyrdma-vm: {msg}\n"
    stream = sys.stdout if stream is STDOUT else stream
    if stream is not None:
        stream.write(line)
        stream.flush()
    return line


def _read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


KERNEL_TROUBLE = ("soft lockup", "blocked for more than", "BUG:", "Oops", "Kernel panic", "self-detected stall")


def _kernel_trouble(path, lines=40):
    """The guest kernel's first report of a lockup, hung task, BUG, panic or stall in ``path`` (its
    streamed log) and the ``lines`` after it (the stack), to append to a message; "" if none."""
    try:
        with open(path, errors="replace") as f:
            log = f.read().splitlines()
    except OSError:
        return ""
    for i, line in enumerate(log):
        if any(mark in line for mark in KERNEL_TROUBLE):
            return "\nthe guest kernel reported:\n" + "\n".join(log[i:i + lines])
    return ""


def run_in_vm(cmd, rwdir=None, timeout=DEFAULT_TIMEOUT, env=None, *, memory="4G", cpus=2, kvm=False,
              stream=STDOUT, hosts=0, mtu=1500, cache=True):
    """Run ``cmd`` (a list of arguments) in the Soft-RoCE VM; returns ``(returncode, output)``.

    ``rwdir``: a directory (or a list) the command may write, shared back to the host (created if missing).
    ``env``: variables to set in the guest on top of ``guest_environment()``'s defaults.
    ``stream``: where output is echoed as it arrives (None: nowhere). ``output`` has it all.
    ``hosts``: build the multi-host test bed of ``hosts`` hosts (2..4; 0: none) at Ethernet MTU ``mtu``.
    ``cache``: the guest reads Python's files and the tree under test through a cached export (cached_dirs).
    returncode is cmd's own, ``VM_FAILED`` if the VM or rxe0 did not come up, ``TIMED_OUT`` after
    ``timeout`` seconds (the VM is killed).
    """
    cmd = [os.fspath(c) for c in cmd]
    if hosts:
        host_layout(hosts, mtu)     # ValueError before anything boots
    kernel = find_rxe_kernel()
    if kernel is None:
        return VM_FAILED, _say(stream, "VM failed: no /boot/vmlinuz-* whose /lib/modules has rdma_rxe "
                                       "(apt-get install linux-image-amd64)")
    rwdirs = [os.path.abspath(d) for d in _as_list(rwdir)]
    for d in rwdirs:
        os.makedirs(d, exist_ok=True)
    state_dir = tempfile.mkdtemp(prefix="pyrdma-vm-")
    try:
        script_path = os.path.join(state_dir, "guest.sh")
        cached = cached_dirs(os.getcwd()) if cache else []
        with open(script_path, "w") as f:
            f.write(guest_script(cmd, os.getcwd(), guest_environment(env), state_dir, hosts, mtu, cached, rwdirs))
        try:
            argv = vng_command(kernel, script_path, [state_dir, *rwdirs], memory, cpus, kvm, cached=bool(cached))
        except FileNotFoundError as exc:
            return VM_FAILED, _say(stream, f"VM failed: {exc}")
        vng_code, output = _run_streaming(argv, timeout, stream)
        kernel_log = os.path.join(state_dir, "kernel.log")
        if vng_code is None:
            return TIMED_OUT, output + _say(stream, f"timed out after {timeout:g} s; VM killed"
                                                    f"{_kernel_trouble(kernel_log)}")
        status = _read(os.path.join(state_dir, "status"))
        if status is not None and status.lstrip("-").isdigit():
            return int(status), output
        if _read(os.path.join(state_dir, "booted")) is None:
            why = f"VM failed: it did not boot (vng exit status {vng_code}; kernel {kernel})"
        else:
            error = _read(os.path.join(state_dir, "vm-error"))
            why = (f"VM failed: rxe0 did not come up: {error}" if error is not None else
                   f"VM failed: the VM stopped before the command finished (vng exit status {vng_code})"
                   f"{_kernel_trouble(kernel_log)}")
        return VM_FAILED, output + _say(stream, why)
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)


def run_on_host(cmd, timeout=DEFAULT_TIMEOUT, env=None, *, stream=STDOUT):
    """Run ``cmd`` on this machine with ``env`` added to its environment; returns ``(returncode, output)``."""
    full_env = dict(os.environ, **(env or {}))
    try:
        code, output = _run_streaming([os.fspath(c) for c in cmd], timeout, stream, env=full_env)
    except OSError as exc:
        return 127, _say(stream, f"cannot run {cmd[0]}: {exc}")
    if code is None:
        return TIMED_OUT, output + _say(stream, f"timed out after {timeout:g} s; command killed")
    return code, output


def run_with_device(cmd, rwdir=None, timeout=DEFAULT_TIMEOUT, env=None, *, force_vm=False, stream=STDOUT,
                    **vm_options):
    """Run ``cmd`` on the host's RDMA device if it has an ACTIVE port, else in the Soft-RoCE VM.
    A multi-host test bed (``hosts=``) is only ever built in the VM: this machine's network is left alone."""
    if not force_vm and not vm_options.get("hosts") and host_has_active_rdma_port():
        note = _say(stream, f"host has an ACTIVE RDMA port ({', '.join(active_rdma_devices())}); running on the host")
        for d in _as_list(rwdir):
            os.makedirs(d, exist_ok=True)
        code, output = run_on_host(cmd, timeout, env, stream=stream)
        return code, note + output
    return run_in_vm(cmd, rwdir, timeout, env, stream=stream, **vm_options)


def _parse_env(items):
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"--env wants KEY=VALUE, got {item!r}")
        env[key] = value
    return env


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="pyrdma-vm", description=__doc__.split("\n\n")[0],
        epilog=f"Exit status: CMD's; {VM_FAILED} if the VM or rxe0 failed; {TIMED_OUT} on timeout.")
    parser.add_argument("--rwdir", action="append", default=[], help="directory writable in the VM (repeatable)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds before the VM is killed")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="set a variable for CMD (repeatable)")
    parser.add_argument("--force-vm", action="store_true", help="use the VM even if the host has a device")
    parser.add_argument("--memory", default="4G", help="VM memory (default 4G)")
    parser.add_argument("--cpus", type=int, default=2, help="VM CPUs (default 2)")
    parser.add_argument("--kvm", action="store_true",
                        help="use KVM instead of software emulation (only where nested KVM really works)")
    parser.add_argument("--hosts", type=int, default=0, metavar="N",
                        help=f"build a test bed of N (2..{MAX_HOSTS}) hosts on one bridge in the VM; "
                             f"{HOSTS_ENV} names their description (always in the VM)")
    parser.add_argument("--no-cache", dest="cache", action="store_false",
                        help="read every file through vng's uncached root (default: Python's directories "
                             "and the current one through a cached read-only export)")
    parser.add_argument("--mtu", type=int, default=1500, choices=HOST_MTUS,
                        help="the test bed's Ethernet MTU (default 1500: RoCE active MTU 1024)")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    args = parser.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("no command given (use: pyrdma-vm [options] -- CMD ...)")
    if args.hosts and not 2 <= args.hosts <= MAX_HOSTS:
        parser.error(f"--hosts wants 2..{MAX_HOSTS}, got {args.hosts}")
    try:
        env = _parse_env(args.env)
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    # SIGTERM (a CI job's timeout, kill) ends Python without unwinding; as SystemExit it reaches
    # the cleanup that stops the VM, instead of leaving qemu running on the machine.
    previous = {sig: signal.signal(sig, _exit_on_signal) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        code, _ = run_with_device(cmd, args.rwdir, args.timeout, env, force_vm=args.force_vm,
                                  memory=args.memory, cpus=args.cpus, kvm=args.kvm, hosts=args.hosts, mtu=args.mtu,
                                  cache=args.cache)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code


def _exit_on_signal(signum, frame):
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
