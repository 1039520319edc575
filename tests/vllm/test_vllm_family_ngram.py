"""Speculative decoding with n-gram (prompt lookup) drafts on the elastic backend
(:data:`vllm_families.FAMILIES` ``"ngram"``: a tiny ``LlamaForCausalLM``, three draft tokens a step).
N-gram drafts come from the sequence's own tokens: no draft model and no KV cache of their own. Each step
verifies the drafts in the target model, so a request takes slots for its lookahead tokens, and the
blocks they need come through the same admission as any other (``num_lookahead_tokens``). Tokens rejected
by the verification leave KV in slots that the next step overwrites, as with the native cache.

Besides the family checks, drafts must actually be accepted: otherwise the engine never verified more
than one token a step, and the lookahead path went unproven.
"""

from __future__ import annotations

from typing import Any

import pytest
from vllm_families import FAMILIES, FamilyChecks, generate

pytestmark = pytest.mark.vllm

FAMILY = FAMILIES["ngram"]


def _counter(llm: Any, name: str) -> int:
    return int(sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == name))


class TestNgram(FamilyChecks):
    family = FAMILY

    def test_drafts_are_proposed_and_accepted(self, family_llm: Any) -> None:
        drafts = _counter(family_llm, "vllm:spec_decode_num_draft_tokens")
        accepted = _counter(family_llm, "vllm:spec_decode_num_accepted_tokens")
        generate(family_llm, FAMILY.prompts())
        assert _counter(family_llm, "vllm:spec_decode_num_draft_tokens") > drafts, "no draft was proposed"
        assert _counter(family_llm, "vllm:spec_decode_num_accepted_tokens") > accepted, "no draft accepted"
