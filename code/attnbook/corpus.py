# Do not edit: tools/tangle.py generates this file from chapters/a1-conventions.md.
"""The book's training text: a fixed snapshot of the Python documentation's topics.

Built and explained in the book's chapter chapters/a1-conventions.md.
"""

__all__ = [
    "SNAPSHOT",
    "SNAPSHOT_SHA256",
    "read_snapshot",
    "python_topics",
]

# chapters/a1-conventions.md, "The training text, shipped as package data"
import gzip
import hashlib
import json
import zlib
from importlib import resources
from typing import Any

SNAPSHOT = "python-3.11.7-topics.json.gz"
SNAPSHOT_SHA256 = "38ba2ac4b3d58f22f028ae47bef4b35d5b884f860c23411ad241d9484fc4d37a"


def read_snapshot() -> dict[str, Any]:
    """The corpus file: its `source`, its `license` and its `topics` (appendix A).

    Raises RuntimeError, naming the file, when it is missing, not a whole gzip file (empty,
    truncated, or a byte changed) or its text's SHA-256 is not SNAPSHOT_SHA256."""
    path = resources.files("attnbook") / "data" / SNAPSHOT
    if not path.is_file():
        raise RuntimeError(f"{path} is missing or not a file: reinstall attnbook")
    try:
        data = path.read_bytes()
        if not data:  # gzip.decompress would read an empty file as an empty text
            raise EOFError("the file is empty")
        raw = gzip.decompress(data)
    except (EOFError, OSError, zlib.error) as error:  # cut short; a bad header, CRC or stream
        raise RuntimeError(f"{path} is damaged: it is not a whole gzip file "
                           f"({type(error).__name__}: {error})") from None
    digest = hashlib.sha256(raw).hexdigest()
    if digest != SNAPSHOT_SHA256:
        raise RuntimeError(f"{path} is damaged: its SHA-256 is {digest}, "
                           f"expected {SNAPSHOT_SHA256}")
    snapshot: dict[str, Any] = json.loads(raw)  # source, license and topics
    return snapshot


def python_topics() -> dict[str, str]:
    """The book's training text, article by article: CPython 3.11.7's `pydoc_data.topics`,
    the same characters on every Python (appendix A)."""
    topics: dict[str, str] = read_snapshot()["topics"]
    return topics
