"""lever.cli.table: a command's table fits 80 columns and keeps every figure."""

from __future__ import annotations

from lever.cli.table import WIDTH, show


def test_a_wide_table_fits_and_keeps_its_figures():
    lines = []
    cols = ("pipeline", "ms/token", "tok/s", "tok/pass", "nodes", "flash MB/tok", "speedup")
    rows = [("chain-sd k=12", "123.7", "8.08", "7.21", "13.0", "112.3", "5.84x"),
            ("lever", "1112.3", "8.90", "9.27", "39.6", "92.7", "6.43x")]
    show(cols, rows, lines.append, title="DRAM budget 0%")
    assert lines[0] == "DRAM budget 0%" and max(map(len, lines)) <= WIDTH
    body = "\n".join(lines)
    assert all(v in body for r in rows for v in r) and all(c in body for c in cols)
    assert lines[-1].split()[0] == "lever" and lines[-1].endswith("6.43x")  # names left, figures right
