"""How many backed free pages a pool keeps ready: the reserve's watermarks, sized from recent growth.

Mapping a page costs driver time (tens of microseconds per handle on CUDA, per layer and K/V), so a pool
keeps a *reserve* of backed, empty pages and refills it in the background: in steady state ``alloc`` never
waits for the driver. Too large a reserve holds memory an idle engine does not need, so the reserve follows
demand: :class:`ReservePolicy` remembers how many pages the pool took into use in each of the last
``window`` maintenance intervals (one per engine step) and aims to hold as many as the largest of them,
clamped to ``[min_pages, max_pages]``. A burst like the biggest recent one is then served without a driver
call; after ``window`` quiet steps the reserve shrinks back to ``min_pages``. Demand the engine announces
(:meth:`ReservePolicy.note_expected`: requests arrived, their prompts not yet allocated) counts like pages
taken into use in that interval, so the pages mapped ahead for it are not trimmed before they are used.

Steps that leave the GPU bound by memory bandwidth (decode) run slower beside page-table updates and
memsets, while compute-bound steps (prefill) do not (``docs/results.md``). So during such *light* steps
the ledger aims only at :attr:`ReservePolicy.light_target` -- what light steps themselves took, at least
``min_pages`` -- and neither refills the reserve up to what the heavy steps took nor trims it below
``max_pages``: a reserve filled during the prefills is used up by the decode steps that follow, instead of
being refilled beside them and unmapped at the idle transition.
"""

from __future__ import annotations

from collections import deque

__all__ = ["ReservePolicy"]


class ReservePolicy:
    """Reserve target from recent page demand (see the module docstring). Not thread-safe: the ledger
    calls it under its own lock."""

    __slots__ = ("_current", "_expected", "_history", "_light", "_max", "_min", "_target")

    def __init__(self, min_pages: int, max_pages: int, window: int) -> None:
        if not 0 <= min_pages <= max_pages or window < 1:
            raise ValueError(f"need 0 <= min_pages ({min_pages}) <= max_pages ({max_pages}) and window >= 1")
        self._min, self._max = min_pages, max_pages
        self._history: deque[int] = deque(maxlen=window)
        self._light: deque[bool] = deque(maxlen=window)  # whether each interval of the history was light
        self._current = 0
        self._expected = 0
        self._target = min_pages

    @property
    def target(self) -> int:
        """Pages the reserve should hold now."""
        return self._target

    def note_acquired(self, pages: int) -> None:
        """``pages`` empty pages were just taken into use; a burst above the target raises it at once."""
        self._current += pages
        self._raise_target()

    def note_expected(self, pages: int) -> None:
        """The engine expects to take about ``pages`` empty pages into use soon; the interval's demand is
        at least that (it raises the target at once, like :meth:`note_acquired`)."""
        self._expected = max(self._expected, pages)
        self._raise_target()

    def _demand(self) -> int:
        """The current interval's demand: pages taken into use, or expected if more."""
        return max(self._current, self._expected)

    def _raise_target(self) -> None:
        """Demand above the target raises it at once (up to ``max_pages``); it falls between intervals."""
        demand = self._demand()
        if demand > self._target:
            self._target = min(self._max, demand)

    def end_interval(self, light: bool = False) -> int:
        """Close the current interval (one engine step; ``light``: a step that leaves the GPU bound by
        memory bandwidth, such as decode) and return the new target."""
        self._history.append(self._demand())
        self._light.append(light)
        self._current = self._expected = 0
        self._target = min(self._max, max(self._min, max(self._history)))
        return self._target

    @property
    def light_target(self) -> int:
        """Pages the reserve should hold during light steps: as many as the largest demand of the light
        intervals in the window, at least ``min_pages`` and one page (so that the first light step to need
        a page finds one), never more than the target."""
        light = (d for d, is_light in zip(self._history, self._light, strict=True) if is_light)
        return min(self._target, max(self._min, 1, max(light, default=0)))
