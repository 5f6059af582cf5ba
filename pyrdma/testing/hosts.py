"""The hosts of the multi-host test bed (``python -m pyrdma.testing.vm --hosts N``), for tests.

    from pyrdma.testing import hosts
    h1, h2 = hosts.load()[:2]            # from the JSON file named by PYRDMA_TEST_HOSTS
    proc = h1.popen([sys.executable, "-m", "pyrdma.perf", "write_bw", ...])   # "on" host h1
    with hosts.netem(h2, "loss 5%"):     # faults on h2's wire (both directions)
        ...

Every host lives in the VM's one network namespace (rxe cannot cross namespaces); what makes it a
host is its Soft-RoCE device, its address and its GID, and the veth between it and the bridge. A
command runs "on" a host when it uses that device, GID and address: ``Host.env()`` sets
PYRDMA_IB_HCA, PYRDMA_IB_PORT, PYRDMA_IB_GID_INDEX and PYRDMA_TCP_HOST (and PYRDMA_TEST_HOST, its name).
The fault helpers change the guest's interfaces: call them only inside the VM (they run ``tc`` and
``ip`` as root).
"""
import contextlib
import json
import os
import subprocess
from dataclasses import dataclass

HOSTS_ENV = "PYRDMA_TEST_HOSTS"
# Each tc/ip call is quick; this bounds a wedged one.
COMMAND_TIMEOUT_S = 30


@dataclass(frozen=True)
class Host:
    """One host of the test bed: ``netdev`` its veth end (address ``address``/``prefix``),
    ``bridge_port`` the other end of that veth (a port of the bridge), ``device`` its rxe device."""
    name: str
    netdev: str
    bridge_port: str
    address: str
    device: str
    gid_index: int
    mtu: int = 1500
    port: int = 1
    prefix: int = 24
    mac: str = ""

    def env(self, **extra):
        """The environment variables that put a pyrdma process on this host, plus ``extra``."""
        env = {"PYRDMA_IB_HCA": self.device, "PYRDMA_IB_PORT": str(self.port),
               "PYRDMA_IB_GID_INDEX": str(self.gid_index), "PYRDMA_TCP_HOST": self.address,
               "PYRDMA_TEST_HOST": self.name}
        env.update({k: str(v) for k, v in extra.items()})
        return env

    def full_env(self, base=None, **extra):
        """``base`` (default os.environ) with this host's variables on top."""
        return dict(os.environ if base is None else base, **self.env(**extra))

    def popen(self, cmd, env=None, **kwargs):
        """Start ``cmd`` "on" this host (its env on top of ``env`` or os.environ); the caller reaps it."""
        return subprocess.Popen(cmd, env=self.full_env(env), **kwargs)

    def run(self, cmd, timeout, env=None, **kwargs):
        """Run ``cmd`` "on" this host to completion within ``timeout`` seconds (subprocess.run)."""
        return subprocess.run(cmd, env=self.full_env(env), timeout=timeout, **kwargs)

    def perf_args(self):
        """pyrdma-perf / perftest arguments that choose this host's device and GID."""
        return ["-d", self.device, "-i", str(self.port), "-x", str(self.gid_index)]


def from_dict(data):
    """The hosts of a description (the JSON object the VM writes)."""
    fields = Host.__dataclass_fields__
    return [Host(**{k: v for k, v in h.items() if k in fields}) for h in data["hosts"]]


def load(path=None):
    """The test bed's hosts, from ``path`` or the file PYRDMA_TEST_HOSTS names; [] when neither is set."""
    path = path or os.environ.get(HOSTS_ENV)
    if not path:
        return []
    with open(path) as fh:
        return from_dict(json.load(fh))


def run_ip(*args, timeout=COMMAND_TIMEOUT_S):
    """Run ``args`` (an ``ip``/``tc`` command line); CalledProcessError carries its stderr."""
    return subprocess.run(list(args), check=True, capture_output=True, text=True, timeout=timeout)


def netem_commands(host, spec, both=True):
    """(add, delete) command lines putting ``tc netem spec`` (e.g. "loss 5%", "delay 1ms reorder 25%")
    on the egress of ``host``'s veth end (what the host sends), and with ``both`` on its bridge port
    too (what it receives)."""
    devs = [host.netdev] + ([host.bridge_port] if both else [])
    add = [["tc", "qdisc", "replace", "dev", d, "root", "netem", *spec.split()] for d in devs]
    delete = [["tc", "qdisc", "del", "dev", d, "root"] for d in devs]
    return add, delete


@contextlib.contextmanager
def netem(host, spec, both=True):
    """``with netem(h, "loss 1%"):`` the wire of ``h`` loses/delays/reorders as ``spec`` says."""
    add, delete = netem_commands(host, spec, both)
    try:
        for cmd in add:
            run_ip(*cmd)
        yield
    finally:
        for cmd in delete:
            subprocess.run(cmd, capture_output=True, timeout=COMMAND_TIMEOUT_S)


def set_link(host, up):
    """Cut (``up=False``) or restore the wire of ``host``: its bridge port goes down or up. The host's
    own interface and rxe device stay up, as when a cable or a switch port fails."""
    run_ip("ip", "link", "set", host.bridge_port, "up" if up else "down")


@contextlib.contextmanager
def link_down(host):
    """``with link_down(h):`` h's wire is cut inside the block, restored after it."""
    set_link(host, False)
    try:
        yield
    finally:
        set_link(host, True)


def set_mtu(host, mtu, bridge_port=False):
    """Set the Ethernet MTU of ``host``'s veth end (and of its bridge port with ``bridge_port``)."""
    run_ip("ip", "link", "set", host.netdev, "mtu", str(mtu))
    if bridge_port:
        run_ip("ip", "link", "set", host.bridge_port, "mtu", str(mtu))


def tx_bytes(netdev):
    """Bytes sent so far by ``netdev`` (sysfs), to check that traffic crossed the wire."""
    with open(f"/sys/class/net/{netdev}/statistics/tx_bytes") as fh:
        return int(fh.read())
