"""``tests/support/repeat.py``: each selected test runs ``--repeat-each`` times, in order, sharing wider
fixtures; a count below 1 is refused in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

SAMPLE = """
import pytest

STARTS = []

@pytest.fixture(scope="module")
def engine():
    STARTS.append(1)
    return "engine"

@pytest.mark.parametrize("case", ["a", "b"])
def test_case(engine, case):
    assert engine == "engine"

def test_started_once():
    assert STARTS == [1]
"""


def _pytest(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.support.repeat", "-p", "no:cacheprovider", "-n", "0",
         "-v", "--rootdir", str(tmp_path), "-c", "/dev/null", *args, str(tmp_path / "test_sample.py")],
        capture_output=True, text=True, cwd=REPO_ROOT, timeout=120,
    )  # fmt: skip


def test_each_test_runs_the_given_number_of_times_in_order_sharing_module_fixtures(tmp_path: Path) -> None:
    done = _pytest(tmp_path, "--repeat-each", "3")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "9 passed" in done.stdout
    ran = [line.split("::")[1].split(" ")[0] for line in done.stdout.splitlines() if " PASSED" in line]
    assert ran[:2] == ["test_case[rep0-a]", "test_case[rep0-b]"], ran  # all cases, then all cases again
    assert [r for r in ran if r.endswith("-a]")] == [f"test_case[rep{i}-a]" for i in range(3)], ran


def test_a_count_below_one_is_refused(tmp_path: Path) -> None:
    done = _pytest(tmp_path, "--repeat-each", "0")
    assert done.returncode != 0
    assert "--repeat-each must be at least 1, got 0" in done.stdout + done.stderr
