"""The seam between the coordinator and its ranks: one request broadcast, one outcome per rank.

The protocol is designed so that every request is *identical for every rank* (the rank's own index is never in
the request; rollback and abort go to all ranks and are no-ops where nothing was done). So a transport needs
one primitive only -- broadcast and gather -- which is exactly what an engine's worker RPC offers (vLLM's
``collective_rpc``: one call to every worker, a list of replies in rank order). Three implementations:

* :class:`InProcessTransport` -- the rank objects live in the caller's process (TP=1 with the worker inside
  the scheduler's process): a direct call, request and reply objects passed by reference, nothing encoded;
* :class:`BroadcastTransport` -- any "send these bytes to every rank, give me their bytes back" function: the
  adapter for an engine's RPC (the vLLM package wraps ``collective_rpc`` with it);
* :class:`elastic_kv.ranks.local.SocketTransport` -- Unix sockets, for processes on one host that share no
  engine channel.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from elastic_kv.ranks.messages import MessageError, Reply, Request, decode_reply, encode_request
from elastic_kv.ranks.rank import Rank

__all__ = ["BroadcastTransport", "InProcessTransport", "NoReply", "Outcome", "Transport"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class NoReply:
    """A rank gave no usable reply: the request may or may not have been applied there.

    ``gone`` is True when the rank will never answer again (its process died, its endpoint closed); False
    for a timeout or a garbled reply, after which the rank may still answer a retry.
    """

    rank: int
    reason: str
    gone: bool = False


Outcome = Reply | NoReply


class Transport(Protocol):
    """Carries one request to every rank and returns each rank's outcome, in rank order.

    Contract for implementations:

    * ``broadcast`` returns exactly ``world_size`` outcomes, outcome ``i`` for rank ``i``; it never raises for
      a rank's failure (that is a :class:`NoReply`), only for a programming error;
    * it returns within about ``timeout`` seconds; a rank that has not answered by then is a
      ``NoReply(gone=False)``, and its late reply must never be returned for a later request (match
      ``Reply.request_id``);
    * the same request may be broadcast again (a retry); ranks treat duplicates idempotently;
    * calls are not concurrent (the coordinator serializes them); ``close`` may be called from another thread
      and wakes a broadcast in progress where the channel allows it (its pending ranks become
      ``NoReply(gone=True)``); an engine RPC that cannot be interrupted ends at its own timeout instead.
    """

    @property
    def world_size(self) -> int:
        """Number of ranks (all pipeline stages times all tensor-parallel ranks)."""
        ...

    def broadcast(self, request: Request, timeout: float) -> list[Outcome]:
        """Send ``request`` to every rank; return their outcomes in rank order."""
        ...

    def close(self) -> None:
        """Release the transport's resources; later broadcasts answer ``NoReply(gone=True)`` for all ranks."""
        ...


class InProcessTransport:
    """Ranks in the caller's process: ``Rank.dispatch`` called directly, nothing copied or encoded.

    A direct call cannot time out: ``timeout`` is ignored (the data-plane calls are bounded by themselves).
    """

    def __init__(self, ranks: Sequence[Rank]) -> None:
        """``ranks[i]`` must be rank ``i``."""
        for i, rank in enumerate(ranks):
            if rank.rank != i:
                raise ValueError(f"ranks[{i}] is rank {rank.rank}")
        self._ranks = list(ranks)
        self._closed = False

    @property
    def world_size(self) -> int:
        return len(self._ranks)

    def broadcast(self, request: Request, timeout: float) -> list[Outcome]:
        if self._closed:
            return [NoReply(i, "transport closed", gone=True) for i in range(len(self._ranks))]
        return [rank.dispatch(request) for rank in self._ranks]

    def close(self) -> None:
        self._closed = True


class BroadcastTransport:
    """Adapter for an engine's own worker RPC: ``call(payload, timeout)`` delivers ``payload`` to every rank,
    hands it to ``Rank.handle`` there, and returns the ranks' reply bytes in rank order.

    The RPC is all-or-nothing (like ``collective_rpc``): if ``call`` raises, every rank's outcome is unknown.
    Exceptions of the types in ``gone_errors`` mean the ranks are gone for good (the engine's executor died);
    anything else (``TimeoutError`` included) means "no reply this time". ``close`` cannot interrupt a call in
    progress (the engine's RPC ends at ``timeout``); it makes later broadcasts answer "gone" at once.
    """

    def __init__(
        self,
        call: Callable[[bytes, float], Sequence[bytes]],
        world_size: int,
        *,
        gone_errors: tuple[type[BaseException], ...] = (ConnectionError, EOFError),
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self._call = call
        self._world_size = world_size
        self._gone_errors = gone_errors
        self._closed = False

    @property
    def world_size(self) -> int:
        return self._world_size

    def broadcast(self, request: Request, timeout: float) -> list[Outcome]:
        n = self._world_size
        if self._closed:
            return [NoReply(i, "transport closed", gone=True) for i in range(n)]
        payload = encode_request(request)
        try:
            replies = list(self._call(payload, timeout))
        except self._gone_errors as exc:
            return [NoReply(i, f"engine RPC failed: {exc!r}", gone=True) for i in range(n)]
        except Exception as exc:
            return [NoReply(i, f"engine RPC failed: {exc!r}") for i in range(n)]
        if len(replies) != n:
            return [NoReply(i, f"engine RPC returned {len(replies)} replies for {n} ranks") for i in range(n)]
        outcomes: list[Outcome] = []
        for i, data in enumerate(replies):
            try:
                outcomes.append(decode_reply(data))
            except (MessageError, TypeError) as exc:
                logger.warning("rank %d: undecodable reply: %s", i, exc)
                outcomes.append(NoReply(i, f"undecodable reply: {exc}"))
        return outcomes

    def close(self) -> None:
        self._closed = True
