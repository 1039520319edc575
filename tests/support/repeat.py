"""Run each selected test several times in a row, to find the ones that fail only sometimes:

    python -m pytest -p tests.support.repeat --repeat-each 10 -n 0 TESTS...

Each test becomes ``--repeat-each`` items (``[rep0]`` ... ``[repN-1]``), run one after another (a
parametrized test runs all of its cases once per repeat); fixtures of a wider scope (a module's engines) are
shared by the repeats, so what repeats is the test's own work, under the load of the engines it drives.
``-n 0`` keeps them in one process, in order."""

from __future__ import annotations

import pytest

REPEAT = "repeat_index"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--repeat-each", type=int, default=1, metavar="N", help="run each selected test N times in a row"
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    count = int(metafunc.config.getoption("repeat_each"))
    if count < 1:
        raise pytest.UsageError(f"--repeat-each must be at least 1, got {count}")
    if count > 1:
        metafunc.fixturenames.append(REPEAT)
        metafunc.parametrize(REPEAT, range(count), ids=[f"rep{i}" for i in range(count)])
