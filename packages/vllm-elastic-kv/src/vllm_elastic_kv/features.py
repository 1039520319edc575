"""Model features the elastic backend serves, checked at start-up from the engine's ``KVCacheConfig``.

Served: decoder-only models whose KV cache is one group of full attention (``FullAttentionSpec``), in any
of vLLM's KV cache layouts and dtypes -- the tensors the attention backend uses are vLLM's own views, and
the geometry is derived from them.

Refused with a ConfigError naming the feature (not run on this project's CPU CI, so not claimed):
several KV cache groups (hybrid models), sliding-window or chunked-local attention, MLA, Mamba and other
state-space layers, cross-attention, sink attention, quantized-KV spec variants, and layers that share
another layer's KV cache. The geometry layer itself handles MLA latents and overlaid groups; what is
missing is engine-level testing, so the plugin says so instead of guessing.
"""

from __future__ import annotations

from typing import Any

from elastic_kv.errors import ConfigError

__all__ = ["SUPPORTED_SPECS", "check_model", "unsupported_model_features"]

SUPPORTED_SPECS = frozenset({"FullAttentionSpec"})

_NAMES = {
    "SlidingWindowSpec": "sliding-window attention",
    "ChunkedLocalAttentionSpec": "chunked local attention",
    "MLAAttentionSpec": "MLA (multi-head latent attention)",
    "MambaSpec": "Mamba / state-space layers",
    "CrossAttentionSpec": "cross-attention (encoder-decoder)",
    "SinkFullAttentionSpec": "attention sinks",
    "EncoderOnlyAttentionSpec": "encoder-only attention",
}


def _spec_types(group: Any) -> list[str]:
    spec = group.kv_cache_spec
    inner = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
    specs = list(inner.values()) if inner else [spec]
    return sorted({type(s).__name__ for s in specs})


def unsupported_model_features(kv_cache_config: Any, shared_kv_layers: int = 0) -> list[str]:
    """Why the elastic backend cannot serve this model's KV cache (empty: it can)."""
    reasons: list[str] = []
    groups = kv_cache_config.kv_cache_groups
    if len(groups) > 1:
        kinds = ", ".join(t for g in groups for t in _spec_types(g))
        reasons.append(f"several KV cache groups (hybrid model: {kinds})")
    for group in groups:
        for name in _spec_types(group):
            if name not in SUPPORTED_SPECS:
                reasons.append(f"{_NAMES.get(name, name)} ({name})")
    if shared_kv_layers:
        reasons.append(f"cross-layer KV cache sharing ({shared_kv_layers} layers reuse another's cache)")
    return sorted(set(reasons))


def check_model(kv_cache_config: Any, shared_kv_layers: int = 0) -> None:
    """ConfigError naming every unsupported feature of the model's KV cache."""
    reasons = unsupported_model_features(kv_cache_config, shared_kv_layers)
    if reasons:
        raise ConfigError(
            "--kv-cache-backend=elastic does not support this model's " + "; ".join(reasons) + ". Use "
            "--kv-cache-backend=native for it."
        )
