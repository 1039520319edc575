"""Speculative decoding with a draft model on the elastic backend (:data:`vllm_families.FAMILIES`
``"draft_model"``: a tiny ``LlamaForCausalLM`` drafting two tokens a step for itself). The draft model's
attention layers own KV cache of their own: vLLM puts them in the target's KV cache group (one group of four
layers here), so a block id addresses the block in the target's and the draft's layers alike and one
elastic page backs both. Each step the draft writes the KV of its proposals and the target verifies them
in the lookahead slots the admission bound counts.
"""

from __future__ import annotations

import pytest
from vllm_families import FAMILIES, FamilyChecks, SpeculativeChecks

pytestmark = pytest.mark.vllm


class TestDraftModel(FamilyChecks, SpeculativeChecks):
    family = FAMILIES["draft_model"]
