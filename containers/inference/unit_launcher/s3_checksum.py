"""The checksum S3 stores with an object, compared with a downloaded copy in one read that also gives its SHA-256.

A fetch of an object above the transfer's multipart threshold is a set of ranged GETs, and a ranged GET
carries no checksum of the whole object for botocore to check (botocore 1.44.18 `httpchecksum.py`
`handle_checksum_body` also skips a composite one, "-N"); an SSE-KMS object's ETag is not its MD5, and a
multipart one's is not any object's MD5. So the fetch reads the copy once, after it lands, against what
S3 stores (HeadObject with ChecksumMode ENABLED; the parts of a multipart object whose checksum is a
composite from GetObjectAttributes), and records its SHA-256 for the manifest check and the compile's key
(hash_record).

What S3 may store (botocore 1.44.18's S3 model, `ChecksumAlgorithm`: CRC32, CRC32C, SHA1, SHA256,
CRC64NVME, SHA512, MD5, XXHASH64, XXHASH3, XXHASH128; `ChecksumType`: COMPOSITE, FULL_OBJECT):
- a single-part object: a checksum of the whole object (PutObject's type "is always FULL_OBJECT");
- a multipart one: FULL_OBJECT (a checksum of the whole object, combined by S3 from its parts') or
  COMPOSITE, the checksum of the parts' checksums with a "-N" suffix ("may not be a direct checksum value
  of the full object. Instead, it's a calculation based on the checksum values of each individual part",
  https://docs.aws.amazon.com/AmazonS3/latest/API/API_Checksum.html). GetObjectAttributes lists each part's
  size and, for an object uploaded with an additional checksum, each part's own checksum (its `Parts`
  documentation, same model). Each part is then compared with its own checksum, which needs no
  assumption on how S3 combines them; only where S3 lists sizes without checksums is the composite
  recomputed as the checksum of the concatenated binary part checksums: moto 5.2.5 does so
  (`s3/models.py` `MultipartChecksumBuilder`), and Quilt compares its own SHA-256 of the parts'
  SHA-256s with S3's value (quiltdata/quilt@03235e90 `lambdas/s3hash/src/t4_lambda_s3hash/__init__.py`
  `hash_parts`); not checked against S3 itself here.
Computed here: CRC32 (zlib, the CRC botocore's `Crc32Checksum` sends), SHA1, SHA256, SHA512 (hashlib);
CRC32C and CRC64NVME only with awscrt (botocore's optional CRT, `crt_checksums.crc32c/crc64nvme(data,
previous)`), which the image's lock does not carry. CRC64NVME is what S3 adds to an object uploaded
without a checksum (API_Checksum.html, ChecksumCRC64NVME), so such objects are reported as having no
usable checksum and rest on their size, as before.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

CHUNK = 8 << 20
# Algorithms in the order one is taken when S3 stores several.
ORDER = ("SHA256", "CRC32", "CRC32C", "CRC64NVME", "SHA1", "SHA512")
# Parts asked per GetObjectAttributes answer: ListParts "returns a maximum of 1,000 uploaded parts" (botocore
# 1.44.18's S3 model, ListParts); GetObjectAttributes, which "combines the functionality of HeadObject and
# ListParts", states no maximum, so its pages are followed (NextPartNumberMarker) whatever it returns.
PAGE_PARTS = 1000


class Hasher(Protocol):
    def update(self, data: bytes, /) -> None: ...

    def digest(self) -> bytes: ...


class _Crc:
    """A CRC of `width` bytes from `function(data, previous)`, big-endian as S3 encodes it (botocore's classes)."""

    def __init__(self, function: Callable[[bytes, int], int], width: int) -> None:
        self._function, self._width, self._value = function, width, 0

    def update(self, data: bytes) -> None:
        self._value = self._function(data, self._value) & ((1 << (8 * self._width)) - 1)

    def digest(self) -> bytes:
        return self._value.to_bytes(self._width, "big")


def _crt() -> Any:
    try:
        from awscrt import checksums  # type: ignore[import-not-found]
    except ImportError:
        return None
    return checksums


def hashers(crt: Any = None) -> dict[str, Callable[[], Hasher]]:
    """The algorithms this process can compute, by S3's name. `crt`: awscrt's `checksums` module, if present."""
    table: dict[str, Callable[[], Hasher]] = {
        "CRC32": lambda: _Crc(zlib.crc32, 4),
        "SHA1": lambda: hashlib.sha1(usedforsecurity=False),
        "SHA256": hashlib.sha256,
        "SHA512": hashlib.sha512,
    }
    for name, function, width in (("CRC32C", "crc32c", 4), ("CRC64NVME", "crc64nvme", 8)):
        if crt is not None and hasattr(crt, function):
            table[name] = functools.partial(_Crc, getattr(crt, function), width)
    return table


HASHERS = hashers(_crt())


class Changed(Exception):
    """The object is not the one listed (another ETag): it was replaced during the fetch."""


@dataclass(frozen=True)
class Plan:
    """What to compare: `algorithm` over each of `sizes` (one size: the whole object) against `expected`
    (one per part), or, with `expected` empty, the checksum of the parts' checksums against `composite`."""

    algorithm: str
    sizes: tuple[int, ...]
    expected: tuple[bytes, ...] = ()
    numbers: tuple[int, ...] = ()
    composite: bytes = b""

    def describe(self) -> str:
        if len(self.sizes) == 1 and not self.numbers:
            return f"{self.algorithm} of the whole object"
        how = "each part's" if self.expected else "the parts' composite"
        return f"{self.algorithm}, {how}, {len(self.sizes)} parts"


@dataclass(frozen=True)
class Digests:
    sha256: str
    md5: str | None
    parts: tuple[bytes, ...]


def _b64(text: str) -> bytes:
    return base64.b64decode(text.split("-", 1)[0])


def _present(checksums: dict[str, Any]) -> list[tuple[str, str]]:
    known = ("CRC32", "CRC32C", "CRC64NVME", "SHA1", "SHA256", "SHA512", "MD5", "XXHASH64", "XXHASH3", "XXHASH128")
    return [(name, checksums[f"Checksum{name}"]) for name in known if checksums.get(f"Checksum{name}")]


def _usable(present: list[tuple[str, str]]) -> tuple[str, str] | str:
    if not present:
        return "S3 stores no checksum of it"
    for name in ORDER:
        for algorithm, text in present:
            if algorithm == name and name in HASHERS:
                return algorithm, text
    names = ", ".join(a for a, _ in present)
    return f"S3 stores only {names}, which this image cannot compute (CRC32C and CRC64NVME need awscrt)"


def plan(client: Any, bucket: str, key: str, head: dict[str, Any], etag: str, size: int) -> Plan | str:
    """What to compare the download with, or why nothing can be (a phrase). `head`: HeadObject's answer with
    ChecksumMode ENABLED; `etag`, `size`: the listing's. Raises Changed, or botocore's errors of a request."""
    usable = _usable(_present(head))
    if isinstance(usable, str):
        return usable
    algorithm, text = usable
    kind = head.get("ChecksumType")
    # A value with S3's "-N" suffix is never compared whole, whatever its type says: a composite taken for a
    # whole-object checksum would refuse every intact download (no S3 answer is known to pair them; it costs
    # nothing to refuse to).
    if "-" not in text and (kind == "FULL_OBJECT" or (kind is None and "-" not in etag.strip('"'))):
        return Plan(algorithm, (size,), (_b64(text),))
    return _parts_plan(client, bucket, key, algorithm, text, kind, etag, size)


def _parts_plan(client: Any, bucket: str, key: str, algorithm: str, text: str, kind: str | None, etag: str,
                size: int) -> Plan | str:
    """A multipart object's plan: each part against its own checksum where S3 lists them, else the composite."""
    from botocore.exceptions import ClientError

    try:
        pages = _attribute_pages(client, bucket, key, etag)
    except ClientError as error:
        code = error.response.get("Error", {}).get("Code", "?")
        return f"a multipart object, whose parts GetObjectAttributes did not give ({code})"
    checksum = pages[0].get("Checksum") or {}
    kind = checksum.get("ChecksumType") or kind
    value = checksum.get(f"Checksum{algorithm}") or text
    if kind == "FULL_OBJECT" and "-" not in value:
        return Plan(algorithm, (size,), (_b64(value),))
    parts = [part for page in pages for part in (page.get("ObjectParts") or {}).get("Parts", [])]
    total = (pages[0].get("ObjectParts") or {}).get("TotalPartsCount")
    sizes = tuple(int(part["Size"]) for part in parts)
    if not parts or sum(sizes) != size or (total is not None and total != len(parts)):
        return (f"a multipart object whose parts S3 listed as {len(parts)} of {total}, {sum(sizes)} bytes in all, "
                f"not its {size}")
    numbers = tuple(int(part["PartNumber"]) for part in parts)
    own = [part.get(f"Checksum{algorithm}") for part in parts]
    if all(own):
        return Plan(algorithm, sizes, tuple(_b64(one) for one in own), numbers)
    if kind == "COMPOSITE" or "-" in value:
        return Plan(algorithm, sizes, (), numbers, _b64(value))
    return f"a multipart object whose {algorithm} S3 gives neither per part nor as a composite"


def _attribute_pages(client: Any, bucket: str, key: str, etag: str) -> list[dict[str, Any]]:
    """GetObjectAttributes' ETag, Checksum and ObjectParts, every page of parts; Changed if another ETag."""
    pages: list[dict[str, Any]] = []
    marker = 0
    while True:
        # The first page without a marker: whether S3 accepts PartNumberMarker=0 is unverified, and a refusal
        # would leave every multipart object unchecked (the ClientError falls back to its size).
        after = {"PartNumberMarker": marker} if marker else {}
        answer = client.get_object_attributes(Bucket=bucket, Key=key, MaxParts=PAGE_PARTS, **after,
                                              ObjectAttributes=["ETag", "Checksum", "ObjectParts"])
        # GetObjectAttributes gives the ETag without its quotes (moto 5.2.5 strips them as S3 does: unverified).
        if answer.get("ETag") and answer["ETag"].strip('"') != etag.strip('"'):
            raise Changed(f"ETag {answer['ETag']} in GetObjectAttributes, {etag} in the listing")
        pages.append(answer)
        parts = answer.get("ObjectParts") or {}
        # At most 10,000 parts (S3's limit), 10 pages: a longer list is cut, and its sizes then do not add up.
        if not parts.get("IsTruncated") or not parts.get("NextPartNumberMarker") or len(pages) >= 20:
            return pages
        marker = int(parts["NextPartNumberMarker"])


def read(path: Path, stored: Plan | None, md5: bool, check: Callable[[], None]) -> Digests:
    """One read of `path`: its SHA-256, its MD5 if `md5`, and `stored.algorithm` over each of its parts.
    `check` runs before each chunk (it raises to stop: a cancelled fetch)."""
    whole = hashlib.sha256()
    digest_md5 = hashlib.md5(usedforsecurity=False) if md5 else None
    parts: list[bytes] = []
    with path.open("rb") as handle:
        for size in stored.sizes if stored else ():
            # A single-part SHA-256 is the file's own: computed once for both.
            one = whole if stored.algorithm == "SHA256" and len(stored.sizes) == 1 else HASHERS[stored.algorithm]()
            targets = [t for t in (one, None if one is whole else whole, digest_md5) if t is not None]
            left = size
            while left > 0 and (chunk := handle.read(min(CHUNK, left))):
                check()
                for target in targets:
                    target.update(chunk)
                left -= len(chunk)
            parts.append(one.digest())
        while chunk := handle.read(CHUNK):  # without a plan, or bytes past the listed size
            check()
            whole.update(chunk)
            if digest_md5 is not None:
                digest_md5.update(chunk)
    return Digests(whole.hexdigest(), digest_md5.hexdigest() if digest_md5 else None, tuple(parts))


def problem(stored: Plan, digests: Digests) -> str | None:
    """How the read copy differs from what S3 stores, naming the part and its bytes, or None."""
    def show(value: bytes) -> str:
        return base64.b64encode(value).decode()

    if stored.expected:
        offset = 0
        for index, (want, got) in enumerate(zip(stored.expected, digests.parts, strict=True)):
            size = stored.sizes[index]
            if want != got:
                where = (f" of part {stored.numbers[index]} (bytes {offset}-{offset + size - 1})"
                         if stored.numbers else "")
                return f"{stored.algorithm} {show(got)}{where} of the download, {show(want)} stored in S3"
            offset += size
        return None
    combined = HASHERS[stored.algorithm]()
    for one in digests.parts:
        combined.update(one)
    if combined.digest() != stored.composite:
        return (f"{stored.algorithm} {show(combined.digest())}-{len(digests.parts)} of the download's parts, "
                f"{show(stored.composite)}-{len(digests.parts)} stored in S3")
    return None
