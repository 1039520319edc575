"""Gated DeltaNet linear attention beside full attention (Qwen3-Next, Qwen3.5) on the elastic backend
(:data:`vllm_families.FAMILIES` ``"gdn"``: a tiny ``Qwen3NextForCausalLM``, three GDN layers and one
full-attention layer, MoE MLPs). vLLM gives a GDN layer's state (its convolution window and its recurrent
state matrix) a ``MambaSpec``: one state block per sequence from the same block pool as the attention
blocks, padded to the attention block, so the elastic pool backs state and attention blocks alike. The
CPU GDN kernels are batch-variant, so tokens are compared one sequence at a time; with prefix caching
vLLM checkpoints states (``mamba_cache_mode='align'``), which is refused, so the family runs without it.
"""

from __future__ import annotations

import pytest
from vllm_families import FAMILIES, FamilyChecks

pytestmark = pytest.mark.vllm


class TestGDN(FamilyChecks):
    family = FAMILIES["gdn"]
