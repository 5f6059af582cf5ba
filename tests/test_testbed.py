"""The test bed itself: the Soft-RoCE VM runner (pyrdma.testing.vm), the JUnit check
(pyrdma.testing.junit), the device fixtures (conftest) and the multi-process helper (mp).
Host tests use fakes (a fake vng, a fake sysfs); device tests prove the device is real."""
import os
import re
import signal
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

import conftest
from mp import run_ranks
from pyrdma.testing import free_port
from pyrdma import testing
from pyrdma.testing import junit, vm

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------- kernel and sysfs discovery

def _kernel(boot, modules, version, rxe=True, via_modules_dep=False):
    (boot / f"vmlinuz-{version}").write_bytes(b"kernel")
    moddir = modules / version
    if rxe and via_modules_dep:
        moddir.mkdir(parents=True)
        (moddir / "modules.dep").write_text("kernel/drivers/infiniband/sw/rxe/rdma_rxe.ko.xz: ib_core.ko\n")
    elif rxe:
        rxe_dir = moddir / "kernel" / "drivers" / "infiniband" / "sw" / "rxe"
        rxe_dir.mkdir(parents=True)
        (rxe_dir / "rdma_rxe.ko").write_bytes(b"")
    else:
        moddir.mkdir(parents=True)
        (moddir / "modules.dep").write_text("kernel/net/foo.ko:\n")


def test_find_rxe_kernel_picks_the_newest_with_rdma_rxe(tmp_path):
    boot, modules = tmp_path / "boot", tmp_path / "modules"
    boot.mkdir()
    assert vm.find_rxe_kernel(str(boot), str(modules)) is None
    _kernel(boot, modules, "6.1.0-9-amd64")
    _kernel(boot, modules, "6.1.0-56-amd64", via_modules_dep=True)
    _kernel(boot, modules, "6.12.0-1-amd64", rxe=False)            # newer, but no Soft-RoCE
    _kernel(boot, modules, "6.2.0-1-amd64")
    (boot / "vmlinuz-6.99.0-1-amd64").write_bytes(b"")             # no modules at all
    # numeric, not lexical: 6.2 > 6.1.0-56 > 6.1.0-9
    assert vm.find_rxe_kernel(str(boot), str(modules)) == str(boot / "vmlinuz-6.2.0-1-amd64")
    os.remove(boot / "vmlinuz-6.2.0-1-amd64")
    assert vm.find_rxe_kernel(str(boot), str(modules)) == str(boot / "vmlinuz-6.1.0-56-amd64")


def _sysfs(tmp_path, ports):
    """ports: {(device, port): state text}."""
    for (dev, port), state in ports.items():
        d = tmp_path / dev / "ports" / str(port)
        d.mkdir(parents=True)
        (d / "state").write_text(state + "\n")
    return str(tmp_path)


def test_active_rdma_devices_reads_sysfs(tmp_path):
    sysfs = _sysfs(tmp_path, {("mlx5_0", 1): "1: DOWN", ("mlx5_1", 1): "4: ACTIVE", ("rxe0", 1): "4: ACTIVE",
                              ("rxe0", 2): "4: ACTIVE"})
    assert vm.active_rdma_devices(sysfs) == ["mlx5_1", "rxe0"]
    assert conftest.active_rdma_devices(sysfs) == ["mlx5_1", "rxe0"]
    assert vm.host_has_active_rdma_port(sysfs)
    assert not vm.host_has_active_rdma_port(str(tmp_path / "none"))


def test_rc_resends_reads_soft_roce_counters(tmp_path):
    from pyrdma.testing import rc_resends
    counters = tmp_path / "rxe0" / "ports" / "1" / "hw_counters"
    counters.mkdir(parents=True)
    (counters / "completer_retry_err").write_text("44\n")
    (counters / "duplicate_request").write_text("1577\n")
    assert rc_resends("rxe0", sysfs=str(tmp_path)) == {"completer_retry_err": 44, "duplicate_request": 1577}
    assert rc_resends("mlx5_0", sysfs=str(tmp_path)) is None         # a device without these counters
    (counters / "duplicate_request").write_text("n/a\n")
    assert rc_resends("rxe0", sysfs=str(tmp_path)) is None


def test_counting_rc_resends_gives_the_increase_over_the_block(tmp_path):
    from pyrdma.testing import counting_rc_resends
    counters = tmp_path / "rxe0" / "ports" / "1" / "hw_counters"
    counters.mkdir(parents=True)
    (counters / "completer_retry_err").write_text("44\n")
    (counters / "duplicate_request").write_text("1577\n")
    with counting_rc_resends("rxe0", sysfs=str(tmp_path)) as resends:
        assert resends == {}
        (counters / "completer_retry_err").write_text("47\n")
        (counters / "duplicate_request").write_text("1677\n")
    assert resends == {"completer_retry_err": 3, "duplicate_request": 100}
    with pytest.raises(KeyError):         # taken even when the block fails
        with counting_rc_resends("rxe0", sysfs=str(tmp_path)) as resends:
            (counters / "completer_retry_err").write_text("48\n")
            raise KeyError("x")
    assert resends == {"completer_retry_err": 1, "duplicate_request": 0}
    with counting_rc_resends("mlx5_0", sysfs=str(tmp_path)) as resends:
        pass
    assert resends == {}                  # no such counters: nothing to report


