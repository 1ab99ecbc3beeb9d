"""CPU time of a whole process tree, read from /proc, for the proxy benchmark.

A proxy under test is a tree, not one process: nginx is a master and its workers; HAProxy
in master-worker mode (`-W`) is a master and a worker; the unit proxy is an agent whose
child is HAProxy's master, whose child is the worker (a grandchild of the agent), or
today's supervisor and its workers. Counting only a process and its direct children
misses the grandchildren, which is where HAProxy does its work under the agent.

What is counted for a root pid (proc(5), /proc/<pid>/stat fields 14-17):
- every live process whose parent chain reaches the root: its CPU time, all its threads;
- plus each of those processes' cutime + cstime: the CPU of descendants that have exited
  and been waited for, so that a worker replaced between two samples is not lost.
The root's own CPU (children excluded) is reported apart: for the unit proxy it is the
agent's own cost.

A live process's CPU time is read from its process CPU-time clock (clock_getcpuclockid(3),
clock_gettime(2)), in nanoseconds: the thread group's sum_exec_runtime, exited threads
included. utime + stime in /proc/<pid>/stat is the same quantity (the kernel scales the two
to sum to it, cputime_adjust) but in clock ticks, each truncated: 10 ms steps, and a tree
that used under a tick or two between two samples read 0 (a --quick point on a loaded
machine did: tests/test_proxy_bench.py). /proc/<pid>/schedstat is no substitute: it is the
main thread only, and an exited thread's time is in no /proc/<pid>/task entry. Waited-for
children (cutime + cstime) exist in ticks only. utime + stime stays the fallback when the
clock cannot be read (the process exited between the two reads).
"""

from __future__ import annotations

import ctypes
import os
import time
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
TICKS = os.sysconf("SC_CLK_TCK")
_LIBC = ctypes.CDLL(None)  # the C library Python runs on: clock_getcpuclockid(3)


@dataclass(frozen=True)
class Stat:
    """The fields of /proc/<pid>/stat the benchmark uses, in seconds."""

    pid: int
    ppid: int
    own: float  # all its threads' CPU (the process CPU-time clock; utime + stime as a fallback)
    reaped: float  # cutime + cstime: waited-for children, with their own waited-for children
    started: int  # clock ticks after boot: with the pid, names one process (pids are reused)


@dataclass(frozen=True)
class TreeCpu:
    """One sample of a process tree's CPU time, in seconds since each process started."""

    root: float  # the root's own CPU (its threads, not its children)
    tree: float  # the root and its live descendants, with their waited-for children
    pids: tuple[int, ...]


def process_cpu(pid: int) -> float | None:
    """Seconds of CPU the process `pid` has used, all its threads (live and exited), to the
    nanosecond; None when it cannot be read (the process is gone)."""
    clock = ctypes.c_int()
    if _LIBC.clock_getcpuclockid(pid, ctypes.byref(clock)) != 0:  # returns an errno, sets none
        return None
    try:
        return time.clock_gettime_ns(clock.value) / 1e9
    except OSError:
        return None


def read_stat(pid: int, proc: Path = PROC) -> Stat | None:
    """The stat line of one process, or None when it is gone."""
    try:
        text = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces or ")": split after the last ")".
    fields = text.rsplit(")", 1)[1].split()
    # fields[0] is field 3 (state): ppid is field 4, utime..cstime fields 14-17, starttime field 22.
    utime, stime, cutime, cstime = (int(v) for v in fields[11:15])
    # The clock names a live process of this machine: not one of another /proc tree.
    own = process_cpu(pid) if proc == PROC else None
    own = (utime + stime) / TICKS if own is None else own
    return Stat(pid, int(fields[1]), own, (cutime + cstime) / TICKS, int(fields[19]))


def all_stats(proc: Path = PROC) -> dict[int, Stat]:
    """Every process's stat, by pid (processes that exit while being read are skipped)."""
    stats = {}
    for entry in proc.iterdir():
        if entry.name.isdigit():
            stat = read_stat(int(entry.name), proc)
            if stat is not None:
                stats[stat.pid] = stat
    return stats


def tree(root: int, stats: dict[int, Stat]) -> list[int]:
    """The root and its live descendants at any depth, root first."""
    children: dict[int, list[int]] = {}
    for stat in stats.values():
        children.setdefault(stat.ppid, []).append(stat.pid)
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in stats and pid not in found:
            found.append(pid)
            todo.extend(children.get(pid, ()))
    return found


def sample(root: int, proc: Path = PROC) -> TreeCpu:
    """CPU seconds of the tree under `root` now (zeros when the root is gone)."""
    stats = all_stats(proc)
    pids = tree(root, stats)
    total = sum(stats[p].own + stats[p].reaped for p in pids)
    return TreeCpu(root=stats[root].own if root in stats else 0.0, tree=total, pids=tuple(pids))
