"""A pure-torch stand-in for ``sgl_kernel``, for running SGLang's CPU engine in tests only.

No CPU build of sgl-kernel is published, and SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``)
imports two functions from it on the dense-attention path. This package provides exactly those two,
written in plain torch, the linear-attention (GDN) kernels of :mod:`sgl_kernel.mamba` (two of them
registered as ``torch.ops.sgl_kernel`` ops, as the real build does), and a stub for every other name
that raises when called (never silently computes something). It is test infrastructure: it is put on
``PYTHONPATH`` only for SGLang CPU engine processes (see ``tests/sglang/conftest.py``) and never
installed, and must never shadow a real sgl_kernel.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["assign_req_to_token_pool_cpu", "copy_all_layer_kv_cache_cpu"]

# Marks this package as the stand-in, so tests can check which sgl_kernel a process imported.
IS_CPU_STAND_IN = True


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write request i's next ``end[i] - start[i]`` cache slots into its row of ``req_to_token``.

    ``out_cache_loc`` holds the slots of all requests back to back, in request order; row
    ``req_pool_indices[i]`` receives them at columns ``[start[i], end[i])``. ``pool_len`` is the row
    length (the kernel's bound); a range past it is a caller bug and raises ``ValueError``.
    """
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    pos = 0
    for row, start, end in zip(rows, starts, ends, strict=True):
        n = end - start
        if n <= 0:
            continue
        if end > pool_len:
            raise ValueError(f"request row {row}: columns [{start}, {end}) exceed the row length {pool_len}")
        req_to_token[row, start:end] = out_cache_loc[pos : pos + n].to(req_to_token.dtype)
        pos += n


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """For every buffer k (base address ``data_ptrs[k]``, rows of ``strides[k]`` bytes), copy row
    ``src_loc[j]`` onto row ``tgt_loc[j]`` for every j.

    Rows are copied in order through the raw addresses SGLang hands over (the buffers live in
    the same process), which is what the C++ kernel does.
    """
    pairs = list(zip(tgt_loc.tolist(), src_loc.tolist(), strict=True))
    for base, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        for tgt, src in pairs:
            if tgt != src:
                ctypes.memmove(base + tgt * stride, base + src * stride, stride)


# ``torch.ops.sgl_kernel.<name>`` ops SGLang's CPU GDN path resolves at import (sgl_kernel.mamba's docstring).
_OPS = torch.library.Library("sgl_kernel", "FRAGMENT")


def _register_ops() -> None:
    from sgl_kernel import mamba

    _OPS.define("fused_gdn_gating_cpu(Tensor A_log, Tensor a, Tensor b, Tensor dt_bias) -> (Tensor, Tensor)")
    _OPS.impl("fused_gdn_gating_cpu", mamba.fused_gdn_gating_cpu, "CPU")
    _OPS.define(
        "fused_sigmoid_gating_delta_rule_update_cpu(Tensor A_log, Tensor dt_bias, Tensor q, Tensor k, "
        "Tensor v, Tensor a, Tensor b, Tensor(s!) initial_state_source, Tensor initial_state_indices, "
        "Tensor cu_seqlens, bool use_qk_l2norm_in_kernel, float softplus_beta=1.0, "
        "float softplus_threshold=20.0) -> Tensor"
    )
    _OPS.impl(
        "fused_sigmoid_gating_delta_rule_update_cpu", mamba.fused_sigmoid_gating_delta_rule_update_cpu, "CPU"
    )


_register_ops()


def _missing(name: str) -> Callable[..., Any]:
    def stub(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"sgl_kernel.{name} is not provided by the CPU test stand-in (tests/support/sgl_kernel_cpu)"
        )

    stub.__name__ = name
    return stub


def __getattr__(name: str) -> Any:
    # Module-level imports of other kernels (``from sgl_kernel import x``) succeed so that SGLang's
    # modules import; calling one raises. Dunder probes stay AttributeErrors.
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(name)
