"""Chunked local attention beside full attention, MoE MLPs (Llama 4) on the elastic backend
(:data:`vllm_families.FAMILIES` ``"chunked_local"``: a tiny ``Llama4ForCausalLM``, chunks of 256 tokens).
vLLM drops a chunked-local group's blocks of earlier chunks as a request moves past them.
"""

from __future__ import annotations

import pytest
from vllm_families import FAMILIES, FamilyChecks

pytestmark = pytest.mark.vllm


class TestChunkedLocal(FamilyChecks):
    family = FAMILIES["chunked_local"]