def test_a_perftest_clock_failure_runs_again_on_a_fresh_port_and_nothing_else_does():
    calls = []
    ports = iter([6001, 6002])

    def run_once(srv, cli, port):
        calls.append((srv, cli, port))
        if len(calls) < 3:
            raise AssertionError(f"ib_write_bw: {testing.PERFTEST_CLOCK_FAILED}: 0.85 < 0.9")
        return "ok"

    assert testing.again_if_perftest_clock_failed(run_once, ["s", "-p", "6000"], ["c", "-p", "6000", "h"], 6000,
                                                  lambda: next(ports)) == "ok"
    assert calls == [(["s", "-p", "6000"], ["c", "-p", "6000", "h"], 6000),
                     (["s", "-p", "6001"], ["c", "-p", "6001", "h"], 6001),
                     (["s", "-p", "6002"], ["c", "-p", "6002", "h"], 6002)]

    def other_failure(srv, cli, port):
        calls.append(port)
        raise AssertionError("ib_write_bw exited 1: Couldn't connect")
    calls.clear()
    with pytest.raises(AssertionError, match="connect"):
        testing.again_if_perftest_clock_failed(other_failure, ["s"], ["c"])
    assert calls == [None]

    def always(srv, cli, port):
        calls.append(port)
        raise AssertionError(testing.PERFTEST_CLOCK_FAILED)
    calls.clear()
    with pytest.raises(AssertionError):
        testing.again_if_perftest_clock_failed(always, ["s"], ["c"], attempts=2)
    assert calls == [None, None]

    def exits_0_with_the_clock_failed(srv, cli, port):      # ib_write_lat -a: a row missing, exit 0
        calls.append(port)
        return ("server output", f"client output\n{testing.PERFTEST_CLOCK_FAILED}: 0.855 < 0.9\n")
    calls.clear()
    with pytest.raises(AssertionError, match="clock failed"):
        testing.again_if_perftest_clock_failed(exits_0_with_the_clock_failed, ["s"], ["c"], attempts=2)
    assert calls == [None, None]


def test_sysfs_best_gid_index(tmp_path):
    port = tmp_path / "rxe0" / "ports" / "1"
    (port / "gids").mkdir(parents=True)
    (port / "gid_attrs" / "types").mkdir(parents=True)
    (port / "link_layer").write_text("Ethernet\n")
    gids = {0: ("fe80:0000:0000:0000:0000:0000:0000:0001", "RoCE v2"),
            1: ("0000:0000:0000:0000:0000:ffff:7f00:0001", "IB/RoCE v1"),
            2: ("0000:0000:0000:0000:0000:0000:0000:0000", "RoCE v2"),
            3: ("0000:0000:0000:0000:0000:ffff:7f00:0001", "RoCE v2")}
    for i, (gid, kind) in gids.items():
        (port / "gids" / str(i)).write_text(gid + "\n")
        (port / "gid_attrs" / "types" / str(i)).write_text(kind + "\n")
    assert conftest.sysfs_best_gid_index("rxe0", sysfs=str(tmp_path)) == 3      # RoCEv2 IPv4-mapped
    os.remove(port / "gids" / "3")
    assert conftest.sysfs_best_gid_index("rxe0", sysfs=str(tmp_path)) == 0      # then any RoCEv2
    (port / "link_layer").write_text("InfiniBand\n")
    assert conftest.sysfs_best_gid_index("rxe0", sysfs=str(tmp_path)) == 0
    # a host's device on a veth: its fe80 GID comes first in the table, its IPv4 one wins
    (port / "link_layer").write_text("Ethernet\n")
    (port / "gids" / "3").write_text("0000:0000:0000:0000:0000:ffff:c612:0001\n")
    (port / "gids" / "1").write_text("0000:0000:0000:0000:0000:ffff:a9fe:0001\n")       # 169.254.0.1
    (port / "gid_attrs" / "types" / "1").write_text("RoCE v2\n")
    assert conftest.sysfs_best_gid_index("rxe0", sysfs=str(tmp_path)) == 3


# ---------------------------------------------------------------- the guest script and vng command line

def test_guest_environment_passes_the_test_variables_only():
    host = {"PYTHONPATH": "/src", "PYRDMA_REQUIRE_DEVICE": "1", "PYRDMA_X": "y", "SSH_AUTH_SOCK": "/s", "PATH": "/p"}
    env = vm.guest_environment({"EXTRA": "1", "PYTHONPATH": "/other"}, environ=host)
    assert env == {"PYTHONPATH": "/other", "PYRDMA_REQUIRE_DEVICE": "1", "PYRDMA_X": "y", "EXTRA": "1"}


