"""Which KV cache specs the elastic backend serves, and how it names the ones it refuses (no engine)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from elastic_kv.errors import ConfigError
from vllm_elastic_kv.features import SPECS, check_model, describe_groups, unsupported_model_features

pytestmark = pytest.mark.vllm


def _config(*specs: Any) -> Any:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    groups = [KVCacheGroupSpec([f"g{g}.l{i}" for i in range(2)], s) for g, s in enumerate(specs)]
    vllm_config = VllmConfig()
    vllm_config.cache_config.kv_cache_layout = "LBHNC"
    return get_kv_cache_config_from_groups(vllm_config, groups, 64 * 2 * specs[0].page_size_bytes)


def _full() -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)


def _sliding() -> Any:
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16, sliding_window=64
    )


def test_every_spec_type_of_this_vllm_is_known() -> None:
    """A spec type vLLM adds is refused by name until it is listed (and, to be served, proven)."""
    import vllm.v1.kv_cache_interface as interface

    names = {
        name
        for name, obj in vars(interface).items()
        if isinstance(obj, type) and issubclass(obj, interface.KVCacheSpec) and name.endswith("Spec")
    }
    leaves = names - {"KVCacheSpec", "AttentionSpec", "UniformTypeKVCacheSpecs"}
    assert leaves <= set(SPECS), f"spec types not in features.SPECS: {sorted(leaves - set(SPECS))}"


def test_full_attention_and_hybrid_sliding_window_groups_are_served() -> None:
    plain = _config(_full())
    hybrid = _config(_full(), _sliding())
    assert unsupported_model_features(plain) == [] and unsupported_model_features(hybrid) == []
    check_model(hybrid)
    assert describe_groups(hybrid) == "1 x FullAttentionSpec (2 layers), 1 x SlidingWindowSpec (2 layers)"


def test_refused_features_are_named_each_once() -> None:
    from vllm.v1.kv_cache_interface import CrossAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    cross = CrossAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
    cfg = KVCacheConfig(4, [], [KVCacheGroupSpec(["a"], _full()), KVCacheGroupSpec(["b", "c"], cross)])
    with pytest.raises(ConfigError) as err:
        check_model(cfg)
    text = str(err.value)
    assert "cross-attention (encoder-decoder) (CrossAttentionSpec)" in text
    assert "full attention" not in text and text.count("CrossAttentionSpec") == 1
    assert text.endswith("Use --kv-cache-backend=native for it.")


def test_a_subclass_does_not_pass_as_its_served_base() -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    class NewSpec(FullAttentionSpec):
        pass

    spec = NewSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
    reasons = unsupported_model_features(KVCacheConfig(4, [], [KVCacheGroupSpec(["a"], spec)]))
    assert reasons == ["KV cache spec NewSpec (unknown to vllm-elastic-kv)"]


def test_mamba_state_is_served_with_and_without_prefix_caching() -> None:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec

    def config(mode: str) -> Any:
        state = MambaSpec(
            block_size=1024,
            shapes=((3, 160), (4, 32, 16)),
            dtypes=(torch.float32, torch.float32),
            page_size_padded=16 * 2 * 64 * 2 * 2 * 4,
            mamba_cache_mode=mode,
        )
        return KVCacheConfig(4, [], [KVCacheGroupSpec(["m"], state), KVCacheGroupSpec(["a"], _full())])

    assert unsupported_model_features(config("none")) == []
    assert unsupported_model_features(config("align")) == []  # state checkpoints: blocks of the same pool
