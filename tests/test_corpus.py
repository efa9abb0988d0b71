"""The corpus snapshot (appendix A): the same text on every Python, refused when damaged."""

import gzip
import hashlib
import sys
from types import SimpleNamespace

import pytest

import attnbook.corpus as corpus


def test_the_snapshot_is_the_python_3_11_7_documentation():
    snapshot = corpus.read_snapshot()
    topics = corpus.python_topics()
    assert topics == snapshot["topics"] and len(topics) == 79
    assert "3.11.7" in snapshot["source"] and "Python Software Foundation" in snapshot["license"]
    assert "assert" in topics and topics["assert"].lstrip().startswith("The \"assert\" statement")
    if sys.version_info[:3] == (3, 11, 7):  # the Python it was taken from
        from pydoc_data.topics import topics as this_python

        assert topics == this_python


def test_the_checksum_is_that_of_the_file(monkeypatch):
    path = corpus.resources.files("attnbook") / "data" / corpus.SNAPSHOT
    raw = gzip.decompress(path.read_bytes())
    assert hashlib.sha256(raw).hexdigest() == corpus.SNAPSHOT_SHA256
    monkeypatch.setattr(corpus, "SNAPSHOT_SHA256", "0" * 64)
    with pytest.raises(RuntimeError, match="is damaged: its SHA-256 is [0-9a-f]{64}"):
        corpus.python_topics()


def _damaged(data: bytes, how: str) -> bytes:
    if how == "truncated":
        return data[:len(data) // 2]
    if how == "empty":
        return b""
    if how == "not gzip":
        return b"{" + data[1:]
    flipped = bytearray(data)  # a bit of the compressed stream, or of the CRC at the end
    flipped[len(data) // 2 if how == "flipped byte" else -6] ^= 0x10
    return bytes(flipped)


@pytest.mark.parametrize("how", ["truncated", "empty", "not gzip", "flipped byte", "flipped crc"])
def test_a_damaged_file_gives_the_promised_runtime_error(how, tmp_path, monkeypatch):
    """A truncated or bit-flipped .gz raised EOFError or zlib.error, naming neither the
    file nor the damage; read_snapshot promises a RuntimeError."""
    original = (corpus.resources.files("attnbook") / "data" / corpus.SNAPSHOT).read_bytes()
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / corpus.SNAPSHOT).write_bytes(_damaged(original, how))
    monkeypatch.setattr(corpus, "resources", SimpleNamespace(files=lambda package: tmp_path))
    with pytest.raises(RuntimeError, match=rf"{corpus.SNAPSHOT} is damaged: (it is not a whole "
                                           r"gzip file \(\w+: .+\)|its SHA-256 is [0-9a-f]{64})"):
        corpus.read_snapshot()
    (tmp_path / "data" / corpus.SNAPSHOT).write_bytes(original)  # the same path, undamaged
    assert corpus.read_snapshot()["topics"] == corpus.python_topics()


def test_an_empty_file_is_not_a_whole_gzip_file(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / corpus.SNAPSHOT).write_bytes(b"")
    monkeypatch.setattr(corpus, "resources", SimpleNamespace(files=lambda package: tmp_path))
    with pytest.raises(RuntimeError, match=rf"{corpus.SNAPSHOT} is damaged: it is not a whole "
                                           r"gzip file \(EOFError: the file is empty\)"):
        corpus.read_snapshot()


@pytest.mark.parametrize("make_directory", [False, True])
def test_a_missing_file_or_a_directory_says_reinstall(make_directory, tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    if make_directory:
        (tmp_path / "data" / corpus.SNAPSHOT).mkdir()
    monkeypatch.setattr(corpus, "resources", SimpleNamespace(files=lambda package: tmp_path))
    with pytest.raises(RuntimeError, match=rf"{corpus.SNAPSHOT} is missing or not a file: "
                                           "reinstall attnbook"):
        corpus.read_snapshot()