def test_guest_script_is_valid_bash_and_quotes_everything(tmp_path):
    cmd = ["python3", "-c", "print('a b')", "$HOME", "it's"]
    env = {"WEIRD": "a 'b' \"c\" $d `e`"}
    script = vm.guest_script(cmd, "/dir with space", env, str(tmp_path / "st ate"))
    path = tmp_path / "guest.sh"
    path.write_text(script)
    subprocess.run(["bash", "-n", str(path)], check=True, timeout=30)
    for needed in ("modprobe rdma_rxe", "rdma link add rxe0 type rxe netdev lo", "ip link set lo up",
                   "/sys/class/infiniband/rxe0/ports/1/state", "ibv_devices",
                   "cd '/dir with space'", "export WEIRD='a '\"'\"'b'\"'\"' \"c\" $d `e`'",
                   "python3 -c 'print('\"'\"'a b'\"'\"')' '$HOME' 'it'\"'\"'s'"):
        assert needed in script, needed
    # rxe0 comes up before the command runs, and the status is recorded after it
    assert script.index("rdma link add") < script.index("python3 -c") < script.index("/status")



def test_cached_dirs_are_pythons_and_the_tree_outermost_first(tmp_path):
    import sysconfig
    dirs = vm.cached_dirs(str(tmp_path))
    assert str(tmp_path) in dirs and os.path.realpath(sysconfig.get_paths()["stdlib"]) in dirs
    for d in dirs:                       # none inside another, and never the whole root
        assert d != "/" and not any(o != d and d.startswith(o + "/") for o in dirs), dirs
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "c").mkdir()
    paths = [str(tmp_path / "a" / "b"), str(tmp_path / "a"), str(tmp_path / "c"), str(tmp_path / "missing"), "/"]
    assert vm.cached_dirs("/", paths=paths) == [str(tmp_path / "a"), str(tmp_path / "c")]


def test_guest_script_binds_the_cached_view_and_keeps_the_writable_dirs(tmp_path):
    plain = vm.guest_script(["mycmd"], "/tree", {}, str(tmp_path))
    assert vm.CACHED_TAG not in plain
    script = vm.guest_script(["mycmd"], "/tree", {}, str(tmp_path), cached=["/tree", "/py/lib"],
                             rwdirs=["/tree/build/out", "/elsewhere"])
    path = tmp_path / "guest.sh"
    path.write_text(script)
    subprocess.run(["bash", "-n", str(path)], check=True, timeout=30)
    assert "cache=loose" in script and f"{vm.CACHED_TAG} {vm.CACHED_MOUNT}" in script
    keep = script.index(f"mount --bind /tree/build/out {vm.CACHED_MOUNT}-rw/0")
    bind = script.index(f"mount --bind {vm.CACHED_MOUNT}/tree /tree")
    back = script.index(f"mount --bind {vm.CACHED_MOUNT}-rw/0 /tree/build/out")
    assert script.index("rdma link add rxe0") < keep < bind < back < script.index("mycmd")
    assert f"mount --bind {vm.CACHED_MOUNT}/py/lib /py/lib" in script
    assert "/elsewhere" not in script             # not under a cached directory: nothing hides it
    assert "the cached export did not mount" in script    # the uncached root is the fallback


# ---------------------------------------------------------------- the multi-host test bed (--hosts)

def test_host_layout_names_sort_after_rxe0_and_stay_in_the_test_range():
    layout = vm.host_layout(4, 9000)
    assert [h["device"] for h in layout] == ["rxeh1", "rxeh2", "rxeh3", "rxeh4"]
    assert sorted(["rxe0"] + [h["device"] for h in layout])[0] == "rxe0"    # rxe0 stays the first device
    assert [h["address"] for h in layout] == ["198.18.0.1", "198.18.0.2", "198.18.0.3", "198.18.0.4"]
    assert all(len(h["bridge_port"]) <= 15 and h["mtu"] == 9000 for h in layout)   # IFNAMSIZ
    assert len({h["mac"] for h in layout}) == 4 and len({h["table"] for h in layout}) == 4
    for bad in ((1, 1500), (5, 1500), (2, 1234)):
        with pytest.raises(ValueError):
            vm.host_layout(*bad)


