"""Typed, immutable statistics of one KV pool, for kvctl, metrics and the shared-memory registry.

A :class:`PoolSnapshot` is what :meth:`elastic_kv.ledger.Ledger.snapshot` returns and what the
ledger hands to ``PoolRecord.publish``. It is a plain frozen value: readers (``kvctl``, the Prometheus
exporter, tests) never see a half-updated pool, and the registry can serialise it with :meth:`as_dict`
and rebuild it with :meth:`from_dict` without knowing the ledger.

Units: ``*_blocks`` count engine blocks, ``*_pages`` count logical pages (``blocks_per_page`` blocks
each), ``*_bytes`` are physical bytes. ``used_blocks`` excludes the null block, which is always
reserved and always backed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import Any

__all__ = ["SNAPSHOT_SCHEMA", "PoolSnapshot", "PoolState"]

SNAPSHOT_SCHEMA = "elastic_kv.pool_snapshot.v1"


class PoolState(str, Enum):
    """Life-cycle state of a pool as readers see it."""

    ACTIVE = "active"  # issuing blocks within its limit
    SHRINKING = "shrinking"  # the limit was lowered below what the pool holds; its draining pages empty
    INCONSISTENT = "inconsistent"  # a rollback failed in the data plane; the pool refuses work
    CLOSED = "closed"  # the pool was torn down


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    """One pool's statistics at one instant (see the module docstring for units)."""

    name: str
    state: PoolState
    block_size_bytes: int  # bytes of one block summed over every space (all layers, K and V)
    page_size: int  # bytes of one slot of a space (the data plane's page size)
    page_bytes: int  # physical bytes that back one logical page when no neighbour shares a slot
    blocks_per_page: int
    total_blocks: int  # every block id the pool may issue, the null block included
    used_blocks: int  # live blocks issued to the engine (null block excluded)
    free_blocks: int  # logical free blocks: total - used - null
    available_blocks: int  # what available_size() reports: free blocks the pool could back now
    total_pages: int
    mapped_pages: int  # pages backed now (in use, reserve and pending release)
    reserve_pages: int  # backed pages without live blocks, kept to serve allocations without a driver call
    pending_pages: int  # backed pages without live blocks, waiting for release_through(epoch)
    inflight_pages: int  # pages being mapped by the background thread
    mapped_bytes: int  # physical bytes charged for backed and in-flight pages
    limit_bytes: int  # physical limit the pool follows now (0 = unlimited)
    reserve_hits: int  # new pages served from the reserve without a driver call
    reserve_misses: int  # new pages that had to be mapped synchronously on the allocating thread
    epoch: int  # current release epoch (see Ledger.advance_epoch)
    timestamp: float  # time.time() when the snapshot was taken
    preemptions: int = 0  # requests the engine preempted (to recompute later) since the pool started
    draining_pages: int = 0  # pages being released to meet the limit: none of their blocks is issued
    # What the pool must hold for its largest unfinished request to take its next step alone, the null
    # block's page included (elastic_kv.ledger.fit); 0 with no request, or from an engine that does not say.
    largest_request_bytes: int = 0
    failed_requests: int = 0  # requests the engine ended with an error: they need more than the ceiling

    @property
    def reserve_hit_rate(self) -> float:
        """Fraction of page acquisitions served from the reserve (1.0 when none happened yet)."""
        total = self.reserve_hits + self.reserve_misses
        return 1.0 if total == 0 else self.reserve_hits / total

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict with every field plus ``schema`` and ``reserve_hit_rate``."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["state"] = self.state.value
        out["schema"] = SNAPSHOT_SCHEMA
        out["reserve_hit_rate"] = self.reserve_hit_rate
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PoolSnapshot:
        """Rebuild a snapshot from :meth:`as_dict` output (extra keys are ignored, so a newer writer
        may add fields; counters an older writer lacks read as 0); ``ValueError`` on a foreign schema or
        a missing field."""
        schema = data.get("schema", SNAPSHOT_SCHEMA)
        if schema != SNAPSHOT_SCHEMA:
            raise ValueError(f"unknown pool snapshot schema {schema!r} (this build reads {SNAPSHOT_SCHEMA})")
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name in data:
                kwargs[f.name] = data[f.name]
            elif f.default is dataclasses.MISSING:
                raise ValueError(f"pool snapshot lacks field {f.name!r}")
        kwargs["state"] = PoolState(kwargs["state"])
        return cls(**kwargs)
