"""pyrdma-perf's collective tests (all_reduce_perf ... sendrecv_perf, pyrdma/perf/collectives.py):
nccl-tests' flags, byte counts, busbw factors and columns on the host; every test over TCP with 2
ranks, and the CLI end to end (--np 2 and mpirun); on the device, every test over RDMA, and a warm
blocking all-to-all counted in Python-level calls."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from mp import run_ranks
from pyrdma.perf import cli, collectives
from pyrdma.testing import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLUMNS = ["size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong"]


def _settings(*argv):
    return collectives.settings(collectives.build_parser().parse_args(list(argv)))


def test_names_and_sizes_as_nccl_tests():
    assert collectives.canonical("alltoall") == "alltoall_perf"
    assert collectives.canonical("all-reduce_perf") == "all_reduce_perf"
    assert collectives.canonical("write_bw") is None          # perftest's tests stay cli's
    assert [collectives.parse_size(s) for s in ("8", "1K", "4M", "1G", "16k")] == [8, 1024, 4 << 20, 1 << 30, 16384]
    st = _settings("all_reduce_perf", "-b", "8", "-e", "128", "-f", "2")
    assert st.sizes == [8, 16, 32, 64, 128] and st.types == ["float"] and st.ops == ["sum"] and st.roots == [-1]
    assert _settings("alltoall_perf", "-b", "1K", "-e", "3K", "-f", "1", "-i", "1K").sizes == [1024, 2048, 3072]
    d = _settings("all_gather_perf")                           # nccl-tests' defaults
    assert (d.sizes, d.args.iters, d.args.warmup_iters, d.args.check) == ([32 << 20], 20, 5, 1)
    assert d.ops == ["none"]
    assert _settings("reduce_perf", "-o", "all").ops == ["sum", "prod", "min", "max", "avg"]
    assert _settings("broadcast_perf", "-r", "-1").roots is None       # every rank in turn
    assert _settings("gather_perf", "-r", "1").roots == [1]
    assert "uint64" in _settings("scatter_perf", "-d", "all").types
    assert "uint64" not in _settings("reduce_scatter_perf", "-d", "all").types
    assert _settings("sendrecv_perf", "-d", "half").types == ["half"]


@pytest.mark.parametrize("argv,message", [
    (["nope_perf"], "unknown collective test"),
    (["all_reduce_perf", "-d", "uint32"], "reductions take"),
    (["all_reduce_perf", "-d", "complex"], "unknown type"),
    (["all_reduce_perf", "-o", "xor"], "unknown op"),
    (["all_reduce_perf", "-b", "2M", "-e", "1M"], "larger than -e"),
    (["all_reduce_perf", "-n", "0"], "-n >= 1"),
    (["gather_perf", "-r", "-2"], "bad root"),
    (["gather_perf", "--np", "0"], "--np"),
])
def test_bad_arguments_are_refused_with_a_message(argv, message):
    with pytest.raises(SystemExit) as info:
        _settings(*argv)
    assert message in str(info.value)


def test_byte_counts_and_bus_bandwidth_factors_are_nccl_tests():
    # (send, receive, count per rank) of a 96-byte float test on 4 ranks: the *GetCollByteCount functions
    expect = {"all_reduce_perf": (24, 24, 24), "all_gather_perf": (6, 24, 6), "reduce_scatter_perf": (24, 6, 6),
              "alltoall_perf": (24, 24, 6), "broadcast_perf": (24, 24, 24), "reduce_perf": (24, 24, 24),
              "gather_perf": (6, 24, 6), "scatter_perf": (24, 6, 6), "sendrecv_perf": (24, 24, 24)}
    for test, want in expect.items():
        assert collectives.counts(collectives.TESTS[test], 96, 4, 4) == want, test
    assert collectives.counts(collectives.TESTS["alltoall_perf"], 100, 4, 4) == (24, 24, 6)   # rounded down
    factors = {t: c.factor(4) for t, c in collectives.TESTS.items()}
    assert factors["all_reduce_perf"] == 1.5
    for t in ("all_gather_perf", "reduce_scatter_perf", "alltoall_perf", "gather_perf", "scatter_perf"):
        assert factors[t] == 0.75, t
    for t in ("broadcast_perf", "reduce_perf", "sendrecv_perf"):
        assert factors[t] == 1.0, t


def test_the_reference_and_the_count_of_wrong_elements():
    f16 = np.dtype(np.float16)
    inputs = [collectives.pattern(r, 10, f16) for r in range(3)]
    want = collectives.reference("avg", inputs, f16, 3)
    assert np.allclose(want, np.mean([x.astype(np.float64) for x in inputs], axis=0))
    got = want.astype(np.float16)
    assert collectives.wrong(got, want, f16) == 0
    got[3] += 1
    assert collectives.wrong(got, want, f16) == 1
    i8 = np.dtype(np.int8)
    prod = collectives.reference("prod", [np.full(4, 2, np.int8)] * 8, i8, 8)    # 256 wraps to 0, as in C
    assert prod.dtype == np.int8 and (prod == 0).all()


def _every_test(rank, size, port, transport, sizes, every_type):
    """run_rank for every test on one communicator (``every_type``: -d all, else float; reductions
    int32 with every op); rank 0's rows, and a deliberately spoiled result counted by the same check."""
    import io
    from pyrdma.collectives import Communicator
    with Communicator(rank, size, f"127.0.0.1:{port}", transport=transport, timeout=60) as comm:
        tables = {}
        for test in collectives.TESTS:
            argv = [test, "-b", str(sizes[0]), "-e", str(sizes[-1]), "-f", str(sizes[1] // sizes[0]), "-n", "2",
                    "-w", "1", "-d", "int32" if "reduce" in test else ("all" if every_type else "float"), "-o", "all" if "reduce" in test else "sum"]
            out = io.StringIO()
            rows, bad = collectives.run_rank(comm, _settings(*argv), out=out)
            tables[test] = (rows, bad, out.getvalue())
        case = collectives.Case(comm, collectives.TESTS["alltoall_perf"], np.dtype(np.int32), "none", 0, 64)
        assert case.check() == 0
        case.y[rank] += 1                                      # one wrong element on each rank
        got, want = case.expected()
        spoiled = collectives.wrong(got, want, case.dtype)
        return tables if rank == 0 else None, spoiled


def _check_tables(tables, size, sizes):
    for test, (rows, bad, text) in tables.items():
        assert bad == 0, (test, text)
        assert rows and all(r["wrong"] == 0 and r["time_us"] > 0 for r in rows), (test, text)
        header = [ln for ln in text.splitlines() if ln.startswith("#       size")]
        assert header and header[0].lstrip("#").split() == COLUMNS, text
        coll = collectives.TESTS[test]
        for r in rows:
            assert r["size"] <= max(sizes) and r["algbw"] == pytest.approx(r["size"] / (r["time_us"] * 1e-6) / 1e9)
            assert r["busbw"] == pytest.approx(r["algbw"] * coll.factor(size))
            assert (r["root"] == -1) != coll.rooted and (r["redop"] == "none") != coll.reduces
        assert "# Out of bounds values : 0 OK" in text


def test_every_collective_test_over_tcp_with_two_ranks():
    sizes = [64, 4096]
    (tables, spoiled0), (_, spoiled1) = run_ranks(_every_test, 2, free_port(), "tcp", sizes, True, timeout=240)
    assert (spoiled0, spoiled1) == (1, 1)
    _check_tables(tables, 2, sizes)
    assert {r["type"] for r in tables["alltoall_perf"][0]} == set(collectives.TYPES)
    assert {r["redop"] for r in tables["all_reduce_perf"][0]} == set(collectives.OPS)


def _bench_calls(rank, size, port):
    """collectives_bench's calls (per_peer_call) of every collective it times: right, and a spoiled
    result found by the same check."""
    from pyrdma.collectives import Communicator
    from pyrdma.perf.collectives_bench import COLLECTIVES
    out = {}
    with Communicator(rank, size, f"127.0.0.1:{port}", transport="tcp", timeout=60) as comm:
        for name in COLLECTIVES:
            call, check = collectives.per_peer_call(comm, name, 300)
            call()
            right = check()
            # spoil the result: the output is the closure's (the all-to-alls' y, gather's root's y, scatter's y)
            cell = [c.cell_contents for c in call.__closure__ if isinstance(c.cell_contents, np.ndarray)]
            target = cell[-1] if name != "gather" or rank == 0 else None
            if target is not None:
                target[:1] ^= 0xFF
            out[name] = (right, target is None or not check())
            comm.barrier()
    return out


def test_the_bench_calls_and_their_checks():
    for got in run_ranks(_bench_calls, 3, free_port(), timeout=120):
        assert set(got) == {"alltoall", "alltoallv", "gather", "scatter"} and all(
            right and spoiled for right, spoiled in got.values()), got


def _table(stdout):
    """The data rows of an nccl-tests-style table, split into columns."""
    return [ln.split() for ln in stdout.splitlines() if ln.strip() and not ln.startswith("#")]


def _cli(argv, env=None, launcher=None, timeout=120):
    env = dict(os.environ, **(env or {}))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    cmd = (launcher or []) + [sys.executable, "-m", "pyrdma.perf", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def test_cli_spawns_local_ranks_over_tcp(tmp_path):
    out = tmp_path / "a2a.json"
    proc = _cli(["alltoall_perf", "-b", "8", "-e", "1K", "-f", "16", "-n", "3", "-w", "1", "--np", "2",
                 "--transport", "tcp", "--json", str(out)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = _table(proc.stdout)
    assert [r[0] for r in rows] == ["8", "128"] and all(len(r) == len(COLUMNS) for r in rows), proc.stdout
    assert [r[1] for r in rows] == ["1", "16"] and all(r[2:5] == ["float", "none", "-1"] for r in rows)
    assert all(r[-1] == "0" for r in rows)
    assert proc.stdout.count("#  Rank ") == 2 and "transport tcp" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["ranks"] == 2 and doc["wrong"] == 0 and [r["size"] for r in doc["rows"]] == [8, 128]


def test_cli_rank_failure_is_an_exit_status_not_a_hang():
    proc = _cli(["sendrecv_perf", "-b", "8", "-e", "8", "-n", "1", "--np", "1", "--transport", "tcp"], timeout=60)
    assert proc.returncode != 0 and "at least 2 ranks" in proc.stderr


def test_cli_under_mpirun():
    from test_collectives_bootstrap import _mpi4py_path
    mpirun = shutil.which("mpirun")
    path = _mpi4py_path() if mpirun else None
    if path is None:
        pytest.skip("mpirun or mpi4py not available")
    proc = _cli(["gather_perf", "-b", "24", "-e", "24", "-n", "2", "-r", "2", "--transport", "tcp"],
                env={"PYTHONPATH": path}, launcher=[mpirun, "--allow-run-as-root", "--oversubscribe", "-n", "3"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = _table(proc.stdout)
    assert len(rows) == 1 and rows[0][:5] == ["24", "2", "float", "none", "2"] and rows[0][-1] == "0", proc.stdout
    assert proc.stdout.count("#  Rank ") == 3


def test_perftest_names_still_go_to_perftests_cli():
    with pytest.raises(SystemExit) as info:
        cli.main(["ib_foo_bw"])
    assert "unknown test" in str(info.value)


# ---- device ------------------------------------------------------------------------------------

@pytest.mark.device
def test_every_collective_test_over_rdma_with_two_ranks():
    sizes = [8, 4096, 1 << 20]
    (tables, spoiled0), (_, spoiled1) = run_ranks(_every_test, 2, free_port(), "rdma", sizes, False, timeout=300)
    assert (spoiled0, spoiled1) == (1, 1)
    _check_tables(tables, 2, sizes)
    for rows, _, text in tables.values():
        assert "device" in text and "(rdma)" in text



def test_the_bench_takes_each_ratio_within_its_round_and_gives_verdicts():
    import argparse
    from pyrdma.perf import collectives_bench as cb
    plans = {2: dict(collectives=["alltoall"], pieces=[8, 1024], iters=3)}

    def rnd(ours_8, mpi_8, lat, anchor_lat, bw, anchor_bw, calls):
        return dict(ours={2: {("alltoall", 8): ours_8, ("alltoall", 1024): 2e-3}},
                    mpi={2: dict(rows=[["alltoall", 8, mpi_8], ["alltoall", 1024, 4e-3]], pingpong=[lat * 2] * 3,
                                 stream=[bw / 2] * 3)},
                    extras={2: dict(outside={("alltoall", 8): (ours_8, ours_8 / 2)}, pingpong=[lat] * 5,
                                    stream=[bw] * 3, python_calls={"8": calls, "1024": calls})},
                    ib_write_lat_us=anchor_lat, ib_write_bw_gbps=anchor_bw / 1e9)
    # the VM drifts: round 2 is twice as slow on both sides, and its ratios are the same as round 1's
    rounds = [rnd(1e-4, 2e-4, 10e-6, 4.0, 1e9, 1e9, 1), rnd(2e-4, 4e-4, 20e-6, 8.0, 0.5e9, 0.5e9, 1)]
    table = cb.summarize(rounds, plans)
    row8 = next(r for r in table if r["bytes_per_peer"] == 8)
    assert row8["vs_mpi"] == pytest.approx(0.5) and row8["vs_mpi_range"] == pytest.approx([0.5, 0.5])
    assert row8["outside_engine_us"] == pytest.approx(75.0)
    p2p = cb.p2p_summary(rounds)
    assert p2p["pingpong_vs_ib_write_lat"] == pytest.approx(2.5) and p2p["stream_vs_ib_write_bw"] == pytest.approx(1.0)
    args = argparse.Namespace(pieces="8,1024", pingpong_bytes=8, stream_bytes=8 << 20, transport="rdma")
    named = {name: v for name, v, _ in cb.targets(table, p2p, rounds, args)}
    assert [v for n, v in named.items() if n.startswith("alltoall")] == ["MET"]
    assert [v for n, v in named.items() if "Python-level" in n] == ["MET"]
    assert [v for n, v in named.items() if "ping-pong" in n] == ["MISSED"]      # 2.5x > 2.0x
    assert [v for n, v in named.items() if "stream" in n] == ["MET"]
    assert not [n for n in named if "ib_write_bw (bytes sent" in n]        # no 256 KiB row: no such target
    # 256 KiB per peer in 2.5 ms = 0.105 GB/s: against ib_write_bw 0.1 GB/s (round 1), 0.2 (round 2)
    bw_plans = {2: dict(collectives=["alltoall"], pieces=[262144], iters=3)}
    for rd, anchor in zip(rounds, (0.1, 0.2)):
        rd["ours"][2][("alltoall", 262144)], rd["ib_write_bw_gbps"] = 2.5e-3, anchor
        rd["mpi"][2]["rows"].append(["alltoall", 262144, 3e-3])
    got = {n: (v, d) for n, v, d in cb.targets(cb.summarize(rounds, bw_plans), p2p, rounds, args)
           if "ib_write_bw (bytes sent" in n}
    (verdict, detail), = got.values()
    assert verdict == "MISSED" and detail.startswith("0.786 (rounds 0.524-1.049")   # median of 1.049 and 0.524
    rounds[1]["ib_write_bw_gbps"] = 0.1
    assert [v for n, v, _ in cb.targets(cb.summarize(rounds, bw_plans), p2p, rounds, args)
            if "ib_write_bw (bytes sent" in n] == ["MET"]
    rounds[1]["ours"][2][("alltoall", 1024)] = 9e-3                           # 1.5x MPI's in one round
    rounds[0]["ours"][2][("alltoall", 1024)] = 9e-3
    rounds[0]["extras"][2]["python_calls"] = {"8": 39, "1024": 39}         # one round's count is enough
    named = {name: v for name, v, _ in cb.targets(cb.summarize(rounds, plans), p2p, rounds, args)}
    assert [v for n, v in named.items() if n.startswith("alltoall")] == ["MISSED"]
    assert [v for n, v in named.items() if "Python-level" in n] == ["MISSED"]
