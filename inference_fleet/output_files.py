"""Where a report named on the command line (`--report PATH`) is written when PATH is a stream rather than a file.

Shared by `simulate --report` (simulation/cli.py) and `verify --report` (verify/cli.py): the command's own stdout or
stderr is written through a duplicate of its descriptor, a FIFO through the write end opened when the option is
checked, before a run of minutes (a FIFO that no process reads is refused then), and the null device through its own
write end, which discards the report (an operator's `--report /dev/null`). Each command keeps its own rules for a
path that is a file, or another device. This module imports nothing of the package, so both may import it.
"""

from __future__ import annotations

import argparse
import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path

# A report sent to the command's own stdout or stderr is written through that descriptor (a duplicate: the same open
# file, its offset and append mode), after what was printed. Opened anew by its name, a stream that is a file was
# truncated (`--report /dev/stdout >> log` left the report alone: the log's lines and the verdicts were lost).
STANDARD_STREAMS = {"/dev/stdout": 1, "/dev/fd/1": 1, "/proc/self/fd/1": 1,
                    "/dev/stderr": 2, "/dev/fd/2": 2, "/proc/self/fd/2": 2}


@dataclass(frozen=True)
class ReportTarget:
    """Where --report goes: a path, and for a FIFO the write end opened by the check, which the report is written
    through. Kept open from the check to the write: closed in between, it would end a reader such as `cat FIFO`
    (end of file once no writer is left), and the report's own open would then wait for a reader again."""

    path: Path
    fd: int | None = None
    discards: bool = False  # the null device: the report is written to nothing

    def __str__(self) -> str:
        return str(self.path)

    def write(self, text: str) -> None:
        """The report's text at the path, or through the FIFO's write end (OSError when it cannot be written)."""
        if self.fd is None:
            self.path.write_text(text)
            return
        with open(self.fd, "w", closefd=False) as out:
            out.write(text)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)


def stream_target(text: str, example: str) -> ReportTarget | None:
    """The target of `--report text` when it is the command's stdout or stderr (STANDARD_STREAMS), the null device or
    a FIFO read by a process; None for any other path (the caller's rules for a file apply). ArgumentTypeError for a
    FIFO that no process reads (`example` is the file name the message suggests instead); OSError when the path
    cannot be examined."""
    path = Path(text)
    if (stream := STANDARD_STREAMS.get(text)) is not None:
        return ReportTarget(path, os.dup(stream))
    if (null := null_device_write_end(path)) is not None:
        return ReportTarget(path, null, discards=True)
    fd = fifo_write_end(text, path, example)
    return None if fd is None else ReportTarget(path, fd)


def null_device_write_end(path: Path) -> int | None:
    """For the null device, its write end opened now; None for any other path. Written through, not as a file: as a
    file, verify refused it as a device (its report would go to <stem>.verify-report.json beside it, in /dev) and
    simulate asked for write permission on /dev, which only root has. Recognised as the device (the character device
    os.devnull is, by its device number), not by name: a link to it discards too, and another device stays the
    command's to judge."""
    if not path.exists():
        return None
    found = path.stat()
    if not stat.S_ISCHR(found.st_mode) or found.st_rdev != os.stat(os.devnull).st_rdev:
        return None
    return os.open(path, os.O_WRONLY)


def fifo_write_end(text: str, path: Path, example: str) -> int | None:
    """For a FIFO (a named pipe; `/dev/stdout` when piped), its write end opened now, or ArgumentTypeError when no
    process reads it: the report's open after the run would wait for a reader that may never come. O_NONBLOCK
    makes open fail with ENXIO instead of waiting (open(2), fifo(7)); the end is made blocking again so that a
    report larger than the pipe's buffer waits for the reader rather than failing with EAGAIN."""
    if not path.exists() or not stat.S_ISFIFO(path.stat().st_mode):
        return None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as error:
        if error.errno != errno.ENXIO:
            raise
        raise argparse.ArgumentTypeError(f"{text} is a named pipe (FIFO) that no process reads: the report would "
                                         "wait for a reader after the run; start its reader first (e.g. "
                                         f"`cat {text} &`) or give a file, e.g. {example}") from None
    os.set_blocking(fd, True)
    return fd
