"""A pool's records on several devices: :class:`DeviceShare` and :func:`create_shares`.

A pool whose ranks back every page on several devices (tensor parallelism over GPUs) has one
:class:`~elastic_kv.registry.record.PoolRecord` per device: the primary one under the pool's name, the
others named ``<name>.r<rank>`` after the first rank on their device; each is charged for the ranks on its
device, so every device's budget sees the bytes really backed on it.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from elastic_kv.registry.record import PoolRecord

__all__ = ["DeviceShare", "create_shares"]


@dataclass(frozen=True, slots=True)
class DeviceShare:
    """One of a pool's records: ``ranks`` of the pool's ranks back each of its pages on ``record.device``."""

    record: PoolRecord
    ranks: int

    def __post_init__(self) -> None:
        if self.ranks < 1:
            raise ValueError(f"a device share stands for >= 1 rank, got {self.ranks}")


def create_shares(
    name: str,
    rank_devices: Sequence[str],
    *,
    engine: str,
    model: str,
    limit_bytes: int,
    registry_dir: Path | None = None,
    device_total_bytes: Mapping[str, int] | None = None,
    suffix_if_taken: bool = False,
) -> list[DeviceShare]:
    """The records of a pool whose rank ``r`` backs every page on device ``rank_devices[r]``.

    One record per distinct device, in the order of their first rank: the first (rank 0's device) is
    named ``name`` (or a free suffix of it, see :meth:`PoolRecord.create`), the others
    ``<chosen name>.r<first rank on the device>``. ``limit_bytes`` (bytes of one device) starts on every
    record; ``device_total_bytes`` gives each device's size where known. Raises like
    :meth:`PoolRecord.create`; on failure the records created so far are closed.
    """
    if not rank_devices:
        raise ValueError("a pool has at least one rank")
    counts = collections.Counter(rank_devices)
    first_rank: dict[str, int] = {}
    for rank, device in enumerate(rank_devices):
        first_rank.setdefault(device, rank)
    totals = device_total_bytes or {}
    shares: list[DeviceShare] = []
    try:
        for device, rank in first_rank.items():
            record = PoolRecord.create(
                name if not shares else f"{shares[0].record.name}.r{rank}",
                device=device,
                engine=engine,
                model=model,
                limit_bytes=limit_bytes,
                registry_dir=registry_dir,
                device_total_bytes=totals.get(device, 0),
                suffix_if_taken=suffix_if_taken and not shares,
            )
            shares.append(DeviceShare(record, counts[device]))
    except BaseException:
        for share in shares:
            share.record.close()
        raise
    return shares
