"""Speculative decoding with n-gram (prompt lookup) drafts on the elastic backend
(:data:`vllm_families.FAMILIES` ``"ngram"``: a tiny ``LlamaForCausalLM``, three draft tokens a step).
N-gram drafts come from the sequence's own tokens: no draft model and no KV cache of their own. Each step
verifies the drafts in the target model, so a request takes slots for its lookahead tokens, and the
blocks they need come through the same admission as any other (``num_lookahead_tokens``). Tokens rejected
by the verification leave KV in slots that the next step overwrites, as with the native cache.

Besides the family checks, drafts must actually be accepted (:class:`vllm_families.SpeculativeChecks`).
"""

from __future__ import annotations

import pytest
from vllm_families import FAMILIES, FamilyChecks, SpeculativeChecks

pytestmark = pytest.mark.vllm


class TestNgram(FamilyChecks, SpeculativeChecks):
    family = FAMILIES["ngram"]
