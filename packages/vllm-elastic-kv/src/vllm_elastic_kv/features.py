"""Model features the elastic backend serves, checked at start-up from the engine's ``KVCacheConfig``.

vLLM describes a model's KV cache as groups of layers, each with one ``KVCacheSpec`` type and its own block
table, all drawing block ids from one shared ``BlockPool`` (the hybrid allocator; a plain model has one
group). The groups' ``KVCacheTensor``\\ s overlay the same bytes, so a block id addresses one block of
memory whichever group holds it, and the pool's geometry -- the union of every group's bytes -- gives each
ledger page every byte its block ids can reach in any group. What differs between families is only which
blocks the groups take and give back (a sliding-window group drops the blocks that left its window), and
that reaches the pool through vLLM's own ``get_new_blocks`` / ``free_blocks``.

:data:`SPECS` lists every spec type the plugin knows: served ones are proven on a real engine by a test in
``tests/vllm`` (the package README's support table names it); refused ones fail at start-up with one
:class:`~elastic_kv.errors.ConfigError` naming each feature. A spec type not listed is refused by name.
Spec types are matched exactly, not by subclass: ``MLAAttentionSpec`` subclasses ``FullAttentionSpec``
and must not pass as it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from elastic_kv.errors import ConfigError

__all__ = [
    "SPECS",
    "SpecSupport",
    "attention_sink_layers",
    "check_model",
    "describe_groups",
    "unsupported_model_features",
]


@dataclass(frozen=True, slots=True)
class SpecSupport:
    """What the plugin does with one vLLM ``KVCacheSpec`` type: ``feature`` names it for users."""

    feature: str
    served: bool


SPECS: dict[str, SpecSupport] = {
    "FullAttentionSpec": SpecSupport("full attention", served=True),
    "SlidingWindowSpec": SpecSupport("sliding-window attention", served=True),
    "ChunkedLocalAttentionSpec": SpecSupport("chunked local attention", served=True),
    "MLAAttentionSpec": SpecSupport("MLA (multi-head latent attention)", served=True),
    "MambaSpec": SpecSupport("Mamba / linear-attention state", served=True),
    "SinkFullAttentionSpec": SpecSupport("static sink tokens in the KV cache", served=False),
    "SlidingWindowMLASpec": SpecSupport("sliding-window MLA", served=False),
    "RSWASpec": SpecSupport("reverse sliding-window attention", served=False),
    "CircularBufferSpec": SpecSupport("circular-buffer attention", served=False),
    "HiddenStateCacheSpec": SpecSupport("hidden-state caches", served=False),
    "HiSparseHotSpec": SpecSupport("HiSparse attention", served=False),
    "HiSparseResidentSpec": SpecSupport("HiSparse attention", served=False),
    "CrossAttentionSpec": SpecSupport("cross-attention (encoder-decoder)", served=False),
    "EncoderOnlyAttentionSpec": SpecSupport("encoder-only attention", served=False),
}


def _layer_specs(group: Any) -> list[Any]:
    spec = group.kv_cache_spec
    inner = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs: one spec per layer
    return list(inner.values()) if inner else [spec]


def describe_groups(kv_cache_config: Any) -> str:
    """The KV cache groups as ``"3 x SlidingWindowSpec (1 layer), 1 x FullAttentionSpec (1 layer)"``."""
    kinds = Counter(
        (" / ".join(sorted({type(s).__name__ for s in _layer_specs(g)})), len(g.layer_names))
        for g in kv_cache_config.kv_cache_groups
    )
    return ", ".join(
        f"{count} x {name} ({layers} layer{'s' if layers != 1 else ''})"
        for (name, layers), count in kinds.items()
    )


def attention_sink_layers(forward_context: dict[str, Any]) -> int:
    """Attention layers with learned attention sinks (gpt-oss) among the worker's layers.

    Sinks are one logit per head that the attention kernel adds to the softmax; they are weights, not
    KV cache, so no ``KVCacheSpec`` shows them and the cache layout is that of the layer's spec. Counted for
    diagnostics (``elastic_kv_info``) and the family tests."""
    return sum(1 for layer in forward_context.values() if getattr(layer, "has_sink", False) is True)


def unsupported_model_features(kv_cache_config: Any) -> list[str]:
    """Why the elastic backend cannot serve this model's KV cache (empty: it can), one phrase each."""
    reasons: set[str] = set()
    for group in kv_cache_config.kv_cache_groups:
        if getattr(group, "host_resident", False):
            reasons.add("host-resident KV cache groups (a second block pool)")
        for spec in _layer_specs(group):
            name = type(spec).__name__
            support = SPECS.get(name)
            if support is None:
                reasons.add(f"KV cache spec {name} (unknown to vllm-elastic-kv)")
            elif not support.served:
                reasons.add(f"{support.feature} ({name})")
    return sorted(reasons)


def check_model(kv_cache_config: Any) -> None:
    """ConfigError naming every unsupported feature of the model's KV cache."""
    reasons = unsupported_model_features(kv_cache_config)
    if reasons:
        raise ConfigError(
            "--kv-cache-backend=elastic does not support this model's " + "; ".join(reasons) + ". Use "
            "--kv-cache-backend=native for it."
        )
