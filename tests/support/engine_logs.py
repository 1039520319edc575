"""Engine logs shown with a failing test.

An engine test's evidence is often in its engine's log, which CI keeps nowhere. The helpers that start an
engine or a server (:class:`tests.support.serve.ServeProcess`, :class:`tests.support.sglang_engine.
EngineProcess`, the vLLM server fixtures) :func:`watch` its log file, or the folder its engines log into,
for as long as it runs; the report hook in ``tests/conftest.py`` adds the tail of every watched log to the
report of a test that fails or errors meanwhile, so pytest prints it under the failure.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["sections", "tail", "unwatch", "watch"]

TAIL_LINES = 60
MAX_LOGS = 8  # a server folder with many engine logs: the most recently written ones

_watched: dict[Path, str] = {}


def watch(path: Path, label: str | None = None) -> None:
    """Show ``path`` (a log file, or a folder: its ``*.log`` files) with failures until :func:`unwatch`."""
    _watched[Path(path)] = label or Path(path).name


def unwatch(path: Path) -> None:
    _watched.pop(Path(path), None)


def tail(path: Path, lines: int = TAIL_LINES) -> str:
    """The last ``lines`` lines of ``path`` (for an error message about the engine that wrote it)."""
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"(unreadable: {exc})"
    return "\n".join(text.splitlines()[-lines:])


def sections(lines: int = TAIL_LINES) -> list[tuple[str, str]]:
    """(title, last ``lines`` lines) of every watched log that exists, for ``report.sections``."""
    files: list[tuple[str, Path]] = []
    for path, label in _watched.items():
        if path.is_dir():
            files += [(f"{label}/{log.name}", log) for log in path.glob("*.log")]
        elif path.is_file():
            files.append((label, path))
    files.sort(key=lambda item: item[1].stat().st_mtime, reverse=True)
    return [
        (f"engine log {title} (last {lines} lines)", tail(path, lines)) for title, path in files[:MAX_LOGS]
    ]
