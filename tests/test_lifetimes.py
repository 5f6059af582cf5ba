"""Teardown in any order, double close, use after close and interpreter exit never crash."""
import itertools
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import pyrdma as rd

pytestmark = pytest.mark.device


def build_stack():
    ctx = rd.Context()
    pd = rd.ProtectionDomain(ctx)
    ch = rd.CompChannel(ctx)
    cq = rd.CompletionQueue(ctx, 16, channel=ch)
    srq = rd.SharedReceiveQueue(pd, 8)
    mr = rd.MemoryRegion.allocate(pd, 4096, rd.ACCESS_ALL | rd.ACCESS_MW_BIND)
    qp = rd.QueuePairEx(pd, rd.QPT_RC, cq, send_ops=rd.SendOps.RDMA_WRITE | rd.SendOps.BIND_MW)
    qp.connect(qp.endpoint())
    ud = rd.QueuePair(pd, rd.QPT_UD, cq, srq=srq)
    ud.connect()
    ah = rd.AddressHandle(pd, ud.endpoint())
    mw = rd.MemoryWindow(pd, rd.MW_TYPE_2)
    qp.bind_mw(mw, mr, 0, 64, rd.ACCESS_REMOTE_WRITE)    # a bound window
    qp.post_write(mr, 0, 8, mr.addr + 8, mr.rkey)   # a completion left unpolled
    qp.wr_start()                                   # and an ibv_wr_* batch left open
    qp.wr_rdma_write(mr.rkey, mr.addr + 16)
    qp.wr_set_sge(mr, 0, 8)
    return dict(ctx=ctx, pd=pd, ch=ch, cq=cq, srq=srq, mr=mr, qp=qp, ud=ud, ah=ah, mw=mw)


ORDERS = [("ctx",), ("pd", "ctx"), ("cq", "ch", "ctx"), ("ch", "pd", "ctx"), ("mr", "srq", "qp", "ctx"),
          ("qp", "ud", "ah", "srq", "mr", "cq", "ch", "pd", "ctx"),
          ("ah", "mr", "cq", "srq", "pd", "ch", "ud", "qp", "ctx"), ("mw", "qp", "ctx"), ("mr", "mw", "pd", "ctx")]


@pytest.mark.parametrize("order", ORDERS, ids=["-".join(o) for o in ORDERS])
def test_close_orders(order):
    objs = build_stack()
    for name in order:
        objs[name].close()
        objs[name].close()   # idempotent
    for name, obj in objs.items():
        if name in ("ctx",) or "ctx" in order:
            assert obj.closed, name
    # Everything below a closed parent is closed; using it is a clean error.
    with pytest.raises(rd.UsageError, match="closed"):
        objs["qp"].post_write(objs["mr"], 0, 8, 0, 0)
    with pytest.raises(rd.UsageError, match="closed"):
        objs["cq"].poll(1)
    with pytest.raises(rd.UsageError, match="closed"):
        rd.ProtectionDomain(objs["ctx"])


def test_closing_a_cq_closes_its_qps_first():
    objs = build_stack()
    objs["cq"].close()
    assert objs["qp"].closed and objs["ud"].closed and not objs["pd"].closed
    objs["ctx"].close()


def test_garbage_collection_in_any_order():
    for names in itertools.islice(itertools.permutations(["ctx", "pd", "cq", "qp", "mr", "mw"]), 0, 720, 41):
        objs = build_stack()
        for name in names:
            del objs[name]
        objs.clear()


def test_mr_views_outlive_close():
    with rd.Context() as ctx, rd.ProtectionDomain(ctx) as pd:
        mr = rd.MemoryRegion.allocate(pd, 4096)
        view = mr.array(np.uint32)
    view[:] = 7   # memory belongs to the numpy array, not to the closed MR
    assert view.sum() == 7 * 1024


def test_interpreter_exit_with_live_objects(tmp_path):
    script = textwrap.dedent("""
        import numpy as np, pyrdma as rd
        ctx = rd.Context(); pd = rd.ProtectionDomain(ctx); ch = rd.CompChannel(ctx)
        cq = rd.CompletionQueue(ctx, 16, channel=ch); mr = rd.MemoryRegion.allocate(pd, 4096, rd.ACCESS_ALL)
        qp = rd.QueuePair(pd, rd.QPT_RC, cq); qp.connect(qp.endpoint())
        qp.post_write(mr, 0, 8, mr.addr, mr.rkey)
        cycle = [qp]; cycle.append(cycle)          # reachable only through a reference cycle
        holder = {"pd": pd, "self": None}; holder["self"] = holder
        print("alive")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "alive"
