"""Refuse to fill a model cache that is not the node's instance store, or has no room for the layout.

The node's setup (cell_constructs/node_setup.sh) mounts the instance-store RAID0 at
/opt/models and writes a marker file at its root. When the mount is missing (a reboot that
did not bring the RAID back, a node set up by hand), /opt/models is a plain directory on the
root volume: the marker is not there, and a fetch would write hundreds of GiB onto the root
volume at its gp3 baseline. The launcher checks both before it downloads and stops with the
cause instead.
"""

from __future__ import annotations

import shutil
from pathlib import Path

GIB = 1 << 30
MIB = 1 << 20


class CacheError(RuntimeError):
    """The model cache is not on the instance-store mount, or lacks room for what must be fetched."""


def require_instance_store(marker: str | Path) -> None:
    """Raise CacheError unless `marker` (written by the node's setup on the cache mount) exists."""
    path = Path(marker)
    if not path.is_file():
        raise CacheError(
            f"model cache not on the instance store: {path} is missing, so {path.parent} is not the mounted "
            "instance-store file system (the node's setup failed or a reboot did not mount it again; "
            "see `journalctl -t node-setup` on the instance). Refusing to fetch onto the root volume."
        )


def require_room(cache_dir: str | Path, needed_bytes: int) -> None:
    """Raise CacheError when the file system of `cache_dir` has less free space than `needed_bytes`."""
    free = shutil.disk_usage(cache_dir).free
    if free < needed_bytes:
        raise CacheError(
            f"model cache {cache_dir} has {_size(free)} free; the layout needs {_size(needed_bytes)} more. "
            "Free the cache (other models' folders under it) or use an instance type with more instance storage."
        )


def _size(count: int) -> str:
    return f"{count / GIB:.1f} GiB" if count >= GIB else f"{count / MIB:.1f} MiB"
