"""The SHA-256 of files already read, by their stat (`.unit_launcher_verified.json` in the artifacts root).

Two readers of a fetched file need its SHA-256: the node's manifest check (artifact_manifest.check_node)
and the compile job's key (compile_run.checkpoint_entries); the fetch reads a file once when it compares
it with the checksum S3 stores (artifacts, s3_checksum) and records its SHA-256 here, so neither reads
hundreds of GiB a second time. A file whose inode, size, mtime and ctime are those recorded has not been
written since (a fetch replaces files, which gives a new inode and ctime; ctime cannot be set back from
user space), so its recorded SHA-256 is its own. Anything else is hashed again. Standard library only:
artifacts and artifact_manifest both use it.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from pathlib import Path
from typing import Any


class HashRecord:
    NAME = ".unit_launcher_verified.json"

    def __init__(self, root: Path) -> None:
        self.path = root / self.NAME
        try:
            loaded = json.loads(self.path.read_text())
            self.entries: dict[str, list[Any]] = loaded if isinstance(loaded, dict) else {}
        except (OSError, ValueError):
            self.entries = {}
        self._lock = threading.Lock()

    @staticmethod
    def _stamp(stat: os.stat_result, sha256: str) -> list[Any]:
        return [stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, sha256]

    def known(self, rel: str, stat: os.stat_result, sha256: str) -> bool:
        """Whether the file at `rel`, with this stat, was read and had this SHA-256."""
        with self._lock:
            return self.entries.get(rel) == self._stamp(stat, sha256)

    def sha256(self, rel: str, stat: os.stat_result) -> str | None:
        """The SHA-256 recorded for the file at `rel` if it has not been written since, else None."""
        with self._lock:
            entry = self.entries.get(rel)
        if isinstance(entry, list) and len(entry) == 5 and entry[:4] == self._stamp(stat, "")[:4]:
            return entry[4] if isinstance(entry[4], str) else None
        return None

    def record(self, rel: str, stat: os.stat_result, sha256: str) -> None:
        with self._lock:
            self.entries[rel] = self._stamp(stat, sha256)

    def save(self) -> None:
        with contextlib.suppress(OSError):
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.entries, sort_keys=True))
            os.replace(tmp, self.path)
