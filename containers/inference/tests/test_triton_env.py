"""Triton's Python stub embeds the engine's Python only with the right PATH, LD_LIBRARY_PATH and NumPy.

The launcher checks it before the unit forms (unit_launcher.triton_env): a fake engine Python (a
script answering the probe as a real one would) and a fake `ldd` on PATH (answering as glibc's
does for the stub under the environment it is given) stand in for the image; what the real stub
and Python do is run by `make e2e-triton`.
"""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest
from unit_launcher import triton_env


def _script(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _image(tmp_path: Path, *, numpy: str = "1.26.4", version: str = "3.12", stub_links: str = "3.12",
           system_first: bool = False) -> tuple[str, str, dict[str, str]]:
    """(python, backend directory, base environment) of a fake image: the engine Python is a venv's
    python3 over a base whose LIBDIR is <tmp>/conda/lib; a system libpython of the same name exists."""
    libdir = tmp_path / "conda" / "lib"
    (libdir / f"libpython{version}.so.1.0").parent.mkdir(parents=True)
    (libdir / f"libpython{version}.so.1.0").write_text("")
    python = tmp_path / "venv" / "bin" / "python3"
    probe = {"version": version, "patch": f"{version}.11", "libdir": str(libdir), "ldlibrary": f"libpython{version}.so",
             "shared": 1, "numpy": numpy}
    _script(python, f"echo '{json.dumps(probe)}'\n")
    backends = tmp_path / "tritonserver" / "backends"
    _script(backends / "python" / triton_env.STUB, "exit 0\n")
    system = tmp_path / "system-lib"
    # glibc's ldd: the first directory of LD_LIBRARY_PATH holding the library wins (unless system_first).
    fake_bin = tmp_path / "fake-bin"
    _script(fake_bin / "ldd", f"""
found=""
if [ -z "{'x' if system_first else ''}" ]; then
  for d in $(echo "$LD_LIBRARY_PATH" | tr ':' ' '); do
    if [ -e "$d/libpython{stub_links}.so.1.0" ]; then found="$d/libpython{stub_links}.so.1.0"; break; fi
  done
fi
[ -n "$found" ] || found="{system}/libpython{stub_links}.so.1.0"
echo "	libcudart-09529672.so.12.6.77 => /x/nvidia_pytriton.libs/libcudart-09529672.so.12.6.77 (0x0)"
echo "	libpython{stub_links}.so.1.0 => $found (0x00007f07bb800000)"
""")
    base = {"PATH": f"{fake_bin}:{os.environ['PATH']}", "LD_LIBRARY_PATH": f"/opt/aws/neuron/lib:{system}"}
    return str(python), str(backends), base


def test_the_engine_pythons_bin_and_libdir_go_first(tmp_path):
    python, backends, base = _image(tmp_path)
    env = triton_env.stub_environment(python, backends, base)
    assert env["PATH"].split(":")[0] == str(tmp_path / "venv" / "bin")
    assert env["PATH"].endswith(base["PATH"])
    assert env["LD_LIBRARY_PATH"] == f"{tmp_path / 'conda' / 'lib'}:/opt/aws/neuron/lib:{tmp_path / 'system-lib'}"


def test_a_stub_that_would_load_another_libpython_is_refused(tmp_path):
    """The failure seen with the wheel's stub: Debian's libpython3.11 (3.11.2) with pyenv's 3.11.7 standard
    library -> '_thread.RLock' object has no attribute '_recursion_count'."""
    python, backends, base = _image(tmp_path, system_first=True)
    with pytest.raises(triton_env.TritonEnvError, match=r"would load .*system-lib/libpython3\.12\.so\.1\.0, not"):
        triton_env.stub_environment(python, backends, base)


def test_numpy_2_is_refused_naming_the_stubs_pybind11(tmp_path):
    python, backends, base = _image(tmp_path, numpy="2.3.5")
    with pytest.raises(triton_env.TritonEnvError, match=r"imports NumPy 2\.3\.5: .*pybind11 2\.10.*numpy<2"):
        triton_env.stub_environment(python, backends, base)


def test_a_stub_of_another_python_version_is_refused(tmp_path):
    python, backends, base = _image(tmp_path, stub_links="3.11")
    with pytest.raises(triton_env.TritonEnvError, match=r"links libpython3\.11\.so\.1\.0, the engine's Python is 3"):
        triton_env.stub_environment(python, backends, base)


def test_missing_stub_and_misnamed_python_are_refused(tmp_path):
    python, backends, base = _image(tmp_path)
    with pytest.raises(triton_env.TritonEnvError, match="looks up 'python3' on PATH"):
        triton_env.stub_environment(python.replace("python3", "python"), backends, base)
    with pytest.raises(triton_env.TritonEnvError, match="cannot run"):
        triton_env.stub_environment(str(tmp_path / "nowhere" / "python3"), backends, base)
    (Path(backends) / "python" / triton_env.STUB).unlink()
    with pytest.raises(triton_env.TritonEnvError, match="triton_python_backend_stub missing"):
        triton_env.stub_environment(python, backends, base)


def test_the_leader_exits_2_before_forming_when_the_stub_cannot_embed_the_engine_python(tmp_path, h, caplog):
    """A bad environment of the image: exit 2 (the contract's "bad environment or spec", docs/contracts.md),
    not 3, which says the unit did not form (the docs said 3 until the eighteenth session's review)."""
    from unit_launcher import runner
    from unit_launcher.spec import parse_spec

    python, backends, base = _image(tmp_path, numpy="2.1.0")
    doc = h.cpu_spec(2, record_dir=tmp_path)
    doc["engine"].update(frontend="triton", triton_python=python, triton_backend_directory=backends)
    env = {**base, "UNIT_HOST_IP": "127.0.0.1", "UNIT_INSTANCE_ID": "i-0test"}
    assert runner.run("leader", parse_spec(json.dumps(doc)), env) == runner.EXIT_CONFIG == 2
    assert "Triton front end:" in caplog.text


def _hanging_image(tmp_path: Path) -> tuple[str, str, Path]:
    """(python, backend directory, pid file) of an engine Python whose probe never answers."""
    python, backends, _base = _image(tmp_path)
    pid_file = tmp_path / "probe.pid"
    _script(Path(python), f"echo $$ > {pid_file}\nexec sleep 60\n")
    return python, backends, pid_file


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0] == "Z"
    except FileNotFoundError:
        return True


def test_a_stop_ends_the_probe_at_once_and_kills_it(tmp_path):
    """The probe's wait (up to 120 s) ignored the node's stop, and the probe outlived a launcher killed meanwhile."""
    python, backends, pid_file = _hanging_image(tmp_path)
    started = time.monotonic()
    with pytest.raises(triton_env.TritonEnvStopped):
        triton_env.stub_environment(python, backends, dict(os.environ),
                                    stopped=lambda: pid_file.exists() and time.monotonic() - started > 0.3)
    assert time.monotonic() - started < 5
    assert _gone(int(pid_file.read_text()))


def test_a_probe_that_never_answers_is_an_error_naming_it(tmp_path, monkeypatch):
    """It was subprocess.TimeoutExpired, uncaught: the launcher ended with a traceback (exit 1), not EXIT_CONFIG."""
    python, backends, pid_file = _hanging_image(tmp_path)
    monkeypatch.setattr(triton_env, "PROBE_SECONDS", 0.5)
    with pytest.raises(triton_env.TritonEnvError, match=r"did not answer the probe within 0\.5 s"):
        triton_env.stub_environment(python, backends, dict(os.environ))
    assert _gone(int(pid_file.read_text()))
