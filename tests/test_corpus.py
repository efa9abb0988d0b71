"""The corpus snapshot (appendix A): the same text on every Python, refused when damaged."""

import gzip
import hashlib
import sys

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
