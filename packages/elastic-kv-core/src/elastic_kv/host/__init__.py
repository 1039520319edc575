"""Host memory shared by the engines of one host: :class:`HostArena`, where asleep models keep their weights
(see :mod:`elastic_kv.host.arena`)."""

from elastic_kv.host.arena import ALIGN, ENV_HOST_ARENA, MAX_EXTENTS, Extent, HostArena

__all__ = ["ALIGN", "ENV_HOST_ARENA", "MAX_EXTENTS", "Extent", "HostArena"]
