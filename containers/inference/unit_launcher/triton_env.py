"""The environment Triton's Python stub needs to embed the engine's Python: checked before the unit forms.

Triton's Python backend runs each model in a stub process (`triton_python_backend_stub`) that
embeds CPython through pybind11 (python_backend r24.10 `src/pb_stub.cc:2157`,
`py::scoped_interpreter`). The Triton distribution this image installs (the `nvidia-pytriton`
0.7.0 wheel: Triton 2.51.0, python_backend r24.10; one stub per Python minor version, built by
PyTriton `scripts/build_python_stubs.sh` with pyenv) links the stub to `libpython3.X.so.1.0` by
name, with no path to any Python: three things decide which interpreter and library it runs,
all found by trying here (docs/runtime.md "Triton front end"):

1. the standard library: the embedded interpreter's program name is `python3`, looked up on PATH,
   and its prefix is that Python's (a venv's `pyvenv.cfg` is honoured);
2. the interpreter itself: the first `libpython3.X.so.1.0` the dynamic loader finds. A system
   copy of another patch release before the engine Python's own (Debian's 3.11.2 beside pyenv's
   3.11.7 here; Ubuntu 24.04's 3.12.3 beside the Neuron DLC's conda 3.12.11, whose
   LD_LIBRARY_PATH puts /lib/x86_64-linux-gnu before /opt/conda/lib) makes the interpreter
   older than its standard library: `AttributeError: '_thread.RLock' object has no attribute
   '_recursion_count'` in multiprocessing/resource_tracker.py (3.11.7's file calls it, 3.11.2's
   C library does not have it). So the engine Python's LIBDIR goes first on LD_LIBRARY_PATH;
3. NumPy: the stub is built with pybind11 v2.10.0 (python_backend r24.10 `CMakeLists.txt:89-93`;
   NumPy 2 support came with pybind11 2.12), and with NumPy 2 every BYTES tensor it builds
   arrives corrupted (`unpack_from requires a buffer of at least 33686022 bytes`). The engine
   Python must import NumPy 1.x (the image's stub Python is a venv over the engine's with NumPy
   1.26.4 first; containers/inference/Dockerfile).

`stub_environment` checks all three with the engine's own Python and `ldd`, and returns the PATH
and LD_LIBRARY_PATH to start tritonserver with; anything wrong is a TritonEnvError naming it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from unit_launcher.plan import PlanError

STUB = "triton_python_backend_stub"
# Longest the probe of the engine's Python may take (a cold start of a big environment from a slow disk).
PROBE_SECONDS = 120.0
# How often the probe's wait looks whether the node is stopping.
PROBE_POLL_SECONDS = 0.05
# Longest the pipes of a killed probe are read for what it wrote last.
PROBE_DRAIN_SECONDS = 1.0
_PROBE = (
    "import json, sys, sysconfig\n"
    "try:\n    import numpy; np = numpy.__version__\nexcept Exception as e:\n    np = 'none: ' + repr(e)\n"
    "print(json.dumps({'version': '%d.%d' % sys.version_info[:2], 'patch': sys.version.split()[0],"
    " 'libdir': sysconfig.get_config_var('LIBDIR'), 'ldlibrary': sysconfig.get_config_var('LDLIBRARY'),"
    " 'shared': sysconfig.get_config_var('Py_ENABLE_SHARED'), 'numpy': np}))\n"
)


class TritonEnvError(PlanError):
    """Triton's Python stub could not run the engine's Python; the message says what to fix."""


class TritonEnvStopped(Exception):
    """The node was told to stop during the check (its probe ended): not the image's fault."""


def _never() -> bool:
    return False


