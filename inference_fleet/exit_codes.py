"""Exit statuses of `python -m inference_fleet` (listed in its --help and in the README).

Scripts tell the cases apart: a mistake on the command line (2, argparse's own status), a
fleet file that is refused (3), the output closed early by the reader (141).
"""

OK = 0
# `plan --suggest` found no unit size that fits the model (the output says why); an
# unexpected crash also ends with 1, as any Python program does.
NO_FIT = 1
# `simulate`: an invariant was violated in at least one seed (each is printed with its time line).
VIOLATED = 4
USAGE = 2  # argparse exits 2 on a usage error: unknown command or option, bad value
CONFIG = 3  # the fleet file is refused; every issue is printed with its field path
COMPILE = 5  # `compile` could not render or run its job, or refused to replace other artifacts
VERIFY = 6  # `verify`: at least one check of the acceptance kit failed (its report says which)
EVACUATE = 7  # `evacuate` refused (no router fronts the cell, or none would be left) or could not finish
# The output could not be written (stdout closed with `>&-`, a full disk) or a file the command had to read or write
# failed; the one-line message says which. Not a refused fleet file: the same command may work elsewhere.
IO_ERROR = 8
# The reader closed the pipe (`... | head -1`): the status a shell reports for a process
# ended by SIGPIPE (128 + 13), as `cat` or `grep` would give; nothing is printed.
CLOSED_PIPE = 141

EPILOG = f"""exit status:
  {OK}    done
  {NO_FIT}    plan --suggest found no unit that fits
  {USAGE}    usage error (unknown command or option, bad option value)
  {CONFIG}    the fleet file (or simulate's scenario file) is refused: each issue is printed
  {VIOLATED}    simulate: an invariant was violated (printed with its first counterexample)
  {COMPILE}    compile: the job could not be rendered or run (the message says what to change)
  {VERIFY}    verify: a check failed on the cell (the table and the report say which and why)
  {EVACUATE}    evacuate: refused or not finished (no router fronts the cell, none would be left, a wait timed out)
  {IO_ERROR}    the output or a file could not be written or read (stdout closed, disk full): the message says which
  {CLOSED_PIPE}  the output was closed early (e.g. piped into head); nothing else is printed"""
