"""Run a command where a real RDMA device exists: on the host if it has an ACTIVE RDMA port,
otherwise inside a virtme-ng VM with the kernel's Soft-RoCE driver (rxe0 on lo).

    python -m pyrdma.testing.vm [--rwdir DIR] [--timeout S] -- CMD [ARGS...]

The VM boots Debian's kernel with this machine's files as its root (read-only with overlays;
``--rwdir`` directories are writable and shared back), loads rdma_rxe, creates rxe0, waits for
its port to be ACTIVE, then runs CMD from the current directory with the caller's environment.
Exit status: CMD's own; 125 when the VM or rxe0 could not be brought up; 124 on timeout.
"""
import argparse
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

VM_FAILED = 125
TIMED_OUT = 124
# Environment variables that are passed into the guest (the guest starts with a clean environment).
PASSED_ENV = ("PYTHONPATH", "PYTHONUNBUFFERED", "PYRDMA_REQUIRE_DEVICE", "PYTEST_ADDOPTS", "HOME", "LANG",
              "MPLBACKEND", "PYRDMA_BENCH_QUICK")


def host_has_active_rdma_port(sysfs="/sys/class/infiniband"):
    for state in glob.glob(os.path.join(sysfs, "*", "ports", "*", "state")):
        try:
            with open(state) as f:
                if "ACTIVE" in f.read():
                    return True
        except OSError:
            continue
    return False


def _version_key(path):
    return [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", os.path.basename(path))]


def find_rxe_kernel(boot="/boot", modules="/lib/modules"):
    """The newest /boot/vmlinuz-* whose modules include rdma_rxe, or None."""
    for kernel in sorted(glob.glob(os.path.join(boot, "vmlinuz-*")), key=_version_key, reverse=True):
        version = os.path.basename(kernel)[len("vmlinuz-"):]
        if glob.glob(os.path.join(modules, version, "kernel", "drivers", "infiniband", "sw", "rxe", "rdma_rxe.ko*")):
            return kernel
    return None


def guest_script(cmd, cwd, env, status_file):
    """The shell script the guest runs: bring up rxe0, then run ``cmd`` and record its status."""
    exports = "\n".join(f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items()))
    return f"""set -u
fail() {{ echo "pyrdma-vm: $*" >&2; echo {VM_FAILED} > {shlex.quote(status_file)}; exit {VM_FAILED}; }}
ip link set lo up 2>/dev/null
modprobe rdma_rxe || fail "modprobe rdma_rxe failed"
rdma link add rxe0 type rxe netdev lo || fail "rdma link add rxe0 failed"
for i in $(seq 1 100); do
  grep -q ACTIVE /sys/class/infiniband/rxe0/ports/1/state 2>/dev/null && break
  sleep 0.1
done
grep -q ACTIVE /sys/class/infiniband/rxe0/ports/1/state 2>/dev/null || fail "rxe0 port never became ACTIVE"
echo "pyrdma-vm: rxe0 is ACTIVE" >&2
{exports}
cd {shlex.quote(cwd)} || fail "cannot cd to {cwd}"
{' '.join(shlex.quote(c) for c in cmd)}
echo $? > {shlex.quote(status_file)}
"""


def vm_command(kernel, script_path, rwdirs, memory="4G", cpus=2):
    vng = shutil.which("vng")
    if vng is None:
        raise FileNotFoundError("vng (virtme-ng) not found; pip install virtme-ng")
    cmd = [vng, "--run", kernel, "--user", "root", "--memory", memory, "--cpus", str(cpus), "--disable-kvm"]
    for d in rwdirs:
        cmd += ["--rwdir", d]
    return cmd + ["--exec", f"bash {shlex.quote(script_path)}"]


def run_in_vm(cmd, rwdirs=(), timeout=3600, env=None, memory="4G", cpus=2, stream=sys.stdout):
    """Run ``cmd`` (a list) in the Soft-RoCE VM; returns (returncode, output)."""
    kernel = find_rxe_kernel()
    if kernel is None:
        msg = "pyrdma-vm: no /boot/vmlinuz-* with rdma_rxe modules; apt-get install linux-image-amd64\n"
        stream.write(msg)
        return VM_FAILED, msg
    env = {k: os.environ[k] for k in PASSED_ENV if k in os.environ} if env is None else env
    state = tempfile.mkdtemp(prefix="pyrdma-vm-")
    status_file = os.path.join(state, "status")
    script_path = os.path.join(state, "guest.sh")
    with open(script_path, "w") as f:
        f.write(guest_script(cmd, os.getcwd(), env, status_file))
    rwdirs = [os.path.abspath(d) for d in rwdirs]
    for d in rwdirs:
        os.makedirs(d, exist_ok=True)
    argv = vm_command(kernel, script_path, [state, *rwdirs], memory, cpus)
    output = []
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                text=True, errors="replace", start_new_session=True)
    except FileNotFoundError as exc:
        stream.write(f"pyrdma-vm: {exc}\n")
        return VM_FAILED, str(exc)
    import threading

    def pump():
        for line in proc.stdout:
            output.append(line)
            stream.write(line)
            stream.flush()
    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        reader.join(5)
        stream.write(f"pyrdma-vm: timed out after {timeout} s; VM killed\n")
        return TIMED_OUT, "".join(output)
    reader.join(10)
    try:
        with open(status_file) as f:
            code = int(f.read().strip())
    except (OSError, ValueError):
        stream.write(f"pyrdma-vm: the VM exited ({proc.returncode}) without running the command "
                     "(boot failure?)\n")
        code = VM_FAILED
    shutil.rmtree(state, ignore_errors=True)
    return code, "".join(output)


def run(cmd, rwdirs=(), timeout=3600, force_vm=False):
    """Run ``cmd`` on the host's RDMA device if it has one, else in the Soft-RoCE VM."""
    if not force_vm and host_has_active_rdma_port():
        try:
            return subprocess.run(cmd, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return TIMED_OUT
    return run_in_vm(cmd, rwdirs, timeout)[0]


def main(argv=None):
    parser = argparse.ArgumentParser(prog="pyrdma-vm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rwdir", action="append", default=[], help="directory writable in the VM (repeatable)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds before the VM is killed")
    parser.add_argument("--force-vm", action="store_true", help="use the VM even if the host has a device")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    args = parser.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("no command given (use: pyrdma-vm -- CMD ...)")
    return run(cmd, args.rwdir, args.timeout, args.force_vm)


if __name__ == "__main__":
    sys.exit(main())
