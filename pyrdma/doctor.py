"""pyrdma-doctor: what this machine offers RDMA, what is missing, and the command that fixes each gap.

``python -m pyrdma.doctor`` (or ``pyrdma-doctor``; ``--json`` for the same as JSON) looks at:
the rdma-core libraries and pyrdma's extension; the kernel's RDMA devices and /dev/infiniband; for
each device and port its state, link layer, MTU, speed and GID table (types, addresses, and the
entry pyrdma would pick); whether rdma_cm binds the port's IPv4 address to that device;
RLIMIT_MEMLOCK against a 1 GiB registration; with CuPy, GPUDirect RDMA (dma-buf, nvidia-peermem);
whether ranks of this machine over TCP may copy straight out of each other's memory.
Exit status 0 when it found no problem, 1 otherwise. It runs where rdma-core or the extension
cannot be loaded, and says so.
"""
import argparse
import json
import os
import platform
import socket
import sys

from pyrdma import advice

# ibv_port_attr's active_width and active_speed codes, as ibv_devinfo prints them
WIDTHS = {1: 1, 2: 4, 4: 8, 8: 12, 16: 2}
SPEEDS_GBPS = {1: 2.5, 2: 5.0, 4: 10.0, 8: 10.0, 16: 14.0, 32: 25.0, 64: 50.0, 128: 100.0}
SOFT_ROCE = ("`modprobe rdma_rxe && rdma link add rxe0 type rxe netdev {netdev}` "
             "(Soft-RoCE over that Ethernet interface)")


class Report:
    """What the doctor found: sections of facts, and the problems with their fixes."""

    def __init__(self):
        self.sections = {}
        self.problems = []

    def problem(self, what, fix):
        self.problems.append({"problem": what, "fix": fix})

    def as_dict(self):
        return dict(self.sections, problems=self.problems)


def _default_netdev():
    """The interface of the default route (for the Soft-RoCE suggestion), else eth0."""
    try:
        with open("/proc/net/route") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if len(fields) > 2 and fields[1] == "00000000":
                    return fields[0]
    except OSError:
        pass
    return "eth0"


def _loaded_path(library):
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1]
                if os.path.basename(path).startswith(library):
                    return path
    except OSError:
        pass
    return None


def check_libraries(report):
    """pyrdma's extension, and rdma-core's libraries as pyrdma opens them (pyrdma._verbs.loader: dlopen
    on first use, PYRDMA_LIBIBVERBS / PYRDMA_LIBRDMACM honoured). Returns the pyrdma package when the
    verbs can be used, else None."""
    extension = {}
    for module in ("pyrdma._verbs.loader", "pyrdma._verbs.device", "pyrdma._verbs.cm"):
        try:
            __import__(module)
            extension[module] = {"loaded": True}
        except (ImportError, OSError) as exc:
            extension[module] = {"loaded": False, "error": str(exc)}
            report.problem(f"pyrdma's extension {module} cannot be loaded: {exc}", advice.load_fix(exc))
    report.sections["extension"] = extension
    libraries = {}
    report.sections["libraries"] = libraries
    if not extension["pyrdma._verbs.loader"]["loaded"]:
        return None
    from pyrdma._verbs.loader import library_status
    for status in library_status():
        library = status["library"]
        if status["loaded"]:
            libraries[library] = {"loaded": True, "path": _loaded_path(os.path.basename(status["path"]))}
            continue
        libraries[library] = {"loaded": False, "error": status["error"]}
        needs = advice.missing_library(status["error"])
        if needs in (None, library):        # else a library it needs is missing, reported as such
            report.problem(f"{library} cannot be loaded ({status['error']})", advice.install_command(library))
    if extension["pyrdma._verbs.device"]["loaded"] and libraries["libibverbs.so.1"]["loaded"]:
        import pyrdma
        return pyrdma
    return None


