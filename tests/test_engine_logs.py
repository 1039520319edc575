"""A failing test's report carries the tails of the engine logs watched at the time (tests/conftest.py's
report hook and :mod:`tests.support.engine_logs`), and only those."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import engine_logs

pytest_plugins = ["pytester"]
REPO_ROOT = Path(__file__).resolve().parents[1]


def test_a_failure_shows_the_watched_logs_and_a_pass_shows_nothing(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))
    pytester.makeconftest("from tests.conftest import pytest_runtest_makereport  # noqa: F401\n")
    pytester.makepyfile(
        r"""
        import pytest
        from tests.support import engine_logs

        def _engine(folder, name):
            log = folder / name
            log.write_text("".join(f"line {i}\n" for i in range(100)) + f"{name} the engine's last words\n")
            return log

        @pytest.fixture
        def watched(tmp_path):  # as the engine fixtures do: watched while the engine runs
            logs = tmp_path / "logs"
            logs.mkdir()
            _engine(logs, "m0.log")
            server = _engine(tmp_path, "server.log")
            engine_logs.watch(server, "server")
            engine_logs.watch(logs, "serve/logs")
            yield
            engine_logs.unwatch(server)
            engine_logs.unwatch(logs)

        def test_fails_while_watching(watched):
            assert False, "the engine answered wrongly"

        def test_fails_after_unwatching(tmp_path):
            other = _engine(tmp_path, "other.log")
            engine_logs.watch(other, "other")
            engine_logs.unwatch(other)
            assert False

        def test_passes_while_watching(tmp_path):
            engine_logs.watch(_engine(tmp_path, "quiet.log"), "quiet")
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=2, passed=1)
    out = result.stdout.str()
    assert "engine log server (last 60 lines)" in out and "server.log the engine's last words" in out
    assert "engine log serve/logs/m0.log (last 60 lines)" in out and "m0.log the engine's last words" in out
    assert "line 41\n" in out and "line 40\n" not in out  # the tail only: 60 of 101 lines
    assert "other.log the engine's last words" not in out  # unwatched before it failed
    assert out.count("server.log the engine's last words") == 1  # the second failure: nothing watched
    assert "quiet.log" not in out  # a pass shows nothing


def test_sections_are_the_newest_logs_of_a_folder_and_skip_missing_files(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    for i in range(engine_logs.MAX_LOGS + 2):
        (logs / f"m{i}.log").write_text(f"m{i}\n")
    gone = tmp_path / "never-written.log"
    engine_logs.watch(logs, "serve")
    engine_logs.watch(gone)
    try:
        titles = [title for title, _ in engine_logs.sections()]
    finally:
        engine_logs.unwatch(logs)
        engine_logs.unwatch(gone)
    assert len(titles) == engine_logs.MAX_LOGS
    assert all(title.startswith("engine log serve/m") for title in titles)
    assert engine_logs.sections() == []
