"""Tiny local Llama models with a tokenizer, built offline and cached under ``.cache/models``.

Engine tests need a real model directory (config, weights, tokenizer) but no hub access. The model
has random weights from a fixed seed, so greedy decoding is deterministic across runs and engines;
the tokenizer is a small byte-level BPE trained on a fixed text, so ``vllm serve`` and
``sglang.launch_server`` can answer text requests.
"""

from __future__ import annotations

import fcntl
import json
import os
from dataclasses import dataclass
from pathlib import Path

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
class TinyModelSpec:
    """Shape of a tiny Llama; head size = hidden_size // num_attention_heads (CPU attention: 32, 64, ...)."""

    name: str = "tiny-llama"
    vocab_size: int = 1024
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 2048
    seed: int = 0


def tiny_model(spec: TinyModelSpec = TinyModelSpec(), cache_dir: Path | None = None) -> Path:
    """Return the directory of ``spec``'s model, building it once (safe across concurrent processes)."""
    root = Path(cache_dir or os.environ.get("ELASTIC_KV_TEST_MODELS", DEFAULT_CACHE))
    path = root / spec.name
    done = path / ".complete"
    if done.exists():
        return path
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{spec.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            _build(spec, path)
            done.write_text(json.dumps(spec.__dict__))
    return path


def _build(spec: TinyModelSpec, path: Path) -> None:
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path.mkdir(parents=True, exist_ok=True)
    cfg = transformers.LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(spec.seed)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)

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
