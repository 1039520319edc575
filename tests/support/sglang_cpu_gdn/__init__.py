"""Test-only SGLang plugin: the Triton-only steps of SGLang 0.5.23's Qwen3-Next (GDN) path, in plain
torch, for a CPU without AMX. Applied to native and elastic engines alike; never installed, never part of
the product.

SGLang 0.5.23 normalises a GDN layer's output with ``FusedRMSNormGated`` (or the ``RMSNorm`` of
``layernorm_gated`` under piecewise CUDA graphs). On a CPU both call
``torch.ops.sgl_kernel.fused_rmsnorm_gated_cpu`` only when the CPU has AMX (``cpu_has_amx_support()``);
otherwise they launch a Triton kernel, which has no CPU target: ``RuntimeError: 0 active drivers`` on
the first GDN prefill. The same holds for the gated shared expert of its MoE blocks
(``Qwen2MoeSparseMoeBlock``), which SGLang adds with the Triton kernel behind
``fused_gate_sigmoid_mul(_add)`` unless the gate is an AMX-packed weight.

This plugin computes both functions in plain torch where SGLang would launch Triton:
``y = rms_norm(x) * weight * act(gate)`` (the norm over the last dimension in float32; ``act`` is SiLU for
``swish``/``silu``, sigmoid for ``sigmoid``) and ``out (+)= sigmoid(x @ gate_weight) * shared_output``.
Engine tests put this directory on ``PYTHONPATH`` for GDN engines (its ``.dist-info`` declares the
``sglang.srt.plugins`` entry point).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

_FUSED = "sglang.kernels.ops.attention.fla.fused_norm_gate.FusedRMSNormGated.forward"
_PLAIN = "sglang.kernels.ops.attention.fla.layernorm_gated.RMSNorm.forward"
_SHARED_GATE = "sglang.kernels.ops.elementwise.elementwise._launch_fused_gate_sigmoid_mul"


def register() -> None:
    """Entry point: route both gated norms through :func:`gated_rms_norm` on a CPU without AMX."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.utils import cpu_has_amx_support, is_cpu

    if is_cpu() and not cpu_has_amx_support():
        HookRegistry.register(_FUSED, fused_forward, HookType.AROUND)
        HookRegistry.register(_PLAIN, plain_forward, HookType.AROUND)
        HookRegistry.register(_SHARED_GATE, shared_expert_gate, HookType.AROUND)


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor | None, weight: torch.Tensor | None, eps: float, activation: str
) -> torch.Tensor:
    """``rms_norm(x) * weight * act(gate)`` over the last dimension, computed in float32, in ``x``'s dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        h = h * weight.float()
    if gate is not None:
        z = gate.float()
        h = h * (torch.sigmoid(z) if activation == "sigmoid" else F.silu(z))
    return h.to(x.dtype)


def fused_forward(
    original: Any, module: Any, x: torch.Tensor, g: torch.Tensor, *args: Any, **kwargs: Any
) -> Any:
    """``FusedRMSNormGated.forward`` without a residual (the form SGLang's GDN layers call)."""
    if args or kwargs.get("residual") is not None or kwargs.get("prenorm"):
        return original(module, x, g, *args, **kwargs)
    return gated_rms_norm(x, g, module.weight, module.eps, module.activation)


def plain_forward(original: Any, module: Any, x: torch.Tensor, z: torch.Tensor | None = None) -> Any:
    """``layernorm_gated.RMSNorm.forward`` for its one-group, norm-before-gate form."""
    if module.group_size is not None or not module.norm_before_gate:
        return original(module, x, z)
    return gated_rms_norm(x, z, module.weight, module.eps, module.activation)


def shared_expert_gate(
    original: Any,
    hidden_states: torch.Tensor,
    gate_weight: torch.Tensor,
    shared_output: torch.Tensor,
    output: torch.Tensor,
    do_add: bool,
    *args: Any,
    **kwargs: Any,
) -> None:
    """``output (+)= sigmoid(hidden_states @ gate_weight) * shared_output`` (gate weight ``(hidden,)``)."""
    gate = torch.sigmoid(hidden_states.float() @ gate_weight.float().reshape(-1))[:, None]
    gated = (gate * shared_output.float()).to(output.dtype)
    if do_add:
        output += gated
    else:
        output.copy_(gated)
