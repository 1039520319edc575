"""Cross-layer KV sharing (Gemma 3n/4) on the elastic backend (:data:`vllm_families.FAMILIES`
``"kv_sharing"``: a tiny ``Gemma4ForCausalLM`` whose last two layers read the KV cache of the first two).
Shared layers have no KV cache group of their own: vLLM binds them the tensor of the layer they read,
so the elastic pool backs exactly the owners' blocks.
"""

from __future__ import annotations

import pytest
from vllm_families import FAMILIES, FamilyChecks

pytestmark = pytest.mark.vllm


class TestKVSharing(FamilyChecks):
    family = FAMILIES["kv_sharing"]
