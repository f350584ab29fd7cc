"""Fingerprints: SHA-256 over the parts of a request that make it "the same request".

Parts are length-prefixed before hashing, so that ("ab", "c") and ("a", "bc") never collide.
"""

from __future__ import annotations

import hashlib
import struct

#: Bytes in a fingerprint (SHA-256).
FINGERPRINT_SIZE = 32


#: A part's length as it prefixes the part: 8 bytes, big-endian.
length = struct.Struct(">Q").pack


def fingerprint(*parts: bytes | str) -> bytes:
    """SHA-256 of ``parts``, each prefixed with its :data:`length`; ``str`` parts as UTF-8."""
    chunks: list[bytes] = []
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        chunks.append(length(len(data)))
        chunks.append(data)
    # One update of the joined parts: a hash call per part cost more than the copy.
    return hashlib.sha256(b"".join(chunks)).digest()


def fingerprint_of(data: bytes) -> bytes:
    """``fingerprint(data)`` for one part of bytes, without the loop over parts."""
    return hashlib.sha256(length(len(data)) + data).digest()
