"""The fault-injection tests' tally (``tests/dataplane/test_fault_injection.py``): each injection point
records ``(scenario, op, mode, outcome)``, and the run ends with a summary of them all. Under pytest-xdist
each worker records its own and hands them to the controller, which prints the summary
(``tests/conftest.py``)."""

from __future__ import annotations

import pytest

Outcome = tuple[str, str, str, str]
_OUTCOMES = pytest.StashKey[list[Outcome]]()


def outcomes(config: pytest.Config) -> list[Outcome]:
    """This process's record of injection outcomes (appended to by the tests)."""
    return config.stash.setdefault(_OUTCOMES, [])


def write_summary(terminalreporter: pytest.TerminalReporter, recorded: list[Outcome]) -> None:
    """A section with the number of injection points checked and their outcomes by scenario."""
    if not recorded:
        return
    by_scenario: dict[str, dict[str, int]] = {}
    for scenario, _op, _mode, outcome in recorded:
        counts = by_scenario.setdefault(scenario, {})
        counts[outcome] = counts.get(outcome, 0) + 1
    terminalreporter.section("fault injection")
    terminalreporter.write_line(
        f"{len(recorded)} injection points checked (scenario x config x op x call x mode)"
    )
    for scenario, counts in sorted(by_scenario.items()):
        detail = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))
        terminalreporter.write_line(f"  {scenario:>10}: {sum(counts.values()):5d}  ({detail})")