def check_kernel(report):
    """RDMA devices the kernel has (sysfs), and the device files of /dev/infiniband."""
    try:
        kernel = sorted(os.listdir(os.path.join(advice.SYSFS, "class", "infiniband")))
    except OSError:
        kernel = []
    files = {}
    try:
        names = sorted(os.listdir(advice.DEV_INFINIBAND))
    except OSError:
        names = None
    for name in names or []:
        path = os.path.join(advice.DEV_INFINIBAND, name)
        if os.path.isdir(path):       # by-ibdev/, by-path/: links to the same files
            continue
        try:
            os.close(os.open(path, os.O_RDWR | os.O_CLOEXEC))
            files[name] = {"open": True}
        except OSError as exc:
            files[name] = {"open": False, "error": os.strerror(exc.errno)}
    uverbs = advice.uverbs_files()
    report.sections["kernel"] = {"devices": kernel, "uverbs": uverbs}
    report.sections["dev_infiniband"] = files if names is not None else None
    if not kernel:
        report.problem("the kernel has no RDMA device (/sys/class/infiniband is empty or absent): no RDMA NIC, "
                       "or its driver is not loaded",
                       "load the NIC's RDMA driver (e.g. `modprobe mlx5_ib`), or "
                       + SOFT_ROCE.format(netdev=_default_netdev()))
        return kernel
    if names is None:
        report.problem(f"{advice.DEV_INFINIBAND} does not exist, so no device can be opened",
                       f"`modprobe ib_uverbs rdma_ucm` on the host; in a container `docker run "
                       f"--device={advice.DEV_INFINIBAND}` (or each uverbsN and rdma_cm with --device)")
        return kernel
    for device, path in sorted(uverbs.items()):
        name = os.path.basename(path)
        if name not in files:
            report.problem(f"{path} ({device}) is missing", advice.device_file_advice(device, 2))
        elif not files[name]["open"]:
            err = files[name]["error"]
            report.problem(f"{path} ({device}) cannot be opened: {err}",
                           advice.device_file_advice(device, 13))
    if "rdma_cm" not in files:
        report.problem(f"{advice.DEV_INFINIBAND}/rdma_cm is missing: rdma_cm (perftest -R, rping) cannot work",
                       f"`modprobe rdma_ucm`; in a container `docker run --device={advice.DEV_INFINIBAND}/rdma_cm`")
    elif not files["rdma_cm"]["open"]:
        report.problem(f"{advice.DEV_INFINIBAND}/rdma_cm cannot be opened: {files['rdma_cm']['error']}",
                       f"run as root or `chmod 666 {advice.DEV_INFINIBAND}/rdma_cm`")
    return kernel


def _speed(attr):
    width = WIDTHS.get(attr.active_width)
    speed = SPEEDS_GBPS.get(attr.active_speed)
    if width is None or speed is None:
        return None
    return {"width": f"{width}x", "lane_gbps": speed, "gbps": width * speed}


def _picks(rd):
    """(device, port, gid_index) pyrdma uses by default (PYRDMA_IB_* as the collectives read them);
    device None: the first with an ACTIVE port; gid_index None: the port's best."""
    from pyrdma.collectives.communicator import ib_config
    return ib_config()


def _cm_bind(rd, address, device):
    """Bind an rdma_cm id to ``address``: which device rdma_cm maps it to (or the error)."""
    try:
        with rd.CMID() as cm:
            cm.bind_addr(address, 0)
            ctx = cm.context
            return {"address": address, "bound": True, "device": ctx.name if ctx is not None else None,
                    "port": cm.port_num if ctx is not None else None}
    except (rd.RDMAError, ImportError, OSError) as exc:    # ImportError: librdmacm.so.1 is missing
        return {"address": address, "bound": False, "error": str(exc)}


