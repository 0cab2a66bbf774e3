"""The order in which scripts/test.sh's pytest-xdist workers take the test files: the longest measured first."""
import collections
import json
from pathlib import Path

from conftest import FILE_SECONDS, file_seconds, longest_first

ROOT = Path(__file__).resolve().parents[1]


def test_measured_files_go_longest_first_and_unmeasured_ones_before_them():
    files = ["a.py", "b.py", "new_quick.py", "c.py", "new_slow.py", "d.py"]
    measured = {"a.py": 5.0, "b.py": 600.0, "c.py": 40.0, "d.py": 40.0}
    slow = collections.Counter({"new_slow.py": 3, "c.py": 9})
    rank = longest_first(files, measured, slow)
    # unknown files first (most slow tests first), then the measured ones by seconds, ties in collection order
    assert sorted(rank, key=rank.get) == ["new_slow.py", "new_quick.py", "b.py", "c.py", "d.py", "a.py"]
    assert longest_first(["x", "y", "x"], {}, collections.Counter({"y": 1})) == {"y": 0, "x": 1}


def test_a_missing_or_broken_table_orders_by_slow_tests_and_never_fails(tmp_path):
    assert file_seconds(str(tmp_path / "missing.json")) == {}
    for text in ("{", "[]", '{"seconds": [1, 2]}', '{"seconds": {"a.py": "fast"}}', '{"other": {}}'):
        (tmp_path / "t.json").write_text(text)
        assert file_seconds(str(tmp_path / "t.json")) == {}, text
    (tmp_path / "t.json").write_text(json.dumps({"seconds": {"tests/x.py": 12.5}}))
    assert file_seconds(str(tmp_path / "t.json")) == {"tests/x.py": 12.5}


def test_the_committed_table_is_read_and_xdist_keeps_its_order():
    """The table in the repository parses, names most of today's test files and few that are gone (a stale entry
    only costs balance, but a table of nothing would silently fall back), and scripts/test.sh turns off xdist's own
    reordering (by count of tests a file), which would otherwise replace this order."""
    measured = file_seconds(FILE_SECONDS)
    files = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")}
    assert len(set(measured) & files) >= 0.8 * len(files), \
        "tests/file_seconds.json misses many test files: SIAMESENORM_FILE_SECONDS=$PWD/tests/file_seconds.json bash .ci/run"
    assert sum((ROOT / path).is_file() for path in measured) >= 0.9 * len(measured)
    script = (ROOT / "scripts" / "test.sh").read_text()
    assert "--dist loadfile --no-loadscope-reorder" in script
