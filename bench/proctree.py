"""CPU time of a whole process tree, read from /proc, for the proxy benchmark.

A proxy under test is a tree, not one process: nginx is a master and its workers; HAProxy
in master-worker mode (`-W`) is a master and a worker; the unit proxy is an agent whose
child is HAProxy's master, whose child is the worker (a grandchild of the agent), or
today's supervisor and its workers. Counting only a process and its direct children
misses the grandchildren, which is where HAProxy does its work under the agent.

What is counted for a root pid (proc(5), /proc/<pid>/stat fields 14-17):
- every live process whose parent chain reaches the root: utime + stime (all its threads);
- plus each of those processes' cutime + cstime: the CPU of descendants that have exited
  and been waited for, so that a worker replaced between two samples is not lost.
The root's own CPU (utime + stime, children excluded) is reported apart: for the unit
proxy it is the agent's own cost.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Stat:
    """The fields of /proc/<pid>/stat the benchmark uses, in seconds."""

    pid: int
    ppid: int
    own: float  # utime + stime
    reaped: float  # cutime + cstime: waited-for children, with their own waited-for children
    started: int  # clock ticks after boot: with the pid, names one process (pids are reused)


@dataclass(frozen=True)
class TreeCpu:
    """One sample of a process tree's CPU time, in seconds since each process started."""

    root: float  # the root's own utime + stime
    tree: float  # the root and its live descendants, with their waited-for children
    pids: tuple[int, ...]


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
    return Stat(pid, int(fields[1]), (utime + stime) / TICKS, (cutime + cstime) / TICKS, int(fields[19]))


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
