"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2) on the elastic backend
(:data:`vllm_families.FAMILIES` ``"mla"``: a tiny ``DeepseekV3ForCausalLM``, one dense and one MoE layer).
An MLA layer caches one latent vector per token (``kv_lora_rank + qk_rope_head_dim`` = 576 values, no
separate K and V), so a 16-token block of one layer is 18 KiB: blocks do not tile the pool's slots, and
pages share the slots where they meet. vLLM's CPU MLA backend (``CPU_MLA``) runs with 16-token blocks,
prefix caching and chunked prefill off, and is batch-variant, so the family runs one sequence at a time.
"""

from __future__ import annotations

import pytest
from vllm_families import FAMILIES, FamilyChecks

pytestmark = pytest.mark.vllm


class TestMLA(FamilyChecks):
    family = FAMILIES["mla"]