def check_port(rd, ctx, port, pick, report):
    attr = ctx.query_port(port)
    try:
        state = rd.PortState(attr.state).name
    except ValueError:
        state = str(attr.state)
    info = {"port": port, "state": state, "link_layer": attr.link_layer,
            "active_mtu": attr.active_mtu_bytes, "max_mtu": 128 << attr.max_mtu, "speed": _speed(attr),
            "lid": attr.lid if attr.link_layer == "InfiniBand" else None}
    where = f"{ctx.name} port {port}"
    if attr.state != rd.PORT_ACTIVE:
        if attr.link_layer == "Ethernet":
            fix = "bring its Ethernet interface up (`ip link set dev <netdev> up`) and check the cable or switch port"
        else:
            fix = "check the cable, and that a subnet manager runs on the fabric (`systemctl start opensm` on one node)"
        report.problem(f"{where} is {state}, not ACTIVE", fix)
    try:
        entries = ctx.gid_table(port)
    except rd.RDMAError as exc:
        entries = []
        report.problem(f"{where}: the GID table cannot be read ({exc})", "see the problem's text")
    info["gids"] = [{"index": e.index, "type": e.gid_type, "gid": e.gid_str, "ipv4": e.ipv4, "netdev": e.netdev,
                     "local_scope": e.local_scope} for e in entries]
    chosen = None
    try:
        chosen = pick if pick is not None else ctx.best_gid_index(port)
    except rd.RDMAError as exc:
        report.problem(f"{where}: no GID to use ({exc})",
                       "give its Ethernet interface an IP address: `ip addr add 10.0.0.1/24 dev <netdev>`")
    info["gid_index"] = chosen
    info["gid_from"] = "PYRDMA_IB_GID_INDEX" if pick is not None else "best_gid_index: RoCE v2, reachable, IPv4 first"
    if chosen is not None and entries and chosen not in [e.index for e in entries]:
        best = min(entries, key=rd.gid_preference).index
        report.problem(f"{where}: GID index {chosen} (PYRDMA_IB_GID_INDEX) is an empty entry",
                       f"pick a populated one: `export PYRDMA_IB_GID_INDEX={best}`")
    if attr.link_layer == "Ethernet" and entries:
        v2_ipv4 = [e for e in entries if e.gid_type == "RoCEv2" and e.ipv4]
        netdev = next((e.netdev for e in entries if e.netdev), "<netdev>")
        if not v2_ipv4:
            report.problem(f"{where} has no RoCE v2 GID with an IPv4 address (routable RoCE and rdma_cm need one)",
                           f"give {netdev} an IPv4 address: `ip addr add 10.0.0.1/24 dev {netdev}`")
        elif all(e.local_scope for e in v2_ipv4):
            info["note"] = (f"its IPv4 GIDs are loopback or link-local ({', '.join(e.ipv4 for e in v2_ipv4)}): "
                            f"other hosts cannot reach this port")
        by_index = {e.index: e for e in entries}
        entry = by_index.get(chosen)
        have_cm = os.path.exists(os.path.join(advice.DEV_INFINIBAND, "rdma_cm"))
        if entry is not None and entry.ipv4 and attr.state == rd.PORT_ACTIVE and have_cm:
            info["rdma_cm"] = cm = _cm_bind(rd, entry.ipv4, ctx.name)
            if cm["bound"] and cm["device"] is None and entry.local_scope:
                cm["note"] = "a loopback or link-local address: rdma_cm ties it to no device"
            elif not cm["bound"]:
                report.problem(f"{where}: rdma_cm cannot bind {entry.ipv4} ({cm['error']})",
                               f"`modprobe rdma_ucm`; check {advice.DEV_INFINIBAND}/rdma_cm is there and writable")
            elif cm["device"] != ctx.name:
                report.problem(f"{where}: rdma_cm binds {entry.ipv4} to {cm['device']}, not {ctx.name}",
                               f"connect with the address of an interface {ctx.name} runs over (`rdma link show`)")
    return info


