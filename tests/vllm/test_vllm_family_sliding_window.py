"""Hybrid sliding-window + full attention (Gemma 2/3, gpt-oss style) on the elastic backend: vLLM's hybrid
allocator builds three sliding-window groups and one full-attention group over one block pool
(:data:`vllm_families.FAMILIES` ``"sliding_window"``: a tiny ``Gemma3ForCausalLM``, window 200 tokens).

Besides the checks every family passes (:class:`vllm_families.FamilyChecks`), the blocks a sliding-window
group drops as its window moves must return their memory: one long request fits a pool limit that only
its windows fit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from elastic_kv.registry import Registry
from vllm_families import FAMILIES, FamilyChecks, pool_snapshot, preemptions, sampling

pytestmark = pytest.mark.vllm

FAMILY = FAMILIES["sliding_window"]


class TestSlidingWindow(FamilyChecks):
    family = FAMILY

    @pytest.mark.timeout(300)
    def test_a_long_request_fits_a_limit_only_its_windows_fit(self, llm: Any, registry_dir: Path) -> None:
        """300 prompt tokens and 600 generated ones: 8 blocks of 128 tokens in every group, 32 without the
        window; with it, the full-attention group's 8 and at most 3 per sliding-window group (200 tokens)."""
        page = pool_snapshot(registry_dir, FAMILY.name).page_bytes
        limit = 20 * page
        Registry(registry_dir).set_limit(FAMILY.name, limit)
        try:
            assert llm.reset_prefix_cache()
            before = preemptions(llm)
            prompt = [(j * 13) % 997 + 3 for j in range(300)]
            from vllm import SamplingParams

            params = SamplingParams(max_tokens=600, temperature=0.0, ignore_eos=True, detokenize=False)
            with sampling(lambda: self.mapped(registry_dir)) as mapped:
                (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            assert len(out.outputs[0].token_ids) == 600
            assert max(mapped) <= limit
            assert preemptions(llm) == before, "the request did not fit the limit"
        finally:
            Registry(registry_dir).set_limit(FAMILY.name, 0)
