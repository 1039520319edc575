"""The page_size > 1 allocator: SGLang's ``PagedTokenToKVPoolAllocator`` whose page ids are ledger blocks.

Pages are taken from the ledger right before an allocation needs them and given back as SGLang frees them
(the ledger keeps the mapped reserve). What the elastic allocators share is
:mod:`sglang_elastic_kv.allocator.base`.
"""

from __future__ import annotations

from typing import Any

import torch
from elastic_kv.errors import ConfigError
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.utils import get_num_new_pages

from sglang_elastic_kv import compat
from sglang_elastic_kv.allocator.base import ElasticAllocatorMixin

__all__ = ["ElasticPagedTokenToKVPoolAllocator"]


class ElasticPagedTokenToKVPoolAllocator(ElasticAllocatorMixin, PagedTokenToKVPoolAllocator):
    """``PagedTokenToKVPoolAllocator`` whose page ids are ledger blocks (block id = SGLang page id)."""

    def __init__(
        self, size: int, page_size: int, dtype: torch.dtype, device: str, kvcache: Any, need_sort: bool
    ) -> None:
        self._ledger = self._ledger_of(kvcache)
        if int(self._elastic_pool.rows_per_block) != page_size:
            raise ConfigError(
                f"elastic paged allocator: the pool's blocks hold {self._elastic_pool.rows_per_block} slots, "
                f"the allocator's pages {page_size} (DCP-widened pages are not supported)"
            )
        self._owned_pages = 0
        super().__init__(size, page_size, dtype, device, kvcache, need_sort)
        compat.check_instance(self, "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator")

    def clear(self) -> None:
        """Free every page and give all of them back to the ledger."""
        super().clear()
        self._ledger.clear()
        self._ledger.release_through(self._ledger.epoch)  # clear() runs with the engine idle
        self._owned_pages = 0
        self.free_pages = torch.empty((0,), dtype=torch.int64, device=self.device)

    def _held_blocks(self) -> int:
        return self._owned_pages

    def available_size(self) -> int:
        """Logical free slots: every page SGLang does not hold, backed or not."""
        held = self._owned_pages - len(self.free_pages) - self.num_staged_pages
        return (self.num_pages - held) * self.page_size

    def elastic_available_size(self) -> int:
        """Free backed pages plus the pages the ledger can still back now, in slots."""
        backable = len(self.free_pages) + self.num_staged_pages + self._ledger.available_size()
        return min(self.available_size(), backable * self.page_size)

    def ensure_backed(self, num_pages: int) -> bool:
        """Make ``free_pages`` hold at least ``num_pages`` backed pages (ledger blocks); all or nothing."""
        if num_pages <= len(self.free_pages):
            return True
        self.merge_and_sort_free()
        short = num_pages - len(self.free_pages)
        if short <= 0:
            return True
        new = self._ledger.alloc(short)
        if new is None:
            return False
        self.free_pages = torch.cat(
            (self.free_pages, torch.tensor(new, dtype=torch.int64, device=self.device))
        )
        self._owned_pages += len(new)
        return True

    def give_back_unused(self) -> None:
        """Every backed free page goes back to the ledger (:meth:`ElasticAllocatorMixin.give_back_unused`);
        SGLang's frees go straight to the ledger here, so a free page is one backed ahead of use."""
        self.merge_and_sort_free()
        if len(self.free_pages):
            ids = self.free_pages.tolist()
            self.free_pages = torch.empty((0,), dtype=torch.int64, device=self.device)
            self._ledger.free(ids)
            self._owned_pages -= len(ids)

    def _follow_drain(self) -> None:
        """Pages backed ahead of use go back to the ledger while pages drain (SGLang's frees already go
        straight to it), so none on a draining page is handed out; not those a decode check promised."""
        if self._ledger.draining and not self._promised:
            self.give_back_unused()

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """SGLang's page-aligned ``alloc`` after backing the pages it will take."""
        if not self.ensure_backed(need_size // self.page_size):
            return None
        self._promised = 0
        result: torch.Tensor | None = super().alloc(need_size)
        return result

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
        num_new_pages: int | None = None,
    ) -> torch.Tensor | None:
        """SGLang's ``alloc_extend`` after backing exactly the new pages it needs (counted on the CPU)."""
        if num_new_pages is None:
            num_new_pages = get_num_new_pages(
                seq_lens=seq_lens_cpu, page_size=self.page_size, prefix_lens=prefix_lens_cpu
            )
        if not self.ensure_backed(num_new_pages):
            return None
        result: torch.Tensor | None = super().alloc_extend(
            prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens, num_new_pages
        )
        return result

    def alloc_decode(
        self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor
    ) -> torch.Tensor | None:
        """SGLang's ``alloc_decode``; when the backed free pages do not cover the requests that start a
        page this step (SGLang answers None before touching anything), back them and ask again."""
        result: torch.Tensor | None = super().alloc_decode(seq_lens, seq_lens_cpu, last_loc)
        if result is None:
            needed = get_num_new_pages(seq_lens=seq_lens_cpu, page_size=self.page_size, decode=True)
            if not self.ensure_backed(needed):
                return None
            result = super().alloc_decode(seq_lens, seq_lens_cpu, last_loc)
        self._promised = 0
        return result

    def _release_page_ids(self, *page_ids: torch.Tensor) -> None:
        # Every page SGLang frees goes straight back to the ledger, which keeps a mapped reserve of its
        # own; nothing is staged here, so need_sort (PD) ordering is the ledger's.
        ids = torch.cat(page_ids).tolist() if len(page_ids) > 1 else page_ids[0].tolist()
        if ids:
            self._ledger.free(ids)
            self._owned_pages -= len(ids)