def check_devices(rd, report):
    try:
        listed = rd.get_device_list()
    except rd.RDMAError as exc:
        report.problem(f"libibverbs cannot list devices: {exc}", "see the problem's text")
        return []
    kernel = report.sections.get("kernel", {}).get("devices", [])
    if kernel and not listed:
        report.problem(f"the kernel has RDMA devices ({', '.join(kernel)}) but libibverbs lists none: "
                       f"no user-space driver (provider) for them",
                       "apt-get install ibverbs-providers (Debian/Ubuntu) or dnf install libibverbs (RHEL/Fedora)")
    try:
        want_device, want_port, want_gid = _picks(rd)
    except rd.UsageError as exc:
        report.problem(f"the PYRDMA_IB_* environment is invalid: {exc}", "fix or unset the variable it names")
        want_device, want_port, want_gid = None, 1, None
    devices = []
    default = None
    for entry in listed:
        dev = {"name": entry.name, "node_guid": entry.guid, "node_type": entry.node_type}
        devices.append(dev)
        try:
            ctx = rd.Context(entry.name)
        except rd.RDMAError as exc:
            dev["error"] = str(exc)
            hint = advice.advice("ibv_open_device", exc.errno, entry.name)
            report.problem(f"{entry.name} cannot be opened: {exc}", hint or "see the problem's text")
            continue
        with ctx:
            attr = ctx.query_device()
            dev.update(fw_ver=attr.fw_ver, vendor_id=f"0x{attr.vendor_id:x}", vendor_part_id=attr.vendor_part_id,
                       ports=[], dmabuf=bool(ctx.dmabuf_supported()))
            for port in range(1, attr.phys_port_cnt + 1):
                mine = want_device in (None, entry.name) and port == want_port
                info = check_port(rd, ctx, port, want_gid if mine else None, report)
                dev["ports"].append(info)
                if default is None and want_device in (None, entry.name) and info["state"] == "ACTIVE" \
                        and (want_device is None or port == want_port):
                    default = {"device": entry.name, "port": port, "gid_index": info["gid_index"]}
    if want_device is not None and want_device not in [d["name"] for d in devices]:
        report.problem(f"PYRDMA_IB_HCA names {want_device}, which is not here",
                       f"`export PYRDMA_IB_HCA=<one of {', '.join(d['name'] for d in devices) or 'none'}>` or unset it")
    elif listed and default is None:
        report.problem("no RDMA device has an ACTIVE port, so pyrdma.Context() and the collectives find none",
                       "see the port problems above")
    report.sections["default"] = default
    return devices


def check_memlock(report):
    state = advice.memlock_state(advice.GIB)
    report.sections["memlock"] = state
    if not state["fits"]:
        report.problem(f"RLIMIT_MEMLOCK is {state['soft_text']} (hard {state['hard_text']}) without CAP_IPC_LOCK: "
                       f"registering 1 GiB would fail with ENOMEM (Cannot allocate memory)", advice.MEMLOCK_FIX)


YAMA_PTRACE_SCOPE = "/proc/sys/kernel/yama/ptrace_scope"


def check_same_machine(report):
    """Whether TCP between ranks of this machine copies large messages straight out of the
    sender's memory (process_vm_readv), as the TCP transport tries: a child's memory read here
    (a seccomp filter, as Docker's default, forbids it), and Yama's ptrace scope (1 or more keeps
    ranks that are siblings from reading each other)."""
    import ctypes
    state = {"process_vm_readv": False, "ptrace_scope": None, "enabled": None}
    try:
        with open(YAMA_PTRACE_SCOPE) as f:
            state["ptrace_scope"] = int(f.read().strip())
    except (OSError, ValueError):
        pass
    try:
        from pyrdma._engine import read_memory_of
        from pyrdma.collectives.transport.tcp import by_address_allowed
    except ImportError as exc:
        state["note"] = f"pyrdma's extension is not loaded ({exc})"
        report.sections["same_machine"] = state
        return
    state["enabled"] = by_address_allowed()
    held = ctypes.create_string_buffer(os.urandom(16), 16)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                             # the child holds the same bytes at the same address
        try:
            os.read(r, 1)
        finally:
            os._exit(0)
    try:
        state["process_vm_readv"] = read_memory_of(pid, ctypes.addressof(held), 16) == held.raw
    finally:
        os.write(w, b"x")
        os.waitpid(pid, 0)
        os.close(r)
        os.close(w)
    report.sections["same_machine"] = state


