"""Threads mapping, unmapping and pre-mapping distinct pages of one group (and of two groups sharing a pool).

The GIL is released around every data-plane call, so these threads really run the C++ code concurrently;
the group mutex serializes them. The same kind of workload runs under ThreadSanitizer and AddressSanitizer
in core_ext/tests/sanitize.sh (C++ stress driver); here it checks the Python-visible end state.
"""

from __future__ import annotations

import random
import threading

from dataplane_helpers import MiB, Rig, expected_live_handles, make_rig
from elastic_kv import _vmm

THREADS = 4
PAGES_PER_THREAD = 6
ROUNDS = 150


def _worker(rig: Rig, pages: list[int], seed: int, errors: list[BaseException]) -> None:
    rng = random.Random(seed)
    mapped: set[int] = set()
    try:
        for i in range(ROUNDS):
            page = rng.choice(pages)
            action = rng.random()
            if page not in mapped:
                if action < 0.3:
                    rig.group.map_async([page])
                    rig.group.collect(wait=True)  # may collect other threads' results: only state matters
                    assert rig.group.is_mapped(page)
                else:
                    rig.group.map([page])
                rig.write_page(page, salt=i)
                mapped.add(page)
            elif action < 0.4:
                tx = seed * 1_000_000 + i
                rig.group.prepare(tx, [page])
                if rng.random() < 0.5:
                    rig.group.abort(tx)
                    assert rig.holds_last_write(page)
                else:
                    rig.group.commit(tx)
                    mapped.discard(page)
            else:
                assert rig.holds_last_write(page)
                rig.group.unmap([page])
                mapped.discard(page)
    except BaseException as e:  # reported by the main thread
        errors.append(e)


def _run_threads(rigs: list[Rig]) -> None:
    errors: list[BaseException] = []
    threads = []
    for t in range(THREADS):
        pages = list(range(t * PAGES_PER_THREAD, (t + 1) * PAGES_PER_THREAD))
        threads.append(threading.Thread(target=_worker, args=(rigs[t % len(rigs)], pages, t, errors)))
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []


def test_threads_on_distinct_pages_of_one_group() -> None:
    backend = _vmm.HostBackend(granularity=2 * MiB)
    # 3 MiB pages over 2 MiB slots: neighbouring pages of *different* threads share a slot.
    rig = make_rig(backend, num_pages=THREADS * PAGES_PER_THREAD, extents=[(0, 0, 3 * MiB, 3 * MiB)])
    baseline = backend.live_handles
    _run_threads([rig])
    assert rig.group.consistent
    assert all(rig.holds_last_write(page) for page in rig.group.mapped_pages())
    assert rig.zero_slots_read_zero()
    assert backend.live_handles == expected_live_handles(rig, baseline)
    rig.close()


def test_two_groups_share_a_pool_and_backend() -> None:
    backend = _vmm.HostBackend(granularity=2 * MiB)
    first = make_rig(backend, num_pages=THREADS * PAGES_PER_THREAD, max_cached_bytes=8 * MiB)
    second = make_rig(backend, num_pages=THREADS * PAGES_PER_THREAD, pool=first.pool)
    _run_threads([first, second])
    for rig in (first, second):
        assert rig.group.consistent
        assert all(rig.holds_last_write(page) for page in rig.group.mapped_pages())
    first.close()
    second.close()
    assert backend.live_handles == 1 + first.pool.cached_handles  # one shared zero page


def test_driver_work_runs_without_the_gil() -> None:
    """While one thread sits in a slow map (a 50 ms driver per call), Python keeps running elsewhere --
    including a thread blocked on the group's mutex through an accessor."""
    fault = _vmm.FaultInjectingBackend(_vmm.HostBackend(granularity=2 * MiB))
    rig = make_rig(fault, num_pages=8)
    fault.delay("map", 0.05)
    mapper = threading.Thread(target=rig.group.map, args=([0, 1, 2, 3],))
    reader = threading.Thread(target=rig.group.mapped_pages)  # waits for the mutex, without the GIL
    spins = 0
    mapper.start()
    reader.start()
    while mapper.is_alive():
        spins += 1
    mapper.join()
    reader.join()
    fault.clear()
    assert spins > 1000, "the main thread could not run: the GIL was held during driver work"
    assert rig.group.mapped_pages() == [0, 1, 2, 3]
    rig.close()
