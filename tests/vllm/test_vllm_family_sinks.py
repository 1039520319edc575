"""Attention sinks beside sliding-window and full attention, MoE MLPs (gpt-oss) on the elastic backend
(:data:`vllm_families.FAMILIES` ``"sinks"``: a tiny ``GptOssForCausalLM``). Sinks are one learned logit
per head inside the attention kernel, not KV cache: the KV cache groups are a sliding-window and a
full-attention one, and both layers have sinks.
"""

from __future__ import annotations

import pytest
from vllm_families import FAMILIES, FamilyChecks

pytestmark = pytest.mark.vllm


class TestSinks(FamilyChecks):
    family = FAMILIES["sinks"]
