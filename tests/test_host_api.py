"""The parts of the binding that need no RDMA device: errors, records, validation before C."""
import errno
import os

import numpy as np
import pytest

import pyrdma as rd


def test_error_hierarchy_and_messages():
    err = rd.RDMAError("failed", errno=errno.EBUSY, call="ibv_dealloc_pd", obj="<PD>")
    assert err.errno == errno.EBUSY and err.call == "ibv_dealloc_pd"
    assert "ibv_dealloc_pd on <PD>: failed" in str(err) and "EBUSY" in str(err)
    for cls in (rd.UsageError, rd.CompletionError, rd.RDMATimeoutError, rd.WireFormatError, rd.PeerError):
        assert issubclass(cls, rd.RDMAError)
    assert issubclass(rd.UsageError, ValueError) and issubclass(rd.RDMATimeoutError, TimeoutError)
    c = rd.CompletionError(10, "REM_ACCESS_ERR", wr_id=5, opcode="RDMA_WRITE", qp_num=17)
    assert c.status_name == "REM_ACCESS_ERR" and "wr_id=5" in str(c)
    p = rd.PeerError("rank 3 died", peer=3)
    assert p.peer == 3


@pytest.mark.skipif(os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband"),
                    reason="this host has an RDMA device")
def test_no_device_is_a_clear_error():
    assert rd.get_device_list() == []
    with pytest.raises(rd.RDMAError, match="no RDMA devices found"):
        rd.Context()


def test_wc_dtype_layout():
    assert rd.WC_DTYPE.itemsize == 46
    assert rd.WC_DTYPE.names[:3] == ("wr_id", "status", "opcode")
    assert rd.wc_status_str(rd.WC_REM_ACCESS_ERR) == "remote access error"
    assert rd.wc_status_name(rd.WC_WR_FLUSH_ERR) == "WR_FLUSH_ERR"
    assert rd.wc_opcode_name(rd.WC_RDMA_READ) == "RDMA_READ"


def test_check_wcs_names_the_failed_completion():
    wcs = np.zeros(3, rd.WC_DTYPE)
    rd.check_wcs(wcs)
    wcs[1]["status"] = rd.WC_RETRY_EXC_ERR
    wcs[1]["wr_id"] = 42
    with pytest.raises(rd.CompletionError, match="wr_id=42.*RETRY_EXC_ERR") as info:
        rd.check_wcs(wcs)
    assert info.value.status == rd.WC_RETRY_EXC_ERR


def test_aligned_empty():
    for align in (64, 4096, 1 << 16):
        buf = rd.aligned_empty(1000, align)
        assert buf.ctypes.data % align == 0 and buf.nbytes == 1000 and buf.dtype == np.uint8
    with pytest.raises(rd.UsageError):
        rd.aligned_empty(10, 3000)
    with pytest.raises(rd.UsageError):
        rd.aligned_empty(0)


def test_mtu_conversions():
    assert [rd.mtu_to_bytes(m) for m in range(1, 6)] == [256, 512, 1024, 2048, 4096]
    assert rd.bytes_to_mtu(4096) == rd.MTU_4096
    with pytest.raises(rd.UsageError):
        rd.bytes_to_mtu(1500)


def test_work_request_validation():
    sge = rd.SGE.raw(0x1000, 64, 0x99)
    wr = rd.SendWR(rd.WR_RDMA_WRITE, [sge], wr_id=3, remote_addr=0x2000, rkey=7)
    assert wr.num_sge == 1 and wr.wr_id == 3
    with pytest.raises(rd.UsageError, match="unknown opcode"):
        rd.SendWR(1234)
    with pytest.raises(rd.UsageError, match="needs imm_data"):
        rd.SendWR(rd.WR_RDMA_WRITE_WITH_IMM, [sge])
    with pytest.raises(rd.UsageError, match="use a \\*_WITH_IMM opcode"):
        rd.SendWR(rd.WR_SEND, [sge], imm_data=1)
    with pytest.raises(rd.UsageError, match="32 bits"):
        rd.SendWR(rd.WR_SEND_WITH_IMM, [sge], imm_data=1 << 33)
    with pytest.raises(rd.UsageError, match="8-byte SGE"):
        rd.SendWR(rd.WR_ATOMIC_FETCH_AND_ADD, [sge], remote_addr=8)
    with pytest.raises(rd.UsageError, match="unknown send flags"):
        rd.SendWR(rd.WR_SEND, flags=1 << 20)
    with pytest.raises(rd.UsageError, match="SGE or MemoryRegion"):
        rd.SendWR(rd.WR_SEND, ["not an sge"])
    lst = rd.SendWRList(4, max_sge=1)
    lst.set(0, wr)
    assert len(lst) == 1
    with pytest.raises(rd.UsageError, match="outside"):
        lst.set(4, wr)
    with pytest.raises(rd.UsageError):
        rd.SendWRList(0)


def test_objects_made_without_init_are_closed():
    qp = rd.QueuePair.__new__(rd.QueuePair)
    assert qp.closed
    with pytest.raises(rd.UsageError, match="closed"):
        qp.query()
    cq = rd.CompletionQueue.__new__(rd.CompletionQueue)
    with pytest.raises(rd.UsageError, match="closed"):
        cq.poll(4)
    qp.close()   # harmless


def test_gid_preference_picks_the_reachable_roce_v2_ipv4_gid():
    """A device on a host's interface (rxeh1 on a veth in the multi-host test bed) has an fe80 GID
    before its IPv4 one: the default must be ::ffff:<the interface's address>, RoCE v2."""
    import ipaddress
    from pyrdma._verbs.device import gid_preference

    def entry(index, address, kind="RoCEv2"):
        ip = ipaddress.ip_address(address)
        raw = (ipaddress.IPv6Address(f"::ffff:{ip}") if ip.version == 4 else ip).packed
        return rd.GIDEntry(index, raw, kind)

    def best(*entries):
        return min(entries, key=gid_preference).index

    veth = [entry(0, "fe80::c6ff:fe12:1"), entry(1, "198.18.0.1"), entry(2, "198.18.0.1", "RoCEv1")]
    assert best(*veth) == 1
    assert best(*reversed(veth)) == 1
    assert entry(0, "fe80::1").local_scope and entry(0, "::1").local_scope
    assert entry(0, "127.0.0.1").local_scope and entry(0, "169.254.3.4").local_scope
    assert not entry(0, "198.18.0.1").local_scope and not entry(0, "2001:db8::1").local_scope
    # a loopback IPv4 GID loses to any reachable one, even IPv6; on lo it is the only choice and wins
    assert best(entry(0, "127.0.0.1"), entry(1, "2001:db8::1")) == 1
    assert best(entry(0, "2001:db8::1"), entry(1, "198.18.0.2")) == 1
    assert best(entry(0, "::1"), entry(1, "127.0.0.1"), entry(2, "127.0.0.1", "RoCEv1")) == 1
    assert best(entry(0, "198.18.0.1", "RoCEv1"), entry(1, "fe80::1")) == 1        # v2 before v1
