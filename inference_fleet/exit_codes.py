"""Exit statuses of `python -m inference_fleet` (listed in its --help and in the README).

Scripts tell the cases apart: a mistake on the command line (2, argparse's own status), a
fleet file that is refused (3), the output closed early by the reader (141).
"""

import os
import signal
import sys

OK = 0
# `plan --suggest` found no unit size that fits the model (the output says why); an
# unexpected crash also ends with 1, as any Python program does.
NO_FIT = 1
# `simulate`: an invariant was violated in at least one seed (each is printed with its time line).
VIOLATED = 4
USAGE = 2  # argparse exits 2 on a usage error: unknown command or option, bad value
CONFIG = 3  # the fleet file is refused (its path too: input_files.py); every issue is printed with its field path
COMPILE = 5  # `compile` could not render or run its job, or refused to replace other artifacts
VERIFY = 6  # `verify`: at least one check of the acceptance kit failed (its report says which)
EVACUATE = 7  # `evacuate` refused (no router fronts the cell, or none would be left) or could not finish
# The output could not be written (stdout closed with `>&-`, a full disk) or a file the command had to read or write
# failed; the one-line message says which. Not a refused fleet file: the same command may work elsewhere.
IO_ERROR = 8
# The reader closed the pipe (`... | head -1`): the status a shell reports for a process
# ended by SIGPIPE (128 + 13), as `cat` or `grep` would give; nothing is printed.
CLOSED_PIPE = 141
# Ctrl-C (SIGINT): one line on stderr, then the process ends by SIGINT itself, which a shell reports as 130
# (128 + 2), so that a calling script or loop sees the interrupt and stops too.
INTERRUPTED = 130

EPILOG = f"""exit status:
  {OK}    done
  {NO_FIT}    plan --suggest found no unit that fits
  {USAGE}    usage error (unknown command or option, bad option value)
  {CONFIG}    the fleet file (or simulate's scenario file) is refused, or its path names no readable file (no such
       file, a directory, a FIFO, a name too long): each issue is printed
  {VIOLATED}    simulate: an invariant was violated (printed with its first counterexample)
  {COMPILE}    compile: the job could not be rendered or run (the message says what to change)
  {VERIFY}    verify: a check failed on the cell (the table and the report say which and why)
  {EVACUATE}    evacuate: refused or not finished (no router fronts the cell, none would be left, a wait timed out)
  {IO_ERROR}    the output or a file could not be written or read (stdout closed, disk full): the message says which
  {INTERRUPTED}  interrupted (Ctrl-C, SIGINT): stopped before it finished (simulate: no report)
  {CLOSED_PIPE}  the output was closed early (e.g. piped into head); nothing else is printed"""


def end_interrupted() -> None:
    """Ctrl-C reached the command (KeyboardInterrupt): say so in one line instead of Python's traceback, then
    end by SIGINT as Python itself does for an uncaught KeyboardInterrupt since 3.8 (bpo-1054041; the shell's 130),
    so that a calling shell loop stops too."""
    print("interrupted (Ctrl-C): stopped before it finished", file=sys.stderr)
    try:
        if sys.stdout is not None:
            sys.stdout.flush()  # what was printed before the interrupt still reaches the reader
    except (OSError, ValueError):
        pass
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
    raise SystemExit(INTERRUPTED)  # only where the signal did not end the process
