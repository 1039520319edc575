"""Plain-torch stand-ins for the linear-attention (GDN) CPU kernels of ``sgl_kernel``, for tests only.

SGLang 0.5.23's CPU engine runs a gated-delta-net layer (Qwen3-Next style) with five kernels of
sgl-kernel's CPU build: ``sgl_kernel.mamba.causal_conv1d_fn_cpu`` / ``causal_conv1d_update_cpu`` (the
short causal convolution over the mixed QKV, with a per-request rolling state), ``chunk_gated_delta_rule_cpu``
(the prefill recurrence) and the ops ``torch.ops.sgl_kernel.fused_gdn_gating_cpu`` /
``fused_sigmoid_gating_delta_rule_update_cpu`` (gates, and gates plus one decode step). They are written
here as the recurrences they compute, token by token, with the same arguments and in-place state updates
SGLang relies on; :mod:`sgl_kernel` registers the two ops with ``torch.library``.

State layouts are SGLang's pool layouts: a conv state slot is ``(dim, width - 1)`` (the last inputs, oldest
first); an SSM state slot is ``(HV, V, K)`` (the transpose of the ``K x V`` delta-rule matrix). Query and key
heads are shared by ``HV / H`` value heads each. Arithmetic is in float32; states keep the pool's dtype.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "causal_conv1d_fn_cpu",
    "causal_conv1d_update_cpu",
    "chunk_gated_delta_rule_cpu",
    "fused_gdn_gating_cpu",
    "fused_sigmoid_gating_delta_rule_update_cpu",
]


def _activate(out: torch.Tensor, activation: str | bool | None) -> torch.Tensor:
    if activation in (None, False):
        return out
    if activation in (True, "silu", "swish"):
        return F.silu(out)
    raise ValueError(f"unsupported activation {activation!r} (None, 'silu' or 'swish')")


def causal_conv1d_fn_cpu(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | bool | None = "silu",
    conv_states: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    cache_indices: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    **unused: Any,
) -> torch.Tensor:
    """Causal depthwise convolution of the sequences packed in ``x`` (``(dim, tokens)``), sequence ``i``
    being columns ``query_start_loc[i]:query_start_loc[i+1]``; weights ``(dim, width)``.

    Sequence ``i`` starts from ``conv_states[cache_indices[i]]`` when ``has_initial_state[i]`` (a prefix
    was already convolved), else from zeros, and leaves its last ``width - 1`` inputs there. Returns the
    activated output, ``(dim, tokens)``.
    """
    dim, total = x.shape
    width = weight.shape[1]
    starts = query_start_loc.tolist() if query_start_loc is not None else [0, total]
    slots = cache_indices.tolist() if cache_indices is not None else [None] * (len(starts) - 1)
    initial = has_initial_state.tolist() if has_initial_state is not None else [False] * len(slots)
    w = weight.float()
    out = torch.empty((dim, total), dtype=torch.float32)
    for i, slot in enumerate(slots):
        s, e = starts[i], starts[i + 1]
        if slot is None or slot < 0:
            continue
        if conv_states is not None and initial[i]:
            history = conv_states[slot].float()
        else:
            history = x.new_zeros((dim, width - 1), dtype=torch.float32)
        padded = torch.cat((history, x[:, s:e].float()), dim=1)  # (dim, width - 1 + n)
        windows = padded.unfold(1, width, 1)  # (dim, n, width)
        seq = (windows * w[:, None, :]).sum(-1)
        if bias is not None:
            seq = seq + bias.float()[:, None]
        out[:, s:e] = seq
        if conv_states is not None:
            conv_states[slot] = padded[:, -(width - 1) :].to(conv_states.dtype)
    return _activate(out, activation).to(x.dtype)


def causal_conv1d_update_cpu(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | bool | None = None,
    conv_state_indices: torch.Tensor | None = None,
    **unused: Any,
) -> torch.Tensor:
    """One decode step per row of ``x`` (``(batch, dim)``): convolve the new input with the rolling state
    ``conv_state[conv_state_indices[b]]`` (``(dim, width - 1)``), shift it in, return the activated output
    (``(batch, dim)``)."""
    rows = conv_state_indices.long() if conv_state_indices is not None else torch.arange(x.shape[0])
    history = conv_state[rows].float()  # (batch, dim, width - 1)
    padded = torch.cat((history, x.float()[:, :, None]), dim=2)  # (batch, dim, width)
    out = (padded * weight.float()[None]).sum(-1)
    if bias is not None:
        out = out + bias.float()
    conv_state[rows] = padded[:, :, 1:].to(conv_state.dtype)
    return _activate(out, activation).to(x.dtype)


def fused_gdn_gating_cpu(
    A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gates of ``(tokens, HV)`` inputs: ``g = -exp(A_log) * softplus(a + dt_bias)`` (log decay) and
    ``beta = sigmoid(b)``, each ``(1, tokens, HV)`` float32."""
    g = -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float())
    beta = torch.sigmoid(b.float())
    return g[None], beta[None]


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    l2norm: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one sequence: ``q``/``k`` ``(n, H, K)``, ``v`` ``(n, HV, V)``, ``g``/``beta``
    ``(n, HV)``, ``state`` ``(HV, V, K)`` float32. Returns the outputs ``(n, HV, V)`` and the final state."""
    groups = v.shape[1] // q.shape[1]
    q = q.float().repeat_interleave(groups, dim=1)
    k = k.float().repeat_interleave(groups, dim=1)
    if l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * q.shape[-1] ** -0.5
    v = v.float()
    out = torch.empty(v.shape, dtype=torch.float32)
    for t in range(v.shape[0]):
        state = state * torch.exp(g[t].float())[:, None, None]
        predicted = torch.einsum("hvk,hk->hv", state, k[t])
        delta = (v[t] - predicted) * beta[t].float()[:, None]
        state = state + delta[:, :, None] * k[t][:, None, :]
        out[t] = torch.einsum("hvk,hk->hv", state, q[t])
    return out, state


def chunk_gated_delta_rule_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    head_first: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    initial_state_indices: torch.Tensor | None = None,
    **unused: Any,
) -> tuple[torch.Tensor, None, None]:
    """Prefill: the gated delta rule over the sequences packed in ``q``/``k`` (``(1, tokens, H, K)``),
    ``v`` (``(1, tokens, HV, V)``), ``g``/``beta`` (``(1, tokens, HV)``), sequence ``i`` being tokens
    ``cu_seqlens[i]:cu_seqlens[i+1]`` and starting from (and updating in place) the state
    ``initial_state[initial_state_indices[i]]``. Returns ``(outputs (1, tokens, HV, V), None, None)`` (no
    per-chunk states: SGLang reads them only to track prefix-cache checkpoints)."""
    if head_first:
        raise NotImplementedError("head_first layouts are not used by SGLang's GDN backend")
    starts = cu_seqlens.tolist()
    slots = (
        initial_state_indices.tolist() if initial_state_indices is not None else list(range(len(starts) - 1))
    )
    out = torch.empty(v.shape, dtype=torch.float32)
    for i, slot in enumerate(slots):
        s, e = starts[i], starts[i + 1]
        o, final = _delta_rule(
            q[0, s:e], k[0, s:e], v[0, s:e], g[0, s:e], beta[0, s:e],
            initial_state[slot].float(), use_qk_l2norm_in_kernel,
        )  # fmt: skip
        out[0, s:e] = o
        initial_state[slot] = final.to(initial_state.dtype)
    return out.to(q.dtype), None, None


def fused_sigmoid_gating_delta_rule_update_cpu(
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    initial_state_source: torch.Tensor,
    initial_state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    use_qk_l2norm_in_kernel: bool,
    softplus_beta: float = 1.0,
    softplus_threshold: float = 20.0,
) -> torch.Tensor:
    """Decode: the gates of ``a``/``b`` (``(batch, HV)``) and one delta-rule step per sequence of ``q``/``k``
    (``(1, tokens, H, K)``) and ``v`` (``(1, tokens, HV, V)``), updating ``initial_state_source`` at
    ``initial_state_indices`` in place. Returns the outputs, ``(1, tokens, HV, V)``."""
    g = -torch.exp(A_log.float()) * F.softplus(
        a.float() + dt_bias.float(), beta=softplus_beta, threshold=softplus_threshold
    )
    beta = torch.sigmoid(b.float())
    starts = cu_seqlens.tolist()
    out = torch.empty(v.shape, dtype=torch.float32)
    for i, slot in enumerate(initial_state_indices.tolist()):
        s, e = starts[i], starts[i + 1]
        if slot < 0:
            out[0, s:e] = 0
            continue
        o, final = _delta_rule(
            q[0, s:e], k[0, s:e], v[0, s:e], g[s:e], beta[s:e],
            initial_state_source[slot].float(), use_qk_l2norm_in_kernel,
        )  # fmt: skip
        out[0, s:e] = o
        initial_state_source[slot] = final.to(initial_state_source.dtype)
    return out.to(q.dtype)
