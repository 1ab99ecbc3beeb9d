"""What the fetch's one read of a download costs (unit_launcher.s3_checksum.read), beside the SHA-256 alone.

The fetch reads each download once for the checksum S3 stores and its SHA-256 (recorded, so the manifest
check and the compile's key do not read it again); the baseline, `sha256`, is the manifest check's own work.
Writes `--files` random files of `--mib` MiB, then times each plan over all of them, 4 files at once (the
fetch's pool), from the page cache, `--rounds` times with the plans interleaved in each round, so that a
machine loaded by other work loads every plan alike; the fastest round of each plan and its ratio to the
SHA-256 alone's fastest are printed:

    .venv/bin/python containers/inference/bench_fetch_check.py --files 4 --mib 256 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from unit_launcher import s3_checksum

PART = 8 << 20  # boto3's multipart_chunksize (the compile job's upload_file) and the AWS CLI's default part
BASELINE = "SHA-256 alone (the manifest check's work)"


def plans(size: int) -> dict[str, tuple[s3_checksum.Plan | None, bool]]:
    parts = (PART,) * (size // PART) + ((size % PART,) if size % PART else ())

    def each(algorithm: str) -> s3_checksum.Plan:
        return s3_checksum.Plan(algorithm, parts, (b"",) * len(parts))

    return {
        BASELINE: (None, False),
        "CRC32 of the whole object + SHA-256 (CRC32 FULL_OBJECT upload)": (
            s3_checksum.Plan("CRC32", (size,), (b"",)), False),
        "CRC32 of each 8 MiB part + SHA-256 (CRC32 COMPOSITE upload)": (each("CRC32"), False),
        "SHA256 whole object = the SHA-256 (single-part SHA256 upload)": (
            s3_checksum.Plan("SHA256", (size,), (b"",)), False),
        "SHA256 of each 8 MiB part + SHA-256 (SHA256 multipart upload)": (each("SHA256"), False),
        "CRC32 of the whole object + SHA-256 + MD5": (s3_checksum.Plan("CRC32", (size,), (b"",)), True),
    }


def _time(files: list[Path], plan: s3_checksum.Plan | None, md5: bool) -> float:
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(lambda path: s3_checksum.read(path, plan, md5, lambda: None), files))
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    table = plans(args.mib << 20)
    best = dict.fromkeys(table, float("inf"))
    with tempfile.TemporaryDirectory() as tmp:
        files = [Path(tmp) / f"f{i}" for i in range(args.files)]
        for path in files:
            path.write_bytes(os.urandom(args.mib << 20))
        for _ in range(args.rounds):
            for name, (plan, md5) in table.items():
                best[name] = min(best[name], _time(files, plan, md5))
    total = args.files * args.mib
    print(f"{total} MiB, 4 threads, {os.cpu_count()} CPUs, fastest of {args.rounds} interleaved rounds:")
    for name, seconds in best.items():
        print(f"  {name}: {seconds:.2f} s ({total / seconds:.0f} MiB/s), {seconds / best[BASELINE]:.2f}x")


if __name__ == "__main__":
    main()
