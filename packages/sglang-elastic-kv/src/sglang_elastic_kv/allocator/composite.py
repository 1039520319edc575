"""What SGLang's two sliding-window allocators do alike over their elastic parts.

:class:`~.swa.ElasticSWATokenToKVPoolAllocator` (a full-attention side and a sliding-window side, two pools)
and :class:`~.pure_swa.ElasticPureSWAAllocator` (one pool serving both faces) are composites: SGLang's free
groups, decode checks, idle diagnostic and sleep reach the composite, which drives its elastic sub-allocators
(:meth:`ElasticCompositeMixin.elastic_parts`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["ElasticCompositeMixin"]


class ElasticCompositeMixin:
    """Mixed in before SGLang's SWA allocator class. ``swa_attn_allocator`` is the elastic part SGLang's
    own free groups do not reach (it frees that side outside any group of its own), so its release epoch
    and step housekeeping are driven from the composite's group."""

    swa_attn_allocator: Any
    # Names of the parts in the idle diagnostic's messages (one part: none).
    _part_names: tuple[str, ...] = ()

    def elastic_parts(self) -> tuple[Any, ...]:
        """The elastic allocators this composite drives."""
        raise NotImplementedError

    def elastic_evict(self, tree_cache: Any, num_tokens: int = 0, max_cached_tokens: int = 0) -> None:
        """Evict prefix-cache entries as ``evict_shortfall`` says for each part's side of the cache."""
        raise NotImplementedError

    def evict_to_free_tokens(self, tree_cache: Any, num_tokens: int) -> None:
        """SGLang's eviction before an allocation: :meth:`elastic_evict` for ``num_tokens``."""
        self.elastic_evict(tree_cache, num_tokens)

    def check_decode_capacity(
        self, *, num_tokens: int, tree_cache: Any, requests: Any = None, spec_algorithm: Any = None
    ) -> bool:
        """Whether the next decode step's ``num_tokens`` are backed in every part after eviction (and kept
        for it: ``elastic_promise``; a part that cannot back them makes the others give theirs back), and
        no request must be retracted for a part's drain; False makes SGLang retract requests
        (``ScheduleBatch.retract_decode``)."""
        self.elastic_evict(tree_cache, num_tokens)
        parts = self.elastic_parts()
        if any(part.elastic_must_retract(requests) for part in parts):
            return False
        for i, part in enumerate(parts):
            if not part.elastic_promise(num_tokens):
                for done in parts[:i]:
                    done.elastic_withdraw_promise()
                return False
        return True

    def free_group_begin(self) -> None:
        """SGLang's free group on the composite, and the SWA part's release epoch."""
        super().free_group_begin()  # type: ignore[misc]
        self.swa_attn_allocator.elastic_step_begin()

    def free_group_end(self) -> None:
        """SGLang's grouped frees, then the SWA part's step housekeeping."""
        super().free_group_end()  # type: ignore[misc]
        self.swa_attn_allocator.elastic_step_end()

    def verify_byte_accounting(self) -> list[str]:
        """SGLang's idle diagnostic on every part (see ``ElasticAllocatorMixin.verify_byte_accounting``),
        each violation prefixed with its part's name where there are several."""
        violations: list[str] = []
        for i, part in enumerate(self.elastic_parts()):
            prefix = f"{self._part_names[i]}: " if self._part_names else ""
            violations += [prefix + text for text in part.verify_byte_accounting()]
        return violations

    def elastic_over_limit(self) -> bool:
        """True while any part's pool holds more than its limit."""
        return any(part.elastic_over_limit() for part in self.elastic_parts())

    def elastic_note_retracted(self, requests: int) -> None:
        """Count retracted requests once, in the first part's snapshot."""
        self.elastic_parts()[0].elastic_note_retracted(requests)

    def elastic_sleep(self) -> None:
        """The pools released their KV memory (``release_memory_occupation``): unmap every reserve."""
        for part in self.elastic_parts():
            part.elastic_sleep()

    def elastic_wake(self) -> None:
        """The pools map on demand again."""
        for part in self.elastic_parts():
            part.elastic_wake()
