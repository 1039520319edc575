"""What both engines of the GPU proof run: the model shapes (random weights), speculative decoding, prompts.

:func:`model_dir` writes a model's ``config.json`` (the engines load it with ``load_format="dummy"``);
:func:`greedy_prompts` are the prompts of the greedy comparison, :func:`burst_prompts` those of a burst.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

GREEDY_TOKENS = 64  # per prompt of the greedy comparison


# Llama shapes with random ("dummy") weights. tiny: 8 layers of 1024 -- the engine thread's Python work, not
# the GPU, sets the pace, which makes the plugin's per-step costs weigh the most (the worst case). 1b:
# TinyLlama-1.1B's shape (22 layers of 2048, 4 KV heads). 8b: Llama-3-8B's shape (32 layers of 4096, 8 KV
# heads; 16 GB of weights per engine) -- what an H200 serves, where the GPU sets the pace.
MODELS: dict[str, dict[str, int]] = {
    "tiny": {
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
    },
    "1b": {
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
    },
    "8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
    },
}


# Other attention families (random weights; `--model NAME`): the KV cache groups vLLM builds beyond one plain
# full-attention group, each with a few layers of its real architecture's shape. gptoss: sliding-window and
# full attention, both with attention sinks, MoE (gpt-oss-20b's layer shape). mla: DeepSeek-V3's latent
# attention (kv_lora_rank 512, rope 64) with MoE. gdn: Qwen3-Next's Gated DeltaNet state beside full
# attention, MoE. moe: Qwen3-MoE (full attention; vLLM may pick another model runner for MoE models).
FAMILY_MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gptoss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {
            "hidden_size": 2880,
            "intermediate_size": 2880,
            "num_hidden_layers": 4,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "num_local_experts": 32,
            "num_experts_per_tok": 4,
            "sliding_window": 128,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
        },
    ),
    "mla": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        {
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "moe_intermediate_size": 1024,
            "num_hidden_layers": 4,
            "first_k_dense_replace": 1,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "kv_lora_rank": 512,
            "q_lora_rank": 1536,
            "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 128,
            "v_head_dim": 128,
            "n_routed_experts": 16,
            "n_shared_experts": 1,
            "num_experts_per_tok": 4,
            "n_group": 1,
            "topk_group": 1,
            "topk_method": "noaux_tc",
        },
    ),
    "gdn": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        {
            "hidden_size": 2048,
            "intermediate_size": 5632,
            "num_hidden_layers": 4,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "num_experts": 32,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512,
            "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        },
    ),
    "moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "num_hidden_layers": 8,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "moe_intermediate_size": 768,
            "num_experts": 32,
            "num_experts_per_tok": 4,
        },
    ),
}


# Speculative decoding (`--speculative NAME`): n-gram drafts, three tokens a step, verified by the target.
SPECULATIVE: dict[str, dict[str, Any]] = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
}


def model_dir(root: Path, model: str) -> Path:
    """The folder of ``model``'s config under ``root``, written unless it is there already."""
    import transformers

    path = root / f"{'llama-' if model in MODELS else ''}{model}"
    if (path / "config.json").exists():
        return path
    if model in FAMILY_MODELS:
        config_class, architecture, shape = FAMILY_MODELS[model]
        getattr(transformers, config_class)(
            architectures=[architecture], vocab_size=32000, max_position_embeddings=4096, **shape
        ).save_pretrained(path)
        return path
    transformers.LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=32000,
        max_position_embeddings=4096,
        **MODELS[model],
    ).save_pretrained(path)
    return path


def burst_prompts(n: int, length: int, salt: int) -> list[dict[str, list[int]]]:
    """``n`` prompts of ``length`` tokens; the same ``salt`` gives the same prompts."""
    return [
        {"prompt_token_ids": [(7 * i + 13 * j + salt) % 31999 + 1 for j in range(length)]} for i in range(n)
    ]


def greedy_prompts(cpu_smoke: bool) -> list[dict[str, list[int]]]:
    """The greedy comparison's prompts: lengths around the block sizes, then three that share a prefix."""
    lengths = [1, 7, 15, 16, 17, 31, 64, 100, 255, 256, 257, 511, 700, 1000, 1500, 1900]
    if cpu_smoke:  # checks the wiring, not the kernels: prompts up to just past two 128-token blocks
        lengths = [n for n in lengths if n <= 257]
    varied = [
        {"prompt_token_ids": [(5 * i + 3 * j) % 31999 + 1 for j in range(n)]} for i, n in enumerate(lengths)
    ]
    shared = [(11 * j) % 31999 + 1 for j in range(300)]
    varied += [
        {"prompt_token_ids": shared + [(17 * k + j) % 31999 + 1 for j in range(k)]} for k in (1, 40, 200)
    ]
    return varied
