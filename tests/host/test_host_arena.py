"""The host arena (``elastic_kv.host``): extents taken and given back across processes, never overlapping,
reclaimed from dead owners; the file's own failures (too small a file system, a live creator, a bad file)
refused with one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from elastic_kv.errors import ConfigError
from elastic_kv.host import ALIGN, MAX_EXTENTS, HostArena

MiB = 1 << 20


@pytest.fixture
def arena_path(tmp_path: Path) -> Path:
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else tmp_path
    path = base / f"test-arena-{os.getpid()}-{tmp_path.name}.arena"
    yield path
    path.unlink(missing_ok=True)


def _child(code: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args], stdout=subprocess.PIPE, stdin=subprocess.PIPE,
        text=True,
    )  # fmt: skip


def test_extents_are_aligned_first_fit_and_given_back(arena_path: Path) -> None:
    arena = HostArena.create(arena_path, 10 * MiB)
    assert arena.size == 10 * MiB and arena.largest_free() == 10 * MiB
    a = arena.take(3 * MiB, "a")  # rounded up to 4 MiB
    b = arena.take(1, "b")
    c = arena.take(2 * MiB, "c")
    assert a is not None and b is not None and c is not None
    assert [(e.offset, e.size) for e in (a, b, c)] == [(0, 4 * MiB), (4 * MiB, ALIGN), (6 * MiB, 2 * MiB)]
    assert arena.take(4 * MiB, "d") is None  # 2 MiB left
    arena.give_back(a)
    arena.give_back(a)  # idempotent
    assert arena.largest_free() == 4 * MiB and arena.used_bytes() == 4 * MiB
    d = arena.take(4 * MiB, "d")
    assert d is not None and d.offset == 0
    assert [e.owner for e in arena.extents()] == ["d", "b", "c"]
    with pytest.raises(ValueError):
        arena.take(0, "zero")
    arena.close()


def test_would_take_places_extents_in_order_as_take_would_and_skips_the_ones_that_do_not_fit(
    arena_path: Path,
) -> None:
    """What a sleep that parks its KV and then copies its weights needs to know before it asks: the KV's
    extent first, then the weights'; one that finds no room is skipped (the KV stays on the device) and the
    next one tried. Nothing is taken by asking."""
    arena = HostArena.create(arena_path, 10 * MiB)
    held = arena.take(2 * MiB, "held")
    assert held is not None
    assert arena.would_take([3 * MiB, 4 * MiB]) == [True, True]  # 4 MiB (aligned) + 4 MiB in 8 MiB
    assert arena.would_take([4 * MiB, 5 * MiB]) == [True, False]
    assert arena.would_take([9 * MiB, 4 * MiB]) == [False, True]  # the first skipped, the second placed
    assert arena.would_take([0, 8 * MiB]) == [True, True]
    assert arena.used_bytes() == 2 * MiB
    arena.give_back(held)
    middle = arena.take(2 * MiB, "low")  # at 0; then a hole at 2-4 MiB once 'low' goes back
    high = arena.take(2 * MiB, "high")
    assert middle is not None and high is not None
    arena.give_back(middle)
    assert arena.would_take([2 * MiB, 6 * MiB, ALIGN]) == [True, True, False]  # first fit: 0, 4, full
    arena.close()


def test_bytes_written_through_one_mapping_are_read_through_another(arena_path: Path) -> None:
    arena = HostArena.create(arena_path, 4 * MiB)
    extent = arena.take(MiB, "w")
    assert extent is not None
    arena.view(extent)[:5] = b"hello"
    other = HostArena.open(arena_path)
    assert bytes(other.view(extent)[:5]) == b"hello"
    assert other.address(extent) != 0 and [e.token for e in other.extents()] == [extent.token]
    with pytest.raises(ValueError):
        other.view(type(extent)(8 * MiB, MiB, 1, "outside"))
    other.close()
    arena.close()


def test_concurrent_processes_never_share_bytes(arena_path: Path) -> None:
    arena = HostArena.create(arena_path, 64 * MiB)
    code = """
        import sys
        from pathlib import Path
        from elastic_kv.host import HostArena
        arena = HostArena.open(Path(sys.argv[1]))
        for i in range(200):
            e = arena.take(2 << 20, sys.argv[2])
            if e is None:
                continue
            view = arena.view(e)
            view[:] = bytes([int(sys.argv[2])]) * len(view)
            assert bytes(view) == bytes([int(sys.argv[2])]) * len(view), "another process wrote here"
            arena.give_back(e)
        print("ok")
    """
    children = [_child(code, str(arena_path), str(k)) for k in range(1, 5)]
    outs = [c.communicate(timeout=120)[0] for c in children]
    assert [c.returncode for c in children] == [0] * 4 and outs == ["ok\n"] * 4
    assert arena.extents() == []
    arena.close()


def test_a_killed_owners_extent_is_reclaimed_when_room_is_short(arena_path: Path) -> None:
    arena = HostArena.create(arena_path, 8 * MiB)
    code = """
        import sys
        from pathlib import Path
        from elastic_kv.host import HostArena
        arena = HostArena.open(Path(sys.argv[1]))
        assert arena.take(6 << 20, "victim") is not None
        print("taken", flush=True)
        sys.stdin.read()
    """
    child = _child(code, str(arena_path))
    assert child.stdout is not None and child.stdout.readline() == "taken\n"
    assert arena.take(4 * MiB, "newcomer") is None  # the owner lives: nothing is reclaimed
    assert [e.owner for e in arena.extents()] == ["victim"]
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    got = arena.take(4 * MiB, "newcomer")
    assert got is not None and [e.owner for e in arena.extents()] == ["newcomer"]
    arena.close()


def test_reclaim_dead_reports_what_it_took_back(arena_path: Path) -> None:
    arena = HostArena.create(arena_path, 8 * MiB)
    code = """
        import sys
        from pathlib import Path
        from elastic_kv.host import HostArena
        HostArena.open(Path(sys.argv[1])).take(2 << 20, "gone")
    """
    child = _child(code, str(arena_path))
    child.communicate(timeout=60)
    mine = arena.take(MiB, "mine")
    assert mine is not None
    assert [e.owner for e in arena.reclaim_dead()] == ["gone"]
    assert [e.owner for e in arena.extents()] == ["mine"]
    arena.close()


def test_a_full_table_refuses_more_extents(arena_path: Path) -> None:
    arena = HostArena.create(arena_path, (MAX_EXTENTS + 1) * ALIGN, prefault=False)
    taken = [arena.take(1, f"e{i}") for i in range(MAX_EXTENTS)]
    assert all(taken) and arena.largest_free() == ALIGN
    assert arena.take(1, "one too many") is None
    arena.close()


def test_too_small_a_file_system_is_one_line_at_creation(arena_path: Path) -> None:
    fs = os.statvfs(arena_path.parent)
    too_big = fs.f_blocks * fs.f_frsize + (1 << 30)
    with pytest.raises(ConfigError, match=r"has room for .*the host budget needs") as info:
        HostArena.create(arena_path, too_big)
    assert "\n" not in str(info.value)
    assert not arena_path.exists()


def test_a_live_creators_arena_is_refused_a_dead_ones_replaced(arena_path: Path) -> None:
    arena = HostArena.create(arena_path, 4 * MiB, prefault=False)
    with pytest.raises(ConfigError, match="belongs to a running process"):
        HostArena.create(arena_path, 4 * MiB)
    arena.close()
    code = """
        import sys
        from pathlib import Path
        from elastic_kv.host import HostArena
        HostArena.create(Path(sys.argv[1]), 4 << 20, prefault=False)
    """
    arena_path.unlink()
    child = _child(code, str(arena_path))
    child.communicate(timeout=60)
    assert child.returncode == 0 and arena_path.exists()
    HostArena.create(arena_path, 4 * MiB, prefault=False).close()  # its creator is gone: replaced


@pytest.mark.parametrize("content", [b"", b"x" * 100, b"\0" * (4 << 20)])
def test_a_file_that_is_not_an_arena_is_refused(arena_path: Path, content: bytes) -> None:
    arena_path.write_bytes(content)
    with pytest.raises(ConfigError, match="host arena"):
        HostArena.open(arena_path)
    with pytest.raises(ConfigError, match="cannot open"):
        HostArena.open(arena_path.with_suffix(".missing"))
