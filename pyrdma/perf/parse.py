"""Parse what perftest (and pyrdma-perf, which prints the same) writes to stdout.

``parse_output(text)`` returns a ``ParsedRun``: the test banner ("RDMA_Write BW Test"), the
key/value settings block (" Mtu             : 1024[B]"), and the result rows under each column
header, as ``BWReport`` / ``LatReport`` / ``LatDurationReport``. Our own output adds a
" pyrdma mode : loop" line before each table; rows are tagged with the mode in force.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from pyrdma.perf.stats import BWReport, LatDurationReport, LatReport

_NUM = r"[-+]?(?:(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|nan|inf)"   # -nan: perftest whose clock failed
_ROW = re.compile(rf"^\s*(\d+)\s+(\d+)((?:\s+(?:{_NUM}))+)\s*$")
_SETTING = re.compile(r"^\s?([A-Za-z][A-Za-z0-9 .*\-]*?)\s*:\s*(.*?)\s*$")
_MODE = re.compile(r"^\s*pyrdma mode\s*:\s*(\w+)")


@dataclass
class ParsedRun:
    title: str = ""                      # e.g. "RDMA_Write BW Test"
    settings: dict = field(default_factory=dict)
    kind: str = ""                        # "bw", "lat", "lat_duration" (the last header seen)
    gbits: bool = False
    rows: list = field(default_factory=list)     # BWReport | LatReport | LatDurationReport
    modes: list = field(default_factory=list)    # parallel to rows: mode tag or None
    local: dict = field(default_factory=dict)    # "local address" line fields
    remote: dict = field(default_factory=dict)

    def rows_for(self, mode=None):
        return [r for r, m in zip(self.rows, self.modes) if m == mode]

    def by_size(self, mode=None):
        return {r.size: r for r in self.rows_for(mode)}


def _addr_fields(line):
    out = {}
    for key, val in re.findall(r"(LID|QPN|PSN|RKey|VAddr|OUT)\s+(0x[0-9a-fA-F]+|\d+)", line):
        out[key.lower()] = int(val, 0)
    return out


def parse_output(text):
    run = ParsedRun()
    mode = None
    in_table = False
    for raw in text.splitlines():
        line = raw.rstrip("\n")
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith("#bytes"):
            in_table = True
            if "BW peak" in stripped:
                run.kind = "bw"
                run.gbits = "Gb/sec" in stripped
            elif "t_min" in stripped:
                run.kind = "lat"
            elif "tps" in stripped:
                run.kind = "lat_duration"
            continue
        if set(stripped) == {"-"}:
            in_table = False
            continue
        m = _MODE.match(line)
        if m:
            mode = m.group(1)
            continue
        if stripped.endswith("Test") and not run.title:
            run.title = stripped
            continue
        if stripped.startswith("local address"):
            run.local = _addr_fields(stripped)
            continue
        if stripped.startswith("remote address"):
            run.remote = _addr_fields(stripped)
            continue
        if in_table:
            m = _ROW.match(line)
            if m:
                nums = [float(x) for x in m.group(3).split()]
                size, iters = int(m.group(1)), int(m.group(2))
                row = None
                if run.kind == "bw" and len(nums) >= 3:
                    row = BWReport(size, iters, nums[0], nums[1], nums[2], run.gbits)
                elif run.kind == "lat" and len(nums) >= 7:
                    row = LatReport(size, iters, *nums[:7])
                elif run.kind == "lat_duration" and len(nums) >= 2:
                    row = LatDurationReport(size, iters, nums[0], nums[1])
                if row is not None:
                    run.rows.append(row)
                    run.modes.append(mode)
                    continue
        # settings: " Dual-port       : OFF\t\tDevice         : rxe0" holds two pairs
        for part in re.split(r"\t+", line):
            sm = _SETTING.match(part)
            if sm and not in_table:
                run.settings[sm.group(1).strip()] = sm.group(2).strip()
    return run
