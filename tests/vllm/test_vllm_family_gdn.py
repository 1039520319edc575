"""Gated DeltaNet linear attention beside full attention (Qwen3-Next, Qwen3.5) on the elastic backend
(:data:`vllm_families.FAMILIES` ``"gdn"``: a tiny ``Qwen3NextForCausalLM``, three GDN layers and one
full-attention layer, MoE MLPs). vLLM gives a GDN layer's state (its convolution window and its recurrent
state matrix) a ``MambaSpec``: one state block per sequence from the same block pool as the attention
blocks, padded to the attention block, so the elastic pool backs state and attention blocks alike. With
prefix caching on (vLLM's default, and how users start Qwen3-Next and Qwen3.5) vLLM also keeps a state
checkpoint at each cached block boundary (``mamba_cache_mode='align'``): more state blocks from the same
pool, freed and reused as vLLM's block pool frees them. The CPU GDN kernels are batch-variant, so tokens
are compared one sequence at a time.
"""

from __future__ import annotations

from typing import Any

import pytest
from vllm_families import FAMILIES, FamilyChecks, hit_run

pytestmark = pytest.mark.vllm


class TestGDN(FamilyChecks):
    family = FAMILIES["gdn"]

    def test_state_checkpoints_are_kept_and_hit(self, family_llm: Any) -> None:
        """The engine keeps state checkpoints (``align``), and a request that shares a cached prefix starts
        from one (its tokens equal pure vLLM's in :meth:`test_greedy_tokens_equal_native`, run ``hit``)."""
        assert family_llm.llm_engine.vllm_config.cache_config.mamba_cache_mode == "align"

        def hits() -> int:
            return int(sum(m.value for m in family_llm.get_metrics() if m.name == "vllm:prefix_cache_hits"))

        before = hits()
        hit_run(family_llm, self.family.prompts())
        assert hits() - before >= 384, f"{hits() - before} tokens came from the prefix cache (one block: 384)"
