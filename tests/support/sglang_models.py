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

import fcntl
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tests.support.models import DEFAULT_CACHE, REPO_ROOT, tiny_model

# The test-only SGLang plugin that corrects SGLang 0.5.23's CPU attention for SWA pools (see its module
# docstring). Its directory goes on an SWA engine's PYTHONPATH, native and elastic engines alike.
CPU_FIXES = REPO_ROOT / "tests" / "support" / "sglang_cpu_fixes"
SWA_ENGINE_ENV = {"PYTHONPATH": str(CPU_FIXES)}


@dataclass(frozen=True)
class TinySWASpec:
    """Shape of a tiny Laguna: ``layer_types`` mixes sliding-window and full attention layers."""

    name: str = "tiny-laguna-swa"
    vocab_size: int = 1024  # the tiny Llama's tokenizer
    hidden_size: int = 128
    intermediate_size: int = 256
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    # Three sliding-window layers per full one (the common hybrid ratio); the window is small so that
    # test prompts outgrow it and SGLang frees out-of-window tokens while decoding.
    layer_types: tuple[str, ...] = field(
        default=("sliding_attention", "sliding_attention", "sliding_attention", "full_attention")
    )
    sliding_window: int = 32
    max_position_embeddings: int = 2048
    seed: int = 0


# Every layer sliding: SGLang serves it with ``PureSWATokenToKVPoolAllocator`` (page_size 1). The window
# is wider than the hybrid's so that a batch of 8 x (48 + 96) tokens holds ~8 x 96 slots at its peak
# (enough to outgrow a lowered limit) while longer requests still free out-of-window slots.
TINY_PURE_SWA = TinySWASpec(
    name="tiny-laguna-pure-swa", layer_types=("sliding_attention",) * 4, sliding_window=96
)


def tiny_swa_model(spec: TinySWASpec = TinySWASpec(), cache_dir: Path | None = None) -> Path:
    """Return the directory of ``spec``'s model, building it once (safe across concurrent processes)."""
    root = Path(cache_dir) if cache_dir else Path(os.environ.get("ELASTIC_KV_TEST_MODELS", DEFAULT_CACHE))
    path = root / spec.name
    done = path / ".complete"
    if done.exists():
        return path
    tokenizer_dir = tiny_model(cache_dir=cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{spec.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            _build(spec, path, tokenizer_dir)
            done.write_text(json.dumps(asdict(spec)))
    return path


def _build(spec: TinySWASpec, path: Path, tokenizer_dir: Path) -> None:
    import torch
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    layers = len(spec.layer_types)
    cfg = transformers.LagunaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        layer_types=list(spec.layer_types),
        mlp_layer_types=["dense"] * layers,  # no experts: SGLang's fused MoE has no CPU path here
        sliding_window=spec.sliding_window,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        architectures=["LagunaForCausalLM"],
    )
    torch.manual_seed(spec.seed)
    transformers.LagunaForCausalLM(cfg).save_pretrained(path)
    transformers.AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)


# The test-only plugin for the Triton-only steps of SGLang 0.5.23's GDN path on a CPU without AMX (see its
# module docstring); its directory goes on a GDN engine's PYTHONPATH, native and elastic engines alike.
CPU_GDN = REPO_ROOT / "tests" / "support" / "sglang_cpu_gdn"
GDN_ENGINE_ENV = {"PYTHONPATH": str(CPU_GDN)}


@dataclass(frozen=True)
class TinyGDNSpec:
    """Shape of a tiny Qwen3-Next: gated-delta-net (linear attention) layers and one full-attention layer
    every ``full_attention_interval``; MoE MLPs with a gated shared expert, as SGLang builds every Qwen3-Next
    layer. SGLang runs it on the CPU with the GDN kernels of the ``sgl_kernel`` stand-in."""

    name: str = "tiny-qwen3-next"
    vocab_size: int = 1024  # the tiny Llama's tokenizer
    hidden_size: int = 128
    num_hidden_layers: int = 4
    full_attention_interval: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
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
    intermediate_size: int = 256
    max_position_embeddings: int = 2048
    seed: int = 0


def tiny_gdn_model(spec: TinyGDNSpec = TinyGDNSpec(), cache_dir: Path | None = None) -> Path:
    """Return the directory of ``spec``'s model, building it once (safe across concurrent processes)."""
    root = Path(cache_dir) if cache_dir else Path(os.environ.get("ELASTIC_KV_TEST_MODELS", DEFAULT_CACHE))
    path = root / spec.name
    done = path / ".complete"
    if done.exists():
        return path
    tokenizer_dir = tiny_model(cache_dir=cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{spec.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            _build_gdn(spec, path, tokenizer_dir)
            done.write_text(json.dumps(asdict(spec)))
    return path


def _build_gdn(spec: TinyGDNSpec, path: Path, tokenizer_dir: Path) -> None:
    import torch
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    layers = spec.num_hidden_layers
    cfg = transformers.Qwen3NextConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        linear_conv_kernel_dim=spec.linear_conv_kernel_dim,
        linear_key_head_dim=spec.linear_key_head_dim,
        linear_value_head_dim=spec.linear_value_head_dim,
        linear_num_key_heads=spec.linear_num_key_heads,
        linear_num_value_heads=spec.linear_num_value_heads,
        layer_types=[
            "full_attention" if (i + 1) % spec.full_attention_interval == 0 else "linear_attention"
            for i in range(layers)
        ],
        # SGLang's Qwen3-Next config derives the layer kinds from this (transformers' from layer_types).
        full_attention_interval=spec.full_attention_interval,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        moe_intermediate_size=spec.moe_intermediate_size,
        shared_expert_intermediate_size=spec.shared_expert_intermediate_size,
        decoder_sparse_step=1,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        architectures=["Qwen3NextForCausalLM"],
    )
    torch.manual_seed(spec.seed)
    transformers.Qwen3NextForCausalLM(cfg).save_pretrained(path)
    transformers.AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