def check_gpus(rd, report, devices):
    try:
        import cupy
        count = cupy.cuda.runtime.getDeviceCount()
    except ImportError:
        report.sections["gpus"] = {"cupy": False, "note": "CuPy is not installed: GPU checks skipped "
                                                          "(`pip install cupy-cuda12x` to use GPU buffers)"}
        return
    except Exception as exc:    # CUDARuntimeError: no driver or no GPU
        report.sections["gpus"] = {"cupy": True, "count": 0, "note": f"CuPy sees no GPU: {exc}"}
        return
    from pyrdma.cuda import cuda_driver, gpudirect_status, peermem_module
    gpus = []
    nic = (report.sections.get("default") or {}).get("device")
    for ordinal in range(count):
        gpu = {"ordinal": ordinal, "name": cupy.cuda.runtime.getDeviceProperties(ordinal)["name"].decode()}
        try:
            if nic is not None:
                with rd.Context(nic) as ctx, rd.ProtectionDomain(ctx) as pd:
                    status = gpudirect_status(pd, ordinal)
                gpu.update(nic=nic, nic_dmabuf=status.nic_dmabuf, gpu_dmabuf=status.gpu_dmabuf,
                           peermem=status.peermem, method=status.method)
            else:
                gpu.update(gpu_dmabuf=bool(cuda_driver().dmabuf_supported(ordinal)), peermem=peermem_module(),
                           method=None)
        except rd.RDMAError as exc:
            gpu["error"] = str(exc)
        gpus.append(gpu)
        if nic is not None and gpu.get("method") is None:
            report.problem(f"GPU {ordinal} ({gpu['name']}) and {nic}: no GPUDirect RDMA (dma-buf: NIC "
                           f"{gpu.get('nic_dmabuf')}, GPU {gpu.get('gpu_dmabuf')}; nvidia-peermem not loaded): "
                           f"GPU buffers go through host memory",
                           "`modprobe nvidia-peermem`, or the open NVIDIA kernel modules (dma-buf) with a "
                           "kernel and NIC that support ibv_reg_dmabuf_mr")
    report.sections["gpus"] = {"cupy": True, "count": count, "gpus": gpus}


def diagnose():
    """Run every check; returns the Report."""
    report = Report()
    report.sections["host"] = {"hostname": socket.gethostname(), "kernel": platform.release(),
                               "python": platform.python_version(), "uid": os.getuid()}
    rd = check_libraries(report)
    check_kernel(report)
    devices = []
    if rd is not None:
        devices = check_devices(rd, report)
    report.sections["devices"] = devices
    check_memlock(report)
    check_same_machine(report)
    if rd is not None:
        check_gpus(rd, report, devices)
    else:
        report.sections["gpus"] = {"note": "skipped: pyrdma's extension or libibverbs.so.1 is not loaded"}
    return report


def _yes(flag):
    return "yes" if flag else "no"