def _probe(python: str, stopped: Callable[[], bool] = _never) -> dict[str, str]:
    """The engine's Python's facts. A stop ends the probe at once and kills its process group: waited out
    (up to PROBE_SECONDS), a SIGTERM came only after it, and a launcher killed meanwhile left it running."""
    try:
        # Its own process group, so that a kill reaches whatever the probe started (a `python3` that is a
        # wrapper script holds the pipes in its child): killing the probe alone left that child running and
        # the drain of the pipes waited for it (a cold review).
        process = subprocess.Popen([python, "-c", _PROBE], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   start_new_session=True)
    except (FileNotFoundError, PermissionError) as error:
        raise TritonEnvError(f"engine.triton_python {python!r} cannot run: {error}") from None
    with process:
        deadline = time.monotonic() + PROBE_SECONDS
        while True:
            try:
                stdout, stderr = process.communicate(timeout=PROBE_POLL_SECONDS)
                break
            except subprocess.TimeoutExpired:
                if stopped() or time.monotonic() >= deadline:
                    _kill(process)
                    if stopped():
                        raise TritonEnvStopped(f"stopped while probing {python}") from None
                    raise TritonEnvError(f"engine.triton_python {python!r} did not answer the probe within "
                                         f"{PROBE_SECONDS:g} s") from None
    # The probe may have ended by the launcher's own stop (a signal to a whole process group reaches both):
    # its status then says nothing about the image (a cold review: exit 2 for a stopped leader).
    if stopped():
        raise TritonEnvStopped(f"stopped while probing {python} (the probe exited {process.returncode})")
    if process.returncode != 0:
        raise TritonEnvError(f"engine.triton_python {python!r} failed: {stderr.strip()[-500:]}")
    return dict(json.loads(stdout.strip().splitlines()[-1]))


def _kill(process: subprocess.Popen[str]) -> None:
    """Kill the probe's process group and drain its pipes for at most PROBE_DRAIN_SECONDS (a descendant that
    left the group may hold them open: the Popen's exit closes them and waits for the probe itself)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    process.kill()  # the probe itself, whatever became of its group (a no-op once it ended)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.communicate(timeout=PROBE_DRAIN_SECONDS)


def _prepend(first: str, rest: str | None) -> str:
    return first if not rest else f"{first}:{rest}"


def linked_libpython(stub: Path, env: Mapping[str, str]) -> tuple[str, str] | None:
    """(soname, resolved path) of the libpython the stub loads under `env`, from `ldd`."""
    done = subprocess.run(["ldd", str(stub)], capture_output=True, text=True, timeout=60, env=dict(env),
                          check=False)
    for line in done.stdout.splitlines():
        match = re.match(r"\s*(libpython3\.\d+\.so\.1\.0)\s+=>\s+(\S+)", line)
        if match:
            return match.group(1), match.group(2)
    return None


def stub_environment(python: str, backend_directory: str, base: Mapping[str, str],
                     stopped: Callable[[], bool] = _never) -> dict[str, str]:
    """PATH and LD_LIBRARY_PATH for tritonserver so that its Python stub embeds `python`, checked;
    TritonEnvStopped when `stopped()` says the node is stopping during the probe."""
    if Path(python).name != "python3":
        raise TritonEnvError(
            f"engine.triton_python {python!r}: the stub looks up 'python3' on PATH; name the python3 of the "
            "engine's environment (e.g. /opt/triton/python/bin/python3)")
    stub = Path(backend_directory) / "python" / STUB
    if not stub.is_file():
        raise TritonEnvError(f"{stub} missing: the image installs the stub of its Python's version there "
                             "(containers/inference/Dockerfile)")
    info = _probe(python, stopped)
    if info.get("shared") != 1 and not str(info.get("ldlibrary", "")).endswith(".so"):
        raise TritonEnvError(f"{python} (Python {info['patch']}) has no shared libpython: the stub cannot embed it")
    if not str(info["numpy"]).startswith("1."):
        raise TritonEnvError(
            f"{python} imports NumPy {info['numpy']}: Triton 2.51's Python stub (pybind11 2.10) needs NumPy 1.x "
            "(with NumPy 2 its BYTES tensors arrive corrupted); install numpy<2 in the stub's environment")
    env = {
        "PATH": _prepend(str(Path(python).parent), base.get("PATH")),
        "LD_LIBRARY_PATH": _prepend(str(info["libdir"]), base.get("LD_LIBRARY_PATH")),
    }
    linked = linked_libpython(stub, {**base, **env})
    want = f"libpython{info['version']}.so.1.0"
    if linked is None or linked[0] != want:
        raise TritonEnvError(
            f"{stub} links {linked[0] if linked else 'no libpython'}, the engine's Python is {info['version']} "
            f"({python}): install the stub built for Python {info['version']}")
    if os.path.realpath(Path(linked[1]).parent) != os.path.realpath(info["libdir"]):
        raise TritonEnvError(
            f"{stub} would load {linked[1]}, not {python}'s own library in {info['libdir']}: the interpreter "
            "would not match its standard library")
    return env
