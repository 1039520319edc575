"""Test-only SGLang plugin: SGLang 0.5.23's ``torch_native`` attention reads sliding-window layers' KV at the
wrong rows. Applied to native and elastic engines alike; never installed, never part of the product.

The bug (SGLang 0.5.23, ``srt/layers/attention/torch_native_backend.py``): with the hybrid SWA pool
(``SWAKVPool``), ``forward_extend`` / ``forward_decode`` *write* a sliding-window layer's K/V at the
translated SWA rows (``translate_loc_from_full_to_swa(out_cache_loc)``), but ``_run_sdpa_forward_extend`` /
``_run_sdpa_forward_decode`` *read* them as ``k_cache[req_to_token[req, :seq_len]]``: full-pool slot ids
used as rows of the SWA buffer. The result is right only while every token's SWA slot equals its full slot
(both free lists untouched since start-up). Once SGLang frees out-of-window SWA slots and reuses them, the
attention silently reads other tokens' K/V; once a full slot id reaches the SWA pool's size it fails:
``IndexError: index 820 is out of bounds for dimension 0 with size 820`` (l.241, decode; reproduced with
the tiny Laguna of :mod:`tests.support.sglang_models`, ``max_total_tokens=1024``). SGLang's GPU backends
translate the ids; only the CPU fallback does not.

The correction: the two read routines receive ``req_to_token`` through a view that maps every full slot id
to its SWA row (``full_to_swa_index_mapping``, the table SGLang's own allocator keeps) when the buffer they
read belongs to the SWA sub-pool. Out-of-window tokens map to the padding row 0 and are masked out by the
sliding-window mask, as on the GPU backends. Engine tests put this directory on ``PYTHONPATH`` for SWA
engines (its ``.dist-info`` declares the ``sglang.srt.plugins`` entry point), and check the corrected native
engine against transformers' own implementation of the model.
"""

from __future__ import annotations

from typing import Any

import torch

_BACKEND = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend"


def register() -> None:
    """Entry point: wrap the two read routines of SGLang's ``TorchNativeAttnBackend``."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(f"{_BACKEND}._run_sdpa_forward_extend", read_swa_rows, HookType.AROUND)
    HookRegistry.register(f"{_BACKEND}._run_sdpa_forward_decode", read_swa_rows, HookType.AROUND)


class _TranslatedRows:
    """``req_to_token`` as the SWA buffer needs it: ``view[i, a:b]`` = SWA rows of those full slot ids."""

    def __init__(self, req_to_token: torch.Tensor, full_to_swa: torch.Tensor) -> None:
        self._req_to_token = req_to_token
        self._full_to_swa = full_to_swa

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self._full_to_swa[self._req_to_token[index].long()]


def read_swa_rows(
    original: Any,
    backend: Any,
    query: torch.Tensor,
    output: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """Call the read routine with SWA rows in place of full slot ids when ``k_cache`` is an SWA buffer."""
    pool = backend.token_to_kv_pool
    if getattr(backend, "use_sliding_window_kv_pool", False):
        swa_keys = {buf.data_ptr() for buf in pool.swa_kv_pool.k_buffer}
        if k_cache.data_ptr() in swa_keys:
            req_to_token = _TranslatedRows(req_to_token, pool.full_to_swa_index_mapping)  # type: ignore[assignment]
    return original(backend, query, output, k_cache, v_cache, req_to_token, *args, **kwargs)