def render(report):
    """The report as text, for people."""
    s = report.sections
    out = [f"pyrdma doctor: {s['host']['hostname']}, Linux {s['host']['kernel']}, Python {s['host']['python']}",
           "", "libraries"]
    for library, lib in s["libraries"].items():
        out.append(f"  {library:<22} " + (f"loaded ({lib['path']})" if lib["loaded"] else f"MISSING: {lib['error']}"))
    for module, ext in s["extension"].items():
        out.append(f"  {module:<22} " + ("loaded" if ext["loaded"] else f"NOT LOADED: {ext['error']}"))
    kernel = s["kernel"]
    out += ["", "kernel RDMA devices: " + (", ".join(kernel["devices"]) or "none")]
    if s["extension"]["pyrdma._verbs.device"]["loaded"]:
        out.append("libibverbs devices: " + (", ".join(d["name"] for d in s["devices"]) or "none"))
    dev_ib = s["dev_infiniband"]
    if dev_ib is None:
        out.append(f"{advice.DEV_INFINIBAND}: absent")
    else:
        byfile = {os.path.basename(p): d for d, p in kernel["uverbs"].items()}
        out.append(f"{advice.DEV_INFINIBAND}:")
        for name, f in dev_ib.items():
            what = f" ({byfile[name]})" if name in byfile else ""
            out.append(f"  {name}{what}: " + ("opens read-write" if f["open"] else f"cannot open: {f['error']}"))
    for dev in s["devices"]:
        out += ["", f"device {dev['name']} (node GUID {dev['node_guid']}, {dev['node_type']})"]
        if "error" in dev:
            out.append(f"  cannot open: {dev['error']}")
            continue
        out.append(f"  firmware {dev['fw_ver'] or '-'}, vendor {dev['vendor_id']}, dma-buf registration: "
                   f"{_yes(dev['dmabuf'])}")
        for p in dev["ports"]:
            speed = p["speed"]
            speed_text = f"{speed['gbps']:g} Gb/s ({speed['width']} {speed['lane_gbps']:g} Gb/s)" if speed else "?"
            out.append(f"  port {p['port']}: {p['state']}, {p['link_layer']}, MTU {p['active_mtu']} "
                       f"(max {p['max_mtu']}), {speed_text}" + (f", LID {p['lid']}" if p["lid"] is not None else ""))
            out.append(f"    {'GID':>4}  {'type':<7} {'address':<39}  {'IPv4':<15} netdev")
            for g in p["gids"]:
                mark = f"  <- pyrdma uses this ({p['gid_from']})" if g["index"] == p["gid_index"] else ""
                out.append(f"    {g['index']:>4}  {g['type']:<7} {g['gid']:<39}  {g['ipv4'] or '-':<15} "
                           f"{g['netdev'] or '-'}{mark}")
            if not p["gids"]:
                out.append("    (no GID)")
            if "note" in p:
                out.append(f"    note: {p['note']}")
            cm = p.get("rdma_cm")
            if cm:
                if "note" in cm:
                    out.append(f"    rdma_cm: {cm['address']} binds, to no device ({cm['note']})")
                else:
                    out.append(f"    rdma_cm: {cm['address']} binds to " + (f"{cm['device']} port {cm['port']}"
                               if cm["bound"] else f"nothing: {cm['error']}"))
    if s.get("default"):
        d = s["default"]
        out += ["", f"pyrdma's default: {d['device']} port {d['port']} GID index {d['gid_index']}"]
    m = s["memlock"]
    out += ["", f"memlock: RLIMIT_MEMLOCK {m['soft_text']} (hard {m['hard_text']}), {m['locked'] >> 10} KiB locked, "
                f"CAP_IPC_LOCK {_yes(m['cap_ipc_lock'])}: a 1 GiB registration "
                + ("fits" if m["fits"] else "does NOT fit")]
    if m["cap_ipc_lock"] and m["soft"] is not None and m["locked"] + m["nbytes"] > m["soft"]:
        out.append(f"  (only through CAP_IPC_LOCK: a process without it, not root say, is held to {m['soft_text']})")
    sm = s["same_machine"]
    if "note" in sm:
        why = sm["note"]
    elif not sm["enabled"]:
        why = "no: PYRDMA_SOCKET_CMA=0"
    elif not sm["process_vm_readv"]:
        why = "no: process_vm_readv is refused here (a seccomp filter? Docker: --cap-add SYS_PTRACE)"
    elif sm["ptrace_scope"]:
        why = (f"only where a rank is another's parent: Yama's ptrace_scope is {sm['ptrace_scope']} "
               f"(`sysctl kernel.yama.ptrace_scope=0` lets sibling ranks read each other)")
    else:
        why = "yes"
    out.append("TCP between ranks of this machine, large messages copied out of the sender's memory "
               f"(process_vm_readv): {why}")
    g = s["gpus"]
    out.append("GPUs: " + (g.get("note") or f"{g['count']} (CuPy)"))
    for gpu in g.get("gpus", []):
        if "error" in gpu:
            out.append(f"  GPU {gpu['ordinal']} {gpu['name']}: {gpu['error']}")
            continue
        out.append(f"  GPU {gpu['ordinal']} {gpu['name']}: dma-buf GPU {_yes(gpu['gpu_dmabuf'])}"
                   + (f", NIC {gpu['nic']} {_yes(gpu['nic_dmabuf'])}" if "nic" in gpu else "")
                   + f"; nvidia-peermem {'loaded' if gpu['peermem'] else 'not loaded'}"
                   + (f"; GPUDirect RDMA via {gpu['method'] or 'nothing (staged through host memory)'}"
                      if "nic" in gpu else ""))
    out.append("")
    if report.problems:
        out.append(f"problems ({len(report.problems)}):")
        for i, p in enumerate(report.problems, 1):
            out += [f"  {i}. {p['problem']}", f"     fix: {p['fix']}"]
    else:
        out.append("no problems found")
    return "\n".join(out)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="pyrdma-doctor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")
    args = parser.parse_args(argv)
    report = diagnose()
    if args.json:
        print(json.dumps(report.as_dict(), indent=2, default=str))
    else:
        print(render(report))
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main())
