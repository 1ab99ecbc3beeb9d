"""Why a path named on the command line cannot be read as an input file (the fleet file, a scenario file).

One stat before the read, shared by config.read_fleet_file and simulation.scenario.load_scenario: a FIFO would block
the read until a writer came and a device might never end, so both are refused at once; and a path the stat cannot
examine (a name too long, a symbolic-link loop, a parent directory the user cannot search) is a refused input (exit 3),
not an input/output failure (exit 8). This module imports nothing of the package, so both may import it.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

_KINDS = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"),
          (stat.S_ISBLK, "a device"))

# The cases of a stat that fails on a path that may exist, each said in the user's terms beside the system's text.
_WHY = {errno.ELOOP: ": a loop of symbolic links", errno.EACCES: ": a directory on it cannot be searched by this user",
        errno.ENAMETOOLONG: ": the path or one of its names is longer than the system allows"}


def not_a_readable_file(path: str | Path) -> str | None:
    """What keeps path from being read as a file (a phrase such as "is a directory", "no such file"), or None when
    it is a regular file, or a symbolic link to one. The caller adds what to give instead."""
    if not os.fspath(path):  # `--config ""`: Path("") is ".", which would be called a directory
        return "is an empty path"
    try:
        mode = Path(path).stat().st_mode
    except ValueError:  # os.stat refuses a NUL in the name before asking the system
        return "the path cannot be examined (it holds a NUL character)"
    except OSError as error:
        return _unexaminable(path, error)
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "is a directory"
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    return f"is {kind}, not a regular file"


def _unexaminable(path: Path, error: OSError) -> str:
    """The stat's failure said as the path's problem (errno names the case; the system's text is kept)."""
    if error.errno == errno.ENOENT:
        return "is a symbolic link to nothing (dangling)" if os.path.islink(path) else "no such file"
    if error.errno == errno.ENOTDIR:
        return "no such file (a part of the path before its last name is not a directory)"
    why = _WHY.get(error.errno, "")
    return f"the path cannot be examined ({error.strerror or error}{why})"
