"""How the ledger asks for logical pages to be backed: the :class:`PageMapper` protocol.

The ledger (``elastic_kv.ledger``) decides *which* logical pages must be backed; a mapper makes it so.
Two implementations exist:

* :class:`LocalMapper` -- one ``_vmm.SpaceGroup`` in this process (SGLang, vLLM at world size 1, tests);
* ``elastic_kv.ranks.Coordinator`` -- the same pages on every rank of a tensor/pipeline-parallel group.

The protocol is deliberately tiny so that a multi-process implementation stays simple: whole logical
pages only, all-or-nothing ``map``, and an optional asynchronous pair (``map_async`` / ``collect``) that the
ledger uses to pre-map its reserve off the allocating thread. A mapper keeps no accounting of its own; the
ledger is the single owner of "which page is backed".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from elastic_kv import _vmm
    from elastic_kv.geometry import BlockGeometry

__all__ = ["AsyncPageMapper", "LocalMapper", "MapResult", "PageMapper"]

# (job id returned by map_async, the pages of that job, None on success or the error text on failure).
# A failed job mapped none of its pages (the data plane rolls a job back as a whole).
MapResult = tuple[int, list[int], "str | None"]


@runtime_checkable
class PageMapper(Protocol):
    """Backs and releases whole logical pages.

    ``map(pages)`` backs every page or none: on physical exhaustion it raises
    :class:`elastic_kv.errors.PoolExhausted` with nothing changed; a failed rollback raises
    :class:`elastic_kv.errors.StateConsistencyError`. ``unmap(pages)`` releases pages that are mapped.
    Mapping a mapped page or unmapping an unmapped one is a ``ValueError`` (the ledger never does it).
    """

    def map(self, pages: Sequence[int]) -> None: ...

    def unmap(self, pages: Sequence[int]) -> None: ...


@runtime_checkable
class AsyncPageMapper(PageMapper, Protocol):
    """A :class:`PageMapper` that can also map in the background.

    ``map_async(pages)`` queues one all-or-nothing job and returns its id at once (no driver call on the
    caller's thread); ``collect()`` returns the jobs finished since the last call without blocking, and
    ``collect(wait=True)`` first waits until every queued job has finished; ``collect(wait=True, jobs=k)``
    may return once the ``k`` oldest jobs not yet collected have finished (a mapper that cannot tell waits
    for all). The caller must not map or unmap a page of a job that has not been collected yet. A failed
    job's error text starts with the error type (``"PoolExhausted: ..."``, ``"StateConsistencyError:
    ..."``, ``"BackendError: ..."``, ``"Cancelled: ..."``).
    """

    def map_async(self, pages: Sequence[int]) -> int: ...

    def collect(self, wait: bool = False, jobs: int = 0) -> list[MapResult]: ...


class LocalMapper:
    """:class:`AsyncPageMapper` over one in-process ``_vmm.SpaceGroup``.

    The group's own background thread serves ``map_async``; errors keep the data plane's types
    (``PoolExhausted``, ``StateConsistencyError``, ``ValueError``).
    """

    __slots__ = ("_group",)

    def __init__(self, group: _vmm.SpaceGroup) -> None:
        self._group = group

    @property
    def group(self) -> _vmm.SpaceGroup:
        """The space group this mapper drives (for tests and diagnostics)."""
        return self._group

    def map(self, pages: Sequence[int]) -> None:
        """Back ``pages`` in every space of the group, all or nothing."""
        self._group.map(list(pages))

    def unmap(self, pages: Sequence[int]) -> None:
        """Release ``pages`` (prepare + commit inside the data plane)."""
        self._group.unmap(list(pages))

    def map_async(self, pages: Sequence[int]) -> int:
        """Queue ``pages`` for the group's background mapping thread; returns the job id."""
        return int(self._group.map_async(list(pages)))

    def collect(self, wait: bool = False, jobs: int = 0) -> list[MapResult]:
        """Jobs the background thread finished since the last call; ``wait=True`` first waits for all
        (the data plane waits for its whole queue: ``jobs`` is not used)."""
        return [(int(job), [int(p) for p in pages], error) for job, pages, error in self._group.collect(wait)]

    @classmethod
    def for_geometry(
        cls, backend: _vmm.Backend, geometry: BlockGeometry, *, cached_bytes: int = 0
    ) -> LocalMapper:
        """Reserve the geometry's spaces on ``backend`` and group them: a ready mapper for a
        :class:`~elastic_kv.ledger.Ledger`. ``cached_bytes`` caps the physical handles kept for
        reuse after unmap (0 = release at once); they save a create/release per map/unmap cycle but hold
        device memory that no pool is charged for, so keep the cap small (the ledger's reserve already
        avoids most cycles). The engine's tensors are ``torch.from_dlpack(space)`` over
        ``mapper.group.spaces``."""
        from elastic_kv import _vmm

        spaces = [_vmm.TensorSpace(backend, size, geometry.page_size) for size in geometry.space_sizes]
        pool = _vmm.HandlePool(backend, cached_bytes)
        return cls(_vmm.SpaceGroup(spaces, geometry.extent_tuples(), geometry.num_pages, pool))

    def close(self) -> None:
        """Close the group (returns every unit to the zero page and its handles to the pool)."""
        self._group.close()
