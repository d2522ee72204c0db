"""The test data ships with the clone: every file under tests/data is the one tests/data/SOURCES.md
names, by size and sha256, and every row there names a file that is here."""

from __future__ import annotations

import re

from lever.hub.store import file_digest
from tests.conftest import DATA

ROW = re.compile(r"^\| `([^`]+)` \| (\d+) \| `([0-9a-f]{64})` \|", re.M)


def test_each_shipped_file_is_the_one_its_provenance_names():
    rows = {name: (int(size), sha) for name, size, sha in ROW.findall((DATA / "SOURCES.md").read_text())}
    files = {p.name: p for p in DATA.rglob("*") if p.is_file() and p.name != "SOURCES.md"}
    assert set(rows) == set(files)
    for name, path in files.items():
        assert (path.stat().st_size, file_digest(path)) == rows[name], name