def test_topology_script_routes_each_pair_across_the_bridge(tmp_path):
    script = vm.topology_script(3, 1500, "/st ate/hosts.json")
    path = tmp_path / "topo.sh"
    path.write_text("fail() { exit 1; }\n" + script)
    subprocess.run(["bash", "-n", str(path)], check=True, timeout=30)
    lines = script.splitlines()
    for needed in ("ip link add rdbr0 mtu 1500 type bridge",
                   "ip link add rdh2 mtu 1500 address 02:00:c6:12:00:02 type veth peer name rdh2b mtu 1500",
                   "ip link set rdh2b master rdbr0 up", "net.ipv4.conf.rdh2.accept_local=1",
                   "net.ipv4.conf.rdh2.rp_filter=0", "net.ipv4.conf.all.rp_filter=0",
                   "ip addr add 198.18.0.2/24 dev rdh2",
                   "ip route add 198.18.0.0/24 dev rdh2 src 198.18.0.2 table 102",
                   "ip rule add pref 100 iif lo from 198.18.0.1 to 198.18.0.3 lookup 101",
                   "ip rule add pref 100 iif lo from 198.18.0.3 to 198.18.0.2 lookup 103",
                   "ip neigh replace 198.18.0.3 lladdr 02:00:c6:12:00:03 dev rdh1 nud permanent",
                   "rdma link add rxeh3 type rxe netdev rdh3", "export PYRDMA_TEST_HOSTS='/st ate/hosts.json'"):
        assert any(needed in line for line in lines), needed
    assert sum("ip rule add pref 100 " in line for line in lines) == 3 * 2       # every ordered pair
    # the pair rules exist before the local table's rule moves behind them
    last_pair_rule = max(i for i, line in enumerate(lines) if "ip rule add pref 100 " in line)
    assert last_pair_rule < next(i for i, line in enumerate(lines) if "lookup local" in line and "add" in line) \
        < next(i for i, line in enumerate(lines) if line.startswith("ip rule del pref 0 lookup local"))
    assert "198.19." not in script and "10." not in script.replace("1000", "")
    assert "mtu 9000" in vm.topology_script(2, 9000, "/h.json")


FAKE_NET_TOOLS = ("ip", "tc", "sysctl", "rdma")


def _fake_guest(tmp_path, gids):
    """A fake PATH (ip, sysctl, rdma log their arguments; ibv_devices lists rxe0 first) and sysfs
    (``gids``: {device: [(gid, type), ...]}, every port ACTIVE)."""
    bindir, log = tmp_path / "bin", tmp_path / "calls.log"
    bindir.mkdir()
    for tool in FAKE_NET_TOOLS:
        (bindir / tool).write_text(f'#!/bin/sh\necho "{tool} $*" >> {log}\n')
        (bindir / tool).chmod(0o755)
    (bindir / "ibv_devices").write_text("#!/bin/sh\necho '    device  node GUID'\necho '    ------  ---'\n"
                                        "echo '    rxe0    0'\necho '    rxeh1   0'\n")
    (bindir / "ibv_devices").chmod(0o755)
    sysfs = tmp_path / "sysfs"
    for dev, table in gids.items():
        port = sysfs / dev / "ports" / "1"
        (port / "gids").mkdir(parents=True)
        (port / "gid_attrs" / "types").mkdir(parents=True)
        (port / "state").write_text("4: ACTIVE\n")
        for i, (gid, kind) in enumerate(table):
            (port / "gids" / str(i)).write_text(gid + "\n")
            (port / "gid_attrs" / "types" / str(i)).write_text(kind + "\n")
    return bindir, log, sysfs


def test_topology_script_writes_the_hosts_the_hosts_module_reads(tmp_path):
    from pyrdma.testing import hosts
    empty = "0000:0000:0000:0000:0000:0000:0000:0000"
    gids = {"rxeh1": [("fe80:0000:0000:0000:0000:c6ff:fe12:0001", "RoCE v2"),
                      ("0000:0000:0000:0000:0000:ffff:c612:0001", "IB/RoCE v1"),
                      ("0000:0000:0000:0000:0000:ffff:c612:0001", "RoCE v2")],
            "rxeh2": [("fe80:0000:0000:0000:0000:c6ff:fe12:0002", "RoCE v2"),
                      ("0000:0000:0000:0000:0000:ffff:c612:0002", "RoCE v2"), (empty, "")]}
    bindir, log, sysfs = _fake_guest(tmp_path, gids)
    out = tmp_path / "hosts.json"
    script = tmp_path / "topo.sh"
    script.write_text('set -u\nfail() { echo "FAIL: $*"; exit 9; }\n' + vm.topology_script(2, 1500, str(out), str(sysfs))
                      + 'echo "env=$PYRDMA_TEST_HOSTS"\n')
    r = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"env={out}" in r.stdout
    h1, h2 = hosts.load(str(out))
    assert (h1.name, h1.device, h1.netdev, h1.bridge_port, h1.address, h1.gid_index) == \
        ("h1", "rxeh1", "rdh1", "rdh1b", "198.18.0.1", 2)           # the RoCE v2 one, not v1 nor fe80
    assert (h2.device, h2.address, h2.gid_index, h2.mtu) == ("rxeh2", "198.18.0.2", 1, 1500)
    assert "rdma link add rxeh2 type rxe netdev rdh2" in log.read_text()


def test_topology_script_fails_without_the_hosts_ipv4_gid(tmp_path, monkeypatch):
    monkeypatch.setattr(vm, "PORT_ACTIVE_WAIT_S", 0.3)
    gids = {"rxeh1": [("0000:0000:0000:0000:0000:ffff:c612:0001", "RoCE v2")],
            "rxeh2": [("fe80:0000:0000:0000:0000:c6ff:fe12:0002", "RoCE v2")]}   # no IPv4 GID (yet)
    bindir, _, sysfs = _fake_guest(tmp_path, gids)
    script = tmp_path / "topo.sh"
    script.write_text('fail() { echo "FAIL: $*"; exit 9; }\n'
                      + vm.topology_script(2, 1500, str(tmp_path / "h.json"), str(sysfs)))
    r = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}"))
    assert r.returncode == 9 and "FAIL: rxeh2 not ACTIVE with a RoCE v2 GID for 198.18.0.2" in r.stdout


