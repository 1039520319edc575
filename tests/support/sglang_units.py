"""Helpers of the in-process SGLang unit tests (``device="cpu"`` SGLang objects, the real ledger and data
plane; no engine)."""

from __future__ import annotations

from typing import Any


def configurator(algorithm: str = "NONE") -> Any:
    """What the allocator builder hook reads of SGLang's configurator (building SGLang's needs a model)."""
    from types import SimpleNamespace

    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    return SimpleNamespace(spec_algorithm=SpeculativeAlgorithm[algorithm], mambaish_config=None)
