"""The shared-memory registry: every pool's record and every device's budget, visible to all processes
of the user (engines, ``kvctl``, the Prometheus collector).

* :class:`PoolRecord` (:mod:`.record`) -- one pool's record as its owner sees it: charge, poll for
  ``kvctl`` changes, publish statistics; its file is made and removed by :mod:`.record_file`;
  :func:`create_shares` (:mod:`.shares`) for a pool backed on several devices.
* :class:`DeviceBudget` (:mod:`.budget`) -- the GPU-wide budget of one device, shared by its pools.
* :class:`Registry` (:mod:`.registry`) -- the registry from any process: read pools and devices, set
  limits and budgets; what a record says is read by :mod:`.reading`, what dead owners left is reclaimed by
  :mod:`.reclaim`.
* :mod:`.layout` -- the binary, versioned file layouts; :mod:`.files` -- where the registry lives, how its
  files are created and locked, how a dead owner is recognised.

See ``docs/ARCHITECTURE.md`` (section "Limits, registry and observability") for the contract.
"""

from elastic_kv.registry.budget import DeviceBudget
from elastic_kv.registry.files import RegistryConfig
from elastic_kv.registry.layout import UNLIMITED
from elastic_kv.registry.reading import DeviceInfo, LatencyHistogram, PoolInfo
from elastic_kv.registry.reclaim import reclaim_dead
from elastic_kv.registry.record import UNBOUNDED, PoolRecord, RecordEvents
from elastic_kv.registry.registry import LimitNotFollowedError, Registry, UnknownDeviceError, UnknownPoolError
from elastic_kv.registry.shares import DeviceShare, create_shares

__all__ = [
    "UNBOUNDED",
    "UNLIMITED",
    "DeviceBudget",
    "DeviceInfo",
    "DeviceShare",
    "LatencyHistogram",
    "LimitNotFollowedError",
    "PoolInfo",
    "PoolRecord",
    "RecordEvents",
    "Registry",
    "RegistryConfig",
    "UnknownDeviceError",
    "UnknownPoolError",
    "create_shares",
    "reclaim_dead",
]