def test_guest_script_builds_the_hosts_between_rxe0_and_the_command(tmp_path):
    plain = vm.guest_script(["true"], "/", {}, str(tmp_path))
    assert "rdbr0" not in plain and "PYRDMA_TEST_HOSTS" not in plain
    script = vm.guest_script(["mycmd"], "/", {}, str(tmp_path), hosts=2, mtu=9000)
    assert script.index("rdma link add rxe0") < script.index("rdma link add rxeh1") < script.index("mycmd")
    assert f"export PYRDMA_TEST_HOSTS={tmp_path}/hosts.json" in script and "mtu 9000" in script
    # a PYRDMA_TEST_HOSTS passed from the host (every PYRDMA_* is) cannot override the guest's own
    script = vm.guest_script(["mycmd"], "/", {"PYRDMA_TEST_HOSTS": "/stale.json"}, str(tmp_path), hosts=2)
    assert script.index("PYRDMA_TEST_HOSTS=/stale.json") < script.index(f"PYRDMA_TEST_HOSTS={tmp_path}/hosts.json")


def test_hosts_module(tmp_path, monkeypatch):
    from pyrdma.testing import hosts
    monkeypatch.delenv("PYRDMA_TEST_HOSTS", raising=False)
    assert hosts.load() == []
    path = tmp_path / "h.json"
    path.write_text('{"bridge": "rdbr0", "hosts": [{"name": "h1", "netdev": "rdh1", "bridge_port": "rdh1b", '
                    '"address": "198.18.0.1", "device": "rxeh1", "gid_index": 1, "mtu": 1500, "port": 1, '
                    '"prefix": 24, "mac": "02:00:c6:12:00:01", "future_field": 3}]}')
    monkeypatch.setenv("PYRDMA_TEST_HOSTS", str(path))
    (h1,) = hosts.load()
    assert h1.env(X=2) == {"PYRDMA_IB_HCA": "rxeh1", "PYRDMA_IB_PORT": "1", "PYRDMA_IB_GID_INDEX": "1",
                           "PYRDMA_TCP_HOST": "198.18.0.1", "PYRDMA_TEST_HOST": "h1", "X": "2"}
    assert h1.perf_args() == ["-d", "rxeh1", "-i", "1", "-x", "1"]
    r = h1.run([sys.executable, "-c", "import os; print(os.environ['PYRDMA_IB_HCA'])"], timeout=60,
               capture_output=True, text=True)
    assert r.stdout.strip() == "rxeh1"
    add, delete = hosts.netem_commands(h1, "loss 5%")
    assert add == [["tc", "qdisc", "replace", "dev", "rdh1", "root", "netem", "loss", "5%"],
                   ["tc", "qdisc", "replace", "dev", "rdh1b", "root", "netem", "loss", "5%"]]
    assert delete[0] == ["tc", "qdisc", "del", "dev", "rdh1", "root"]
    assert len(hosts.netem_commands(h1, "delay 1ms reorder 25%", both=False)[0]) == 1


def test_cli_hosts(monkeypatch):
    calls = []
    monkeypatch.setattr(vm, "run_with_device", lambda *a, **k: calls.append((a, k)) or (0, ""))
    assert vm.main(["--hosts", "3", "--mtu", "9000", "--", "true"]) == 0
    assert calls[-1][1]["hosts"] == 3 and calls[-1][1]["mtu"] == 9000
    assert vm.main(["--", "true"]) == 0 and calls[-1][1]["hosts"] == 0
    for bad in (["--hosts", "5"], ["--hosts", "1"], ["--hosts", "2", "--mtu", "1400"]):
        with pytest.raises(SystemExit):
            vm.main(bad + ["--", "true"])


def test_hosts_always_use_the_vm(monkeypatch):
    monkeypatch.setattr(vm, "host_has_active_rdma_port", lambda *a: True)
    seen = []
    monkeypatch.setattr(vm, "run_in_vm", lambda *a, **k: seen.append(k) or (0, ""))
    monkeypatch.setattr(vm, "run_on_host", lambda *a, **k: (1, "on host"))
    assert vm.run_with_device(["true"], hosts=2, stream=None)[0] == 0 and seen[-1]["hosts"] == 2
    assert vm.run_with_device(["true"], stream=None)[0] == 1          # without hosts: the host's device

