"""Tiny models of the families SGLang 0.5.23 serves with their own memory paths: a hybrid sliding-window
(SWA) model and a Qwen3-Next (Mamba / linear-attention state pool, :class:`TinyGDNSpec`).

SGLang routes an architecture to ``SWAKVPool`` / ``SWATokenToKVPoolAllocator`` when
``is_hybrid_swa_model`` (``srt/configs/model_config.py``) lists it. Of the listed architectures,
``LagunaForCausalLM`` (poolside's Laguna: per-layer ``layer_types`` of sliding and full attention) is the
one whose SGLang implementation runs on the CPU engine with ``torch_native`` attention: no attention
sinks (GPT-OSS and Granite-SWA pass ``sinks=`` that ``TorchNativeAttnBackend`` does not take), no
``torch.ops.sgl_kernel`` op at import (Muse Glimmer), and its MLPs may all be dense (``mlp_layer_types``),
so no fused-MoE kernel is needed. The model here is that architecture at toy size with random weights from
a fixed seed, built offline with transformers' own ``LagunaForCausalLM`` and cached under
``.cache/models`` like the tiny Llama of :mod:`tests.support.models`, whose tokenizer it reuses.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tests.support.models import REPO_ROOT, TOKEN_IDS, TinySpec, cached_model, save_random_model, tiny_model

# The test-only SGLang plugin that corrects SGLang 0.5.23's CPU attention for SWA pools (see its module
# docstring). Its directory goes on an SWA engine's PYTHONPATH, native and elastic engines alike.
CPU_FIXES = REPO_ROOT / "tests" / "support" / "sglang_cpu_fixes"
SWA_ENGINE_ENV = {"PYTHONPATH": str(CPU_FIXES)}


@dataclass(frozen=True)
class TinySWASpec(TinySpec):
    """Shape of a tiny Laguna: ``layer_types`` mixes sliding-window and full attention layers."""

    name: str = "tiny-laguna-swa"
    head_dim: int = 32
    # Three sliding-window layers per full one (the common hybrid ratio); the window is small so that
    # test prompts outgrow it and SGLang frees out-of-window tokens while decoding.
    layer_types: tuple[str, ...] = field(
        default=("sliding_attention", "sliding_attention", "sliding_attention", "full_attention")
    )
    sliding_window: int = 32


# Every layer sliding: SGLang serves it with ``PureSWATokenToKVPoolAllocator`` (page_size 1). The window
# is wider than the hybrid's so that a batch of 8 x (48 + 96) tokens holds ~8 x 96 slots at its peak
# (enough to outgrow a lowered limit) while longer requests still free out-of-window slots.
TINY_PURE_SWA = TinySWASpec(
    name="tiny-laguna-pure-swa", layer_types=("sliding_attention",) * 4, sliding_window=96
)


def tiny_swa_model(spec: TinySWASpec = TinySWASpec(), cache_dir: Path | None = None) -> Path:
    """Return the directory of ``spec``'s model, building it once (safe across concurrent processes)."""
    return cached_model(spec.name, asdict(spec), lambda path: _build(spec, path, cache_dir), cache_dir)


def _build(spec: TinySWASpec, path: Path, cache_dir: Path | None) -> None:
    layers = len(spec.layer_types)
    config = {
        **_config(spec),
        "num_hidden_layers": layers,
        "layer_types": list(spec.layer_types),
        "mlp_layer_types": ["dense"] * layers,  # no experts: SGLang's fused MoE has no CPU path here
    }
    tokenizer = tiny_model(cache_dir=cache_dir)
    save_random_model(path, "LagunaConfig", "LagunaForCausalLM", config, spec.seed, tokenizer_from=tokenizer)


def _config(spec: TinySWASpec | TinyGDNSpec) -> dict[str, Any]:
    """The config arguments of ``spec``'s fields (all but its name and seed), with the token ids."""
    fields = {key: value for key, value in asdict(spec).items() if key not in ("name", "seed")}
    return {**fields, **TOKEN_IDS}


# The test-only plugin for the Triton-only steps of SGLang 0.5.23's GDN path on a CPU without AMX (see its
# module docstring); its directory goes on a GDN engine's PYTHONPATH, native and elastic engines alike.
CPU_GDN = REPO_ROOT / "tests" / "support" / "sglang_cpu_gdn"
# SGLang keeps a GDN layer's conv state (the last ``width - 1`` inputs of each request) in bfloat16 unless
# SGLANG_MAMBA_CONV_DTYPE says otherwise, whatever the model's dtype: every decode step of a float32 engine
# then convolves bf16-rounded history (prefill does not: it convolves its own float32 inputs), so decode
# logits drift ~1e-4 from the model's and greedy near-ties (top-2 gaps of that size occur in the tiny model's
# outputs) fall either way with the batch's composition. Float32 conv states make the engine compute the
# model's float32 function (decode logits within ~5e-7 of transformers' float64), as tests compare exactly.
GDN_ENGINE_ENV = {"PYTHONPATH": str(CPU_GDN), "SGLANG_MAMBA_CONV_DTYPE": "float32"}


@dataclass(frozen=True)
class TinyGDNSpec(TinySpec):
    """Shape of a tiny Qwen3-Next: gated-delta-net (linear attention) layers and one full-attention layer
    every ``full_attention_interval``; MoE MLPs with a gated shared expert, as SGLang builds every Qwen3-Next
    layer. SGLang runs it on the CPU with the GDN kernels of the ``sgl_kernel`` stand-in."""

    name: str = "tiny-qwen3-next"
    num_hidden_layers: int = 4
    full_attention_interval: int = 4
    head_dim: int = 32
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 32
    linear_value_head_dim: int = 32
    linear_conv_kernel_dim: int = 4
    num_experts: int = 2
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 64
    shared_expert_intermediate_size: int = 64


def tiny_gdn_model(spec: TinyGDNSpec = TinyGDNSpec(), cache_dir: Path | None = None) -> Path:
    """Return the directory of ``spec``'s model, building it once (safe across concurrent processes)."""
    return cached_model(spec.name, asdict(spec), lambda path: _build_gdn(spec, path, cache_dir), cache_dir)


def _build_gdn(spec: TinyGDNSpec, path: Path, cache_dir: Path | None) -> None:
    # SGLang's Qwen3-Next config derives the layer kinds from full_attention_interval (transformers' from
    # layer_types).
    config = {
        **_config(spec),
        "layer_types": [
            "full_attention" if (i + 1) % spec.full_attention_interval == 0 else "linear_attention"
            for i in range(spec.num_hidden_layers)
        ],
        "decoder_sparse_step": 1,
    }
    tokenizer = tiny_model(cache_dir=cache_dir)
    save_random_model(
        path, "Qwen3NextConfig", "Qwen3NextForCausalLM", config, spec.seed, tokenizer_from=tokenizer
    )
