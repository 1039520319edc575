"""The page_size 1 allocator: SGLang's ``TokenToKVPoolAllocator`` over ledger blocks of token slots.

One ledger block per slot would cost a ledger call per token on the decode path, so a block is a chunk of
``rows_per_block`` token slots (``ELASTIC_KV_SGLANG_TOKEN_CHUNK``). Allocation stays SGLang's slice of the
free-slot tensor; a short free list grows by whole chunks; a chunk goes back to the ledger once all its
slots are free again (checked after at least a chunk's worth of frees, by one ``bincount`` over the free
list, which is then sorted so that low, already backed chunks fill first and high ones drain). What the
elastic allocators share is :mod:`sglang_elastic_kv.allocator.base`.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

from sglang_elastic_kv import compat, drain
from sglang_elastic_kv.allocator.base import ElasticAllocatorMixin

__all__ = ["ElasticTokenToKVPoolAllocator"]


class ElasticTokenToKVPoolAllocator(ElasticAllocatorMixin, TokenToKVPoolAllocator):
    """``TokenToKVPoolAllocator`` (page_size 1) over ledger blocks of ``rows_per_block`` token slots."""

    def __init__(self, size: int, dtype: torch.dtype, device: str, kvcache: Any, need_sort: bool) -> None:
        self._ledger = self._ledger_of(kvcache)
        chunk = int(self._elastic_pool.rows_per_block)
        self._chunk = chunk
        self._num_chunks = -(-(size + 1) // chunk)
        # Slots a chunk contributes: slot 0 (padding) is never handed out; the last chunk may be short.
        cap = torch.full((self._num_chunks,), chunk, dtype=torch.int64)
        cap[0] -= 1
        cap[-1] = (size + 1) - (self._num_chunks - 1) * chunk - (1 if self._num_chunks == 1 else 0)
        self._cap_cpu = cap
        self._last_chunk = self._num_chunks - 1
        self._chunk_offsets = torch.arange(chunk, dtype=torch.int64)
        self._grow_step = self._elastic_pool.elastic.geometry.blocks_per_page
        self._cap = cap.to(device)
        super().__init__(size, dtype, device, kvcache, need_sort)
        compat.check_instance(self, "sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator")

    # -- bookkeeping -------------------------------------------------------------------------------

    def clear(self) -> None:
        """Free every slot and give every chunk but the padding one back to the ledger (unmapped there)."""
        super().clear()
        self._ledger.clear()
        self._ledger.release_through(self._ledger.epoch)  # clear() runs with the engine idle
        # Chunk 0 is the ledger's null block: always backed, so its slots 1..chunk-1 are always usable.
        self._owned = torch.zeros(self._num_chunks, dtype=torch.bool, device=self.device)
        self._backed_tokens = int(self._cap_cpu[0])
        self.free_pages = torch.arange(1, 1 + self._backed_tokens, dtype=torch.int64, device=self.device)
        # Free slots on draining pages, out of the free list until their chunk empties or the drain ends.
        self._withheld = torch.empty((0,), dtype=torch.int64, device=self.device)
        self._freed_since_check = 0

    def _held_blocks(self) -> int:
        return int(self._owned.sum())

    def available_size(self) -> int:
        """Logical free slots (backed or not): ``size`` minus the slots SGLang holds."""
        held = self._backed_tokens - len(self.free_pages) - len(self.release_pages) - len(self._withheld)
        return self.size - held

    def elastic_available_size(self) -> int:
        """Free backed slots plus the slots of every block the ledger can still back now."""
        backed_free = len(self.free_pages) + len(self.release_pages)
        return min(self.available_size(), backed_free + self._ledger.available_size() * self._chunk)

    # -- allocation ---------------------------------------------------------------------------------

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """SGLang's ``alloc``; a free list shorter than ``need_size`` first grows by whole backed chunks."""
        if not self.ensure_backed(need_size):
            return None
        self._promised = 0
        result: torch.Tensor | None = super().alloc(need_size)
        return result

    def ensure_backed(self, num_pages: int) -> bool:
        """At least ``num_pages`` backed free slots (see :meth:`ElasticAllocatorMixin.ensure_backed`)."""
        if num_pages > len(self.free_pages):
            self.merge_and_sort_free()
            short = num_pages - len(self.free_pages)
            if short > 0 and not self._grow(short):
                return False
        return True

    def give_back_unused(self) -> None:
        """Chunks whose slots are all free go back to the ledger (see
        :meth:`ElasticAllocatorMixin.give_back_unused`)."""
        self._release_empty_chunks()

    def _grow(self, tokens: int) -> bool:
        """Take chunks from the ledger until ``tokens`` more slots are backed; all or nothing.

        Asks for a whole logical page of chunks at a time when the ledger can back it (a page is mapped as
        one unit anyway, so its other chunks cost no memory), which keeps ledger calls off most decode
        steps; under pressure it asks for just what is missing.
        """
        need = -(-tokens // self._chunk)
        new = self._ledger.alloc(self._grow_step) if self._grow_step > need else None
        if new is None:
            new = self._ledger.alloc(need)
            if new is None:
                return False
        got = self._slots_in(new)
        if got < tokens:  # the short last chunk was among them: one more round
            more = self._ledger.alloc(-(-(tokens - got) // self._chunk))
            if more is None:
                self._ledger.free(new)
                return False
            new += more
            got += self._slots_in(more)
        ids = torch.tensor(new, dtype=torch.int64)
        slots = (ids[:, None] * self._chunk + self._chunk_offsets).reshape(-1)
        if self._last_chunk in new:
            slots = slots[slots <= self.size]
        slots = slots.to(self.device)
        self.free_pages = torch.cat((self.free_pages, slots))
        self._owned[ids.to(self.device)] = True
        self._backed_tokens += got
        return True

    def _slots_in(self, chunks: list[int]) -> int:
        got = len(chunks) * self._chunk
        if self._last_chunk in chunks:
            got -= self._chunk - int(self._cap_cpu[self._last_chunk])
        return got

    def free(self, free_index: torch.Tensor) -> None:
        """SGLang's ``free``; then chunks whose slots are all free again go back to the ledger."""
        super().free(free_index)
        if self.free_group is None and free_index.numel() > 0:
            self._freed_since_check += free_index.numel()
            if self._freed_since_check >= self._chunk:
                self._release_empty_chunks()

    def _follow_drain(self) -> None:
        """Free slots on draining pages leave the free list (their chunks go back to the ledger as they
        empty); when no page drains any more, they return to it. Not while a decode check's promise is
        open (:meth:`elastic_promise`): the next step's housekeeping does it."""
        if self._promised:
            return
        on_draining = drain.draining_page_mask(self._ledger, self.device)
        if on_draining is not None:
            self.merge_and_sort_free()
            free = self.free_pages
            withhold = on_draining[free // (self._chunk * self._grow_step)]
            if bool(withhold.any()):
                self._withheld = torch.cat((self._withheld, free[withhold]))
                self.free_pages = free[~withhold]
            self._release_empty_chunks()
        elif len(self._withheld):
            self.free_pages = torch.sort(torch.cat((self.free_pages, self._withheld))).values
            self._withheld = self._withheld[:0]

    def _release_empty_chunks(self) -> None:
        if self._promised:  # the promised slots stay backed until the decode allocation takes them
            return
        self._freed_since_check = 0
        self.merge_and_sort_free()
        free, withheld = self.free_pages, self._withheld
        counts = torch.bincount(torch.cat((free, withheld)) // self._chunk, minlength=self._num_chunks)
        empty = (counts == self._cap) & self._owned
        chunks = empty.nonzero().flatten()
        if chunks.numel() == 0:
            return
        # Low slots first: backed chunks fill densely, high ones drain and can be returned.
        self.free_pages = torch.sort(free[~empty[free // self._chunk]]).values
        self._withheld = withheld[~empty[withheld // self._chunk]]
        self._owned[chunks] = False
        released = chunks.tolist()
        self._backed_tokens -= int(self._cap_cpu[released].sum())
        self._ledger.free(released)
