"""What the fetch's one read of a download costs (unit_launcher.s3_checksum.read), beside the SHA-256 alone.

The fetch reads each download once for the checksum S3 stores and its SHA-256 (recorded, so the manifest
check and the compile's key do not read it again); the baseline, `sha256`, is the manifest check's own work.
Writes `--files` random files of `--mib` MiB, then times each plan over all of them, 4 files at once (the
fetch's pool), from the page cache:

    .venv/bin/python containers/inference/bench_fetch_check.py --files 4 --mib 256
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from unit_launcher import s3_checksum

PART = 8 << 20  # boto3's and the AWS CLI's default multipart part


def plans(size: int) -> dict[str, tuple[s3_checksum.Plan | None, bool]]:
    parts = (PART,) * (size // PART) + ((size % PART,) if size % PART else ())
    return {
        "sha256 (the manifest check's work)": (None, False),
        "CRC32, whole object": (s3_checksum.Plan("CRC32", (size,), (b"",)), False),
        "CRC32 of each 8 MiB part": (s3_checksum.Plan("CRC32", parts, (b"",) * len(parts)), False),
        "SHA256, whole object (the same hash)": (s3_checksum.Plan("SHA256", (size,), (b"",)), False),
        "SHA256 of each 8 MiB part": (s3_checksum.Plan("SHA256", parts, (b"",) * len(parts)), False),
        "CRC32, whole object, and MD5": (s3_checksum.Plan("CRC32", (size,), (b"",)), True),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--mib", type=int, default=256)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        files = [Path(tmp) / f"f{i}" for i in range(args.files)]
        for path in files:
            path.write_bytes(os.urandom(args.mib << 20))
        total = args.files * args.mib
        for name, (plan, md5) in plans(args.mib << 20).items():
            started = time.monotonic()
            with ThreadPoolExecutor(max_workers=4) as pool:
                list(pool.map(lambda path, p=plan, m=md5: s3_checksum.read(path, p, m, lambda: None), files))
            seconds = time.monotonic() - started
            print(f"{name}: {total} MiB in {seconds:.2f} s ({total / seconds:.0f} MiB/s, 4 threads, "
                  f"{os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
