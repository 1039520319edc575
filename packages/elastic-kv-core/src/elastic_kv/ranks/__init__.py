"""Ranks protocol: one coordinator, many processes that own device memory (tensor x pipeline parallel ranks).

* :class:`Coordinator` -- the ``PageMapper`` the ledger drives; fans every request out to all ranks.
* :class:`CoordinatorMapper` -- a coordinator as the ledger's asynchronous mapper: background maps, and
  releases that do not make the engine wait.
* :class:`Rank` -- the state machine in each rank process, applying requests to its ``SpaceGroup``\\ s.
* :class:`Transport` -- the seam between them: :class:`InProcessTransport` (direct call),
  :class:`BroadcastTransport` (an engine's worker RPC), :class:`SocketTransport` + :class:`SocketListener`
  (Unix sockets on one host).
* :mod:`elastic_kv.ranks.messages` -- the binary, versioned wire format.

See ``docs/ARCHITECTURE.md`` (section "Ranks") for the contract.
"""

from elastic_kv.ranks.coordinator import Coordinator, RankStatus
from elastic_kv.ranks.fence import Completion, EpochFence
from elastic_kv.ranks.listener import SocketListener
from elastic_kv.ranks.local import SocketTransport
from elastic_kv.ranks.mapper import CoordinatorMapper
from elastic_kv.ranks.messages import NO_EPOCH, PROTOCOL_VERSION, RankInfo
from elastic_kv.ranks.rank import Rank, RankTarget
from elastic_kv.ranks.sockets import new_instance_name, socket_dir, socket_path
from elastic_kv.ranks.transport import BroadcastTransport, InProcessTransport, NoReply, Outcome, Transport

__all__ = [
    "NO_EPOCH",
    "PROTOCOL_VERSION",
    "BroadcastTransport",
    "Completion",
    "Coordinator",
    "CoordinatorMapper",
    "EpochFence",
    "InProcessTransport",
    "NoReply",
    "Outcome",
    "Rank",
    "RankInfo",
    "RankStatus",
    "RankTarget",
    "SocketListener",
    "SocketTransport",
    "Transport",
    "new_instance_name",
    "socket_dir",
    "socket_path",
]
