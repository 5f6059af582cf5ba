"""The MPI side of collectives_bench.py (mpirun runs this file with the system's python3):
MPI_Alltoall, MPI_Alltoallv, MPI_Gather, MPI_Scatter, a ping-pong and a stream of MPI_Send/MPI_Recv, timed like
pyrdma's side (pyrdma.perf.collectives.bench_rank).

Runs under mpirun with Debian's python3 and python3-mpi4py (no numpy: bytearrays are the buffers):

    mpirun -np 2 --mca pml ucx -x UCX_TLS=rc_verbs,ud_verbs,self -x UCX_NET_DEVICES=rxe0:1 \\
        -x UCX_UD_VERBS_ETH_DGID_CHECK=n /usr/bin/python3 pyrdma/perf/mpi_collectives.py --pieces 8,4096 --iters 5

Per collective and size (bytes per peer; root 0): one warm-up call (its result checked), then per
iteration a barrier, the call, its time; the slowest rank's time per iteration, median over the
iterations. Rank 0 prints one JSON object: {"rows": [[name, bytes, seconds], ...], "pingpong":
[seconds, ...] (half round trips), "stream": [bytes/s, ...], "library": ...}.
"""
import argparse
import json
import time

from mpi4py import MPI


def buffers(name, piece, rank, n):
    """(send, receive, expected receive) bytearrays of ``name`` as pyrdma's side fills them."""
    if name in ("alltoall", "alltoallv"):
        send = bytearray(b"".join(bytes([(rank * 16 + j) & 0xFF]) * piece for j in range(n)))
        want = bytearray(b"".join(bytes([(i * 16 + rank) & 0xFF]) * piece for i in range(n)))
        return send, bytearray(n * piece), want
    if name == "gather":
        want = bytearray(b"".join(bytes([i + 1]) * piece for i in range(n))) if rank == 0 else None
        return bytearray(bytes([rank + 1]) * piece), bytearray(n * piece) if rank == 0 else None, want
    send = bytearray(b"".join(bytes([i + 1]) * piece for i in range(n))) if rank == 0 else None
    return send, bytearray(piece), bytearray(bytes([rank + 1]) * piece)


def call_of(comm, name, send, recv):
    if name == "alltoall":
        return lambda: comm.Alltoall([send, MPI.BYTE], [recv, MPI.BYTE])
    if name == "alltoallv":                   # the same blocks, given as counts and displacements
        n = comm.Get_size()
        piece = len(send) // n
        layout = ([piece] * n, [i * piece for i in range(n)])
        return lambda: comm.Alltoallv([send, layout, MPI.BYTE], [recv, layout, MPI.BYTE])
    if name == "gather":
        return lambda: comm.Gather([send, MPI.BYTE], [recv, MPI.BYTE] if recv is not None else None, root=0)
    return lambda: comm.Scatter([send, MPI.BYTE] if send is not None else None, [recv, MPI.BYTE], root=0)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--collectives", default="alltoall,alltoallv,gather,scatter")
    p.add_argument("--pieces", required=True, help="comma-separated bytes per peer")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--pingpong", default=None, help="BYTES,ITERS")
    p.add_argument("--stream", default=None, help="BYTES,MESSAGES,REPEATS")
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    rows = []
    for name in [c for c in args.collectives.split(",") if c]:
        for piece in (int(s) for s in args.pieces.split(",")):
            send, recv, want = buffers(name, piece, rank, n)
            call = call_of(comm, name, send, recv)
            call()                                    # warm-up: connections, registration
            if want is not None and recv != want:
                raise SystemExit(f"rank {rank}: MPI {name} of {piece} B gave wrong data")
            times = []
            for _ in range(args.iters):
                comm.Barrier()
                t0 = time.perf_counter()
                call()
                times.append(time.perf_counter() - t0)
            slowest = sorted(max(column) for column in zip(*comm.allgather(times)))
            rows.append([name, piece, slowest[len(slowest) // 2]])
    half_trips = streams = None
    if args.pingpong and n >= 2:
        nbytes, iters = (int(v) for v in args.pingpong.split(","))
        buf = bytearray(nbytes)
        half_trips = []
        comm.Barrier()
        for i in range(iters + 10):                 # 10 warm-up round trips
            if rank == 0:
                t0 = time.perf_counter()
                comm.Send([buf, MPI.BYTE], dest=1)
                comm.Recv([buf, MPI.BYTE], source=1)
                if i >= 10:
                    half_trips.append((time.perf_counter() - t0) / 2)
            elif rank == 1:
                comm.Recv([buf, MPI.BYTE], source=0)
                comm.Send([buf, MPI.BYTE], dest=0)
    if args.stream and n >= 2:
        nbytes, messages, repeats = (int(v) for v in args.stream.split(","))
        buf, ack = bytearray(nbytes), bytearray(1)
        streams = []
        for _ in range(repeats):
            comm.Barrier()
            t0 = time.perf_counter()
            if rank == 0:
                for _ in range(messages):
                    comm.Send([buf, MPI.BYTE], dest=1)
                comm.Recv([ack, MPI.BYTE], source=1)
                streams.append(messages * nbytes / (time.perf_counter() - t0))
            elif rank == 1:
                for _ in range(messages):
                    comm.Recv([buf, MPI.BYTE], source=0)
                comm.Send([ack, MPI.BYTE], dest=0)
    if rank == 0:
        print(json.dumps({"rows": rows, "pingpong": half_trips, "stream": streams,
                          "library": MPI.Get_library_version().splitlines()[0]}), flush=True)


if __name__ == "__main__":
    main()
