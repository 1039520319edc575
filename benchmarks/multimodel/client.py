"""Replays a trace against OpenAI endpoints: streaming completions, one task per request, TTFT and TPOT.

Each request is sent at its arrival time (relative to the replay's start) as ``POST /v1/completions`` with
the prompt as token ids, ``max_tokens`` = its output length, ``ignore_eos`` (a vLLM extension: the output
has exactly that length), greedy sampling, ``stream`` and ``stream_options.include_usage``. Timings:

* TTFT: from the request's scheduled arrival to the first streamed chunk that carries a choice (the
  scheduled arrival, not the send: a client that falls behind is counted against the server, never hidden);
* TPOT: (last chunk - first chunk) / (completion tokens - 1), the tokens from the final usage chunk;
* a request fails on a non-200 status, a transport error, a timeout, a stream that ends without
  ``[DONE]`` or with fewer completion tokens than asked for; its error is kept (first 200 characters).

Models a set-up does not serve fail at once with ``not served`` (static partitioning that holds fewer
engines than models).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from benchmarks.multimodel.trace import Request, Trace, prompt_token_ids

__all__ = ["Outcome", "replay"]


@dataclass
class Outcome:
    """What happened to one request (times in seconds; ``None`` where the request never got there)."""

    id: int
    model: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    ok: bool = False
    ttft_s: float | None = None
    tpot_s: float | None = None
    latency_s: float | None = None
    completion_tokens: int = 0
    error: str = ""

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return asdict(self)


async def _one(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], out: Outcome, start: float, timeout_s: float
) -> None:
    """Send one streaming completion and fill ``out`` (``ok`` only if every asked-for token came)."""
    first: float | None = None
    last: float | None = None
    done = False
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", f"{url}/v1/completions", json=body) as reply:
                if reply.status_code != 200:
                    text = (await reply.aread()).decode(errors="replace")
                    out.error = f"HTTP {reply.status_code}: {text[:200]}"
                    return
                async for line in reply.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    now = time.perf_counter()
                    chunk = json.loads(data)
                    if "error" in chunk:
                        out.error = f"stream error: {json.dumps(chunk['error'])[:200]}"
                        return
                    if chunk.get("choices"):
                        first = now if first is None else first
                        last = now
                    if chunk.get("usage"):
                        out.completion_tokens = int(chunk["usage"].get("completion_tokens") or 0)
    except TimeoutError:
        out.error = f"timeout after {timeout_s:g} s"
        return
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        out.error = f"{type(exc).__name__}: {str(exc)[:200]}"
        return
    if not done:
        out.error = "stream ended without [DONE]"
    elif first is None or last is None:
        out.error = "no tokens streamed"
    elif out.completion_tokens < out.output_tokens:
        out.error = f"{out.completion_tokens} of {out.output_tokens} tokens"
    else:
        arrival = start + out.arrival_s
        out.ok = True
        out.ttft_s = first - arrival
        out.latency_s = last - arrival
        out.tpot_s = (last - first) / (out.completion_tokens - 1) if out.completion_tokens > 1 else 0.0


async def _replay(
    trace: Trace,
    endpoints: Mapping[str, str],
    names: list[str],
    vocab_size: int,
    timeout_s: float,
    on_start: Callable[[float], None],
    on_progress: Callable[[int, int], None] | None,
) -> list[Outcome]:
    outcomes = [
        Outcome(
            id=r.id,
            model=names[r.model],
            arrival_s=r.arrival_s,
            prompt_tokens=r.prompt_tokens,
            output_tokens=r.output_tokens,
        )
        for r in trace.requests
    ]
    bodies = [
        {
            "model": names[r.model],
            "prompt": prompt_token_ids(trace.spec, r, vocab_size),
            "max_tokens": r.output_tokens,
            "min_tokens": r.output_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for r in trace.requests
    ]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(timeout_s, connect=30.0)
    finished = 0

    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:

        async def run(request: Request, body: dict[str, Any], out: Outcome) -> None:
            nonlocal finished
            delay = start + request.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            url = endpoints.get(out.model)
            if url is None:
                out.error = "not served"
            else:
                await _one(client, url, body, out, start, timeout_s)
            finished += 1
            if on_progress is not None:
                on_progress(finished, len(outcomes))

        start = time.perf_counter() + 0.2
        on_start(start)
        await asyncio.gather(*(run(*item) for item in zip(trace.requests, bodies, outcomes, strict=True)))
    return outcomes


def replay(
    trace: Trace,
    endpoints: Mapping[str, str],
    names: list[str],
    vocab_size: int,
    timeout_s: float,
    on_start: Callable[[float], None] = lambda start: None,
    on_progress: Callable[[int, int], None] | None = None,
) -> list[Outcome]:
    """Send every request of ``trace`` at its arrival time and wait for all of them.

    ``endpoints`` maps a served model name to its base URL (one engine per model, or one router for all);
    ``names[i]`` is model index ``i``'s name. ``on_start(t0)`` is called with the ``time.perf_counter``
    value that is the replay's time 0, just before it. Returns one :class:`Outcome` per request, in trace
    order.
    """
    return asyncio.run(_replay(trace, endpoints, names, vocab_size, timeout_s, on_start, on_progress))
