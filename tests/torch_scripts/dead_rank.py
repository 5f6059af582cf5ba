"""Started without torchrun (env://, one process per rank): rank 1 joins, then dies; rank 0's
all_reduce must fail within the process group's timeout, naming the dead rank. Prints one JSON line."""
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import pyrdma.torch  # noqa: F401

TIMEOUT = float(sys.argv[1]) if len(sys.argv) > 1 else 15.0
dist.init_process_group("pyrdma", timeout=datetime.timedelta(seconds=TIMEOUT))
t = torch.ones(1000)
dist.all_reduce(t)                     # both ranks alive: works
if dist.get_rank() == 1:
    os._exit(0)                        # dies without a goodbye
start = time.monotonic()
try:
    dist.all_reduce(t)
    outcome = {"error": None}
except Exception as exc:               # noqa: BLE001 -- the message is the result
    outcome = {"error": f"{type(exc).__name__}: {exc}"}
outcome["seconds"] = time.monotonic() - start
outcome["first_sum"] = float(t[0])
print(json.dumps(outcome), flush=True)
os._exit(0)                            # the group is broken; don't wait on it at exit