def test_vng_command(monkeypatch, tmp_path):
    fake = tmp_path / "vng"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    argv = vm.vng_command("/boot/vmlinuz-x", "/tmp/s/guest.sh", ["/tmp/s", "/out"], memory="2G", cpus=3)
    assert argv[0] == str(fake)
    assert argv[1:] == ["--run", "/boot/vmlinuz-x", "--user", "root", "--memory", "2G", "--cpus", "3",
                        "--disable-kvm", "--append", "tsc=reliable clocksource=tsc",
                        "--rwdir", "/tmp/s", "--rwdir", "/out", "--exec", "bash /tmp/s/guest.sh"]
    assert "--disable-kvm" not in vm.vng_command("/k", "/s.sh", [], kvm=True)
    cached = vm.vng_command("/k", "/s.sh", ["/out"], cached=True)
    opts = [a for a in cached if a.startswith("--qemu-opts=")]     # one argument: its value starts with "-"
    assert len(opts) == 1 and f"mount_tag={vm.CACHED_TAG}" in opts[0] and "path=/," in opts[0], opts
    assert "readonly=on" in opts[0] and cached[-2:] == ["--exec", "bash /s.sh"]
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="virtme-ng"):
        vm.vng_command("/k", "/s.sh", [])


# ---------------------------------------------------------------- run_in_vm against a fake vng

FAKE_VNG = r"""#!/bin/bash
# Stands in for virtme-ng: finds the state dir from "--exec 'bash DIR/guest.sh'", acts per $FAKE_VNG.
for a; do last=$a; done
state=$(dirname "${last#bash }")
echo "$state" > "$FAKE_LOG/state_dir"
echo $$ > "$FAKE_LOG/pid"
case "$FAKE_VNG" in
  noboot) echo "qemu: could not load kernel"; exit 1 ;;
  norxe)  echo booted > "$state/booted"; echo "modprobe rdma_rxe failed" > "$state/vm-error"; exit 0 ;;
  status) echo booted > "$state/booted"; echo "out"; echo 7 > "$state/status"; exit 0 ;;
  died)   echo booted > "$state/booted"; echo "Kernel panic"; exit 0 ;;
  hang)   echo booted > "$state/booted"; sleep 600 ;;
  lockup) echo booted > "$state/booted"
          printf '%s\n' "[ 1.0] rxe ready" "[69.0] watchdog: BUG: soft lockup - CPU#1 stuck for 23s! [python3:399]" \
            "[69.1] Call Trace:" "[69.1]  rxe_requester+0x2cf/0xe40 [rdma_rxe]" > "$state/kernel.log"; sleep 600 ;;
esac
"""


@pytest.fixture
def fake_vng(monkeypatch, tmp_path):
    bindir, log = tmp_path / "bin", tmp_path / "log"
    bindir.mkdir()
    log.mkdir()
    (bindir / "vng").write_text(FAKE_VNG)
    (bindir / "vng").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_LOG", str(log))
    monkeypatch.setattr(vm, "find_rxe_kernel", lambda: "/boot/vmlinuz-fake")

    def run(mode, **kwargs):
        monkeypatch.setenv("FAKE_VNG", mode)
        return vm.run_in_vm(["true"], stream=None, **kwargs)
    run.log = log
    return run


def test_run_in_vm_returns_the_commands_status_not_vngs(fake_vng, tmp_path):
    out = tmp_path / "reports"
    code, output = fake_vng("status", rwdir=str(out))
    assert (code, output) == (7, "out\n")
    assert out.is_dir()                                                   # rwdir created for the caller
    assert not os.path.exists((fake_vng.log / "state_dir").read_text().strip())   # state dir cleaned up


def test_run_in_vm_reports_a_vm_that_did_not_boot(fake_vng):
    code, output = fake_vng("noboot")
    assert code == vm.VM_FAILED
    assert "qemu: could not load kernel" in output and "VM failed: it did not boot (vng exit status 1" in output


def test_run_in_vm_reports_rxe_failure(fake_vng):
    code, output = fake_vng("norxe")
    assert code == vm.VM_FAILED
    assert "VM failed: rxe0 did not come up: modprobe rdma_rxe failed" in output


def test_run_in_vm_reports_a_vm_that_died_under_the_command(fake_vng):
    code, output = fake_vng("died")
    assert code == vm.VM_FAILED and "stopped before the command finished" in output


def test_run_in_vm_kills_the_vm_on_timeout(fake_vng):
    start = time.monotonic()
    code, output = fake_vng("hang", timeout=2)
    assert code == vm.TIMED_OUT and "timed out after 2 s; VM killed" in output
    assert time.monotonic() - start < 20
    pid = int((fake_vng.log / "pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_timeout_shows_what_the_guest_kernel_reported(fake_vng):
    code, output = fake_vng("lockup", timeout=2)
    assert code == vm.TIMED_OUT and "timed out after 2 s; VM killed" in output
    assert "the guest kernel reported:\n[69.0] watchdog: BUG: soft lockup" in output
    assert "rxe_requester" in output and "rxe ready" not in output
    assert "reported" not in fake_vng("hang", timeout=2)[1]      # a quiet kernel log adds nothing


def test_sigterm_to_the_runner_stops_the_vm(fake_vng, tmp_path):
    # what a CI job's timeout does: SIGTERM to the runner alone, not to its process group
    driver = tmp_path / "driver.py"
    driver.write_text("import sys\nfrom pyrdma.testing import vm\n"
                      "vm.find_rxe_kernel = lambda: '/boot/vmlinuz-fake'\n"
                      "sys.exit(vm.main(['--force-vm', '--timeout', '300', '--', 'true']))\n")
    env = dict(os.environ, FAKE_VNG="hang", PYTHONPATH=REPO)
    runner = subprocess.Popen([sys.executable, str(driver)], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    pid = None
    try:
        pid_file = fake_vng.log / "pid"
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text().strip():
            assert time.monotonic() < deadline, "the fake VM never started"
            time.sleep(0.1)
        pid = int(pid_file.read_text())
        os.kill(pid, 0)                        # the VM runs
        runner.send_signal(signal.SIGTERM)
        assert runner.wait(timeout=30) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 20
        while True:                            # and is gone with the runner
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < deadline, f"fake VM {pid} outlived the runner"
            time.sleep(0.1)
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait(timeout=10)
        if pid is not None:                    # the fake VM leads its own session
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_run_in_vm_without_a_kernel(monkeypatch):
    monkeypatch.setattr(vm, "find_rxe_kernel", lambda: None)
    code, output = vm.run_in_vm(["true"], stream=None)
    assert code == vm.VM_FAILED and "linux-image-amd64" in output


def test_run_with_device_uses_the_hosts_device_when_it_has_one(monkeypatch, tmp_path):
    monkeypatch.setattr(vm, "active_rdma_devices", lambda sysfs=None: ["mlx5_0"])
    monkeypatch.setattr(vm, "run_in_vm", lambda *a, **k: pytest.fail("must not boot a VM"))
    code, output = vm.run_with_device(["sh", "-c", "echo $FOO; exit 3"], rwdir=str(tmp_path / "o"),
                                      env={"FOO": "bar"}, stream=None)
    assert code == 3 and "(mlx5_0); running on the host" in output
    assert output.splitlines()[-1] == "bar" and (tmp_path / "o").is_dir()


def test_run_on_host_timeout_and_missing_command():
    assert vm.run_on_host(["sleep", "30"], timeout=0.5, stream=None)[0] == vm.TIMED_OUT
    assert vm.run_on_host(["/nonexistent/cmd"], stream=None)[0] == 127


def test_cli(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(vm, "run_with_device", lambda *a, **k: calls.append((a, k)) or (9, ""))
    assert vm.main(["--rwdir", "/o", "--timeout", "5", "--env", "A=b=c", "--", "python3", "-m", "pytest", "-x"]) == 9
    (cmd, rwdir, timeout, env), kwargs = calls[0]
    assert cmd == ["python3", "-m", "pytest", "-x"] and rwdir == ["/o"] and timeout == 5 and env == {"A": "b=c"}
    assert kwargs["force_vm"] is False
    with pytest.raises(SystemExit):
        vm.main([])
    with pytest.raises(SystemExit):
        vm.main(["--env", "novalue", "--", "true"])


def test_module_entry_point_help():
    for module in ("pyrdma.testing.vm", "pyrdma.testing"):
        r = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=60,
                           cwd=REPO)
        assert r.returncode == 0 and "--rwdir" in r.stdout and "--timeout" in r.stdout


# ---------------------------------------------------------------- the JUnit check in scripts/test.sh

def _junit(path, cases):
    body = "".join(f'<testcase classname="tests.t" name="{n}">{inner}</testcase>' for n, inner in cases)
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{body}</testsuite></testsuites>')
    return str(path)


SKIP = '<skipped type="pytest.skip" message="no device">x</skipped>'
XFAIL = '<skipped type="pytest.xfail" message="known">x</skipped>'
FAIL = '<failure message="boom">x</failure>'
ERROR = '<error message="setup">x</error>'


def test_junit_summary_counts(tmp_path):
    r = junit.summarize(_junit(tmp_path / "a.xml", [("a", ""), ("b", SKIP), ("c", XFAIL), ("d", FAIL), ("e", ERROR)]))
    assert (r.tests, r.passed, r.skipped, r.xfailed, r.failed, r.errors) == (5, 1, 1, 1, 1, 1)
    assert r.skipped_names == ["tests.t::b (no device)"]


@pytest.mark.parametrize("host, device, ok, why", [
    ([("a", "")], [("b", "")], True, ""),
    ([], [("b", "")], True, ""),                                # no host test: pytest exit 5, not a failure
    ([("a", "")], [("b", ""), ("c", XFAIL)], True, ""),         # an xfail is not a skip
    ([("a", SKIP)], [("b", "")], True, ""),                     # host tests may skip (no GPU...)
    ([("a", "")], [("b", SKIP)], False, "device tests were skipped: tests.t::b"),
    ([("a", "")], [], False, "no device test ran"),
    ([("a", FAIL)], [("b", "")], False, "host: 1 failed"),
    ([("a", "")], [("b", ERROR)], False, "device: 0 failed, 1 errors"),
    ([("a", "")], None, False, "device: no readable report"),
])
def test_junit_check(tmp_path, host, device, ok, why):
    import io
    out = io.StringIO()
    host_xml = _junit(tmp_path / "host.xml", host)
    device_xml = _junit(tmp_path / "device.xml", device) if device is not None else str(tmp_path / "missing.xml")
    assert junit.check(host_xml, device_xml, out=out) == (0 if ok else 1), out.getvalue()
    assert why in out.getvalue()


def test_scripts_are_valid_bash():
    for script in ("scripts/test.sh", ".ci/run"):
        subprocess.run(["bash", "-n", os.path.join(REPO, script)], check=True, timeout=30)
    with open(os.path.join(REPO, ".ci/run")) as f:
        assert "scripts/test.sh" in f.read()
    with open(os.path.join(REPO, "scripts/test.sh")) as f:     # so tests/test_multihost.py never skips in CI
        assert re.search(r"-m pyrdma\.testing\.vm --hosts 4 ", f.read())


# ---------------------------------------------------------------- conftest: device tests fail when a device is required

def test_required_device_fails_instead_of_skipping(tmp_path):
    shutil.copy(os.path.join(REPO, "tests", "conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_needs_device.py").write_text(textwrap.dedent("""
        import pytest, conftest
        conftest.SYSFS_INFINIBAND = "/nonexistent/infiniband"     # no device, whatever the host has

        @pytest.mark.device
        def test_marked():
            pass

        def test_fixture(rdma_device_name):
            pass

        def test_host():
            pass
    """))
    env = dict(os.environ)

    def run(require):
        env["PYRDMA_REQUIRE_DEVICE"] = "1" if require else "0"
        xml = tmp_path / f"r{int(require)}.xml"
        subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--rootdir", str(tmp_path),
                        "-c", os.devnull, f"--junitxml={xml}", str(tmp_path)],
                       cwd=tmp_path, env=env, capture_output=True, timeout=120)
        return junit.summarize(str(xml))

    relaxed = run(False)
    assert (relaxed.passed, relaxed.skipped, relaxed.errors) == (1, 2, 0)
    required = run(True)
    assert (required.passed, required.skipped, required.errors) == (1, 0, 2)


# ---------------------------------------------------------------- mp: ranks in spawned processes

def _rank_echo(rank, size, base, scale=1):
    return (rank, size, base + rank * scale)


def _rank_fails_on_one(rank, size):
    if rank == 1:
        raise ValueError("rank one is broken")
    return rank


def _rank_hangs_on_one(rank, size):
    if rank == 1:
        time.sleep(600)
    return rank


def _rank_exits_hard(rank, size):
    os._exit(3)


def test_run_ranks_returns_results_by_rank():
    assert run_ranks(_rank_echo, 3, 10, kwargs={"scale": 2}, timeout=120) == [(0, 3, 10), (1, 3, 12), (2, 3, 14)]


def test_run_ranks_reports_an_exception_with_its_traceback():
    with pytest.raises(AssertionError, match=r"(?s)rank 1 raised ValueError: rank one is broken.*Traceback"):
        run_ranks(_rank_fails_on_one, 2, timeout=120)
    outcome = run_ranks(_rank_fails_on_one, 2, timeout=120, expect_errors=True)
    assert outcome[0] == ("ok", 0) and outcome[1][0] == "error"


def test_run_ranks_kills_a_hung_rank_after_the_timeout():
    start = time.monotonic()
    outcome = run_ranks(_rank_hangs_on_one, 2, timeout=8, expect_errors=True)
    assert outcome == [("ok", 0), ("missing", None)]
    assert time.monotonic() - start < 30
    import multiprocessing
    assert not multiprocessing.active_children()


def test_run_ranks_does_not_wait_the_timeout_for_a_crashed_rank():
    start = time.monotonic()
    with pytest.raises(AssertionError, match="rank 0 gave no result: exited with code 3"):
        run_ranks(_rank_exits_hard, 2, timeout=120)
    assert time.monotonic() - start < 60


def test_free_port_is_bindable():
    import socket
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


# ---------------------------------------------------------------- device: the device is real

@pytest.mark.device
def test_device_port_is_active(rdma_device_name):
    r = subprocess.run(["ibv_devinfo", "-d", rdma_device_name], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "PORT_ACTIVE" in r.stdout, r.stdout


@pytest.mark.device
def test_gid_index_is_usable(rdma_device_name, gid_index):
    port = os.path.join(conftest.SYSFS_INFINIBAND, rdma_device_name, "ports", "1")
    with open(os.path.join(port, "gids", str(gid_index))) as f:
        gid = f.read().strip()
    assert set(gid) - {"0", ":"}, f"GID {gid_index} of {rdma_device_name} is empty"
    with open(os.path.join(port, "link_layer")) as f:
        link_layer = f.read().strip()
    if link_layer == "Ethernet":
        with open(os.path.join(port, "gid_attrs", "types", str(gid_index))) as f:
            assert f.read().strip() == "RoCE v2"
    # the binding and the sysfs fallback agree
    assert gid_index == conftest.sysfs_best_gid_index(rdma_device_name)


def _rank_opens_device(rank, size, name):
    import pyrdma
    with pyrdma.Context(name) as ctx:
        return ctx.query_port(1).state_name


@pytest.mark.device
def test_device_opens_in_two_processes(rdma_device_name):
    assert run_ranks(_rank_opens_device, 2, rdma_device_name, timeout=240) == ["active", "active"]
