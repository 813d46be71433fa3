"""Sparse mixture-of-experts MLP of Qwen3-Next (router, top-k experts, gated shared expert).

``softmax`` router in float32 → top-``k`` experts per token (weights renormalised when
``norm_topk_prob``) → weighted sum of the chosen SwiGLU experts, plus
``sigmoid(shared_expert_gate(x)) · shared_expert(x)``. Parameter names follow the Hugging
Face checkpoints (``mlp.gate``, ``mlp.experts.{e}.{gate,up,down}_proj``,
``mlp.shared_expert.*``, ``mlp.shared_expert_gate``).

Row-count invariance (decode / verify / replay forwards, :class:`~dflash.model.layers.Ops`):
the router runs per token on CPU, the top-k weights are summed in slot order (no
reduction kernel), every projection is an M-invariant linear, and a token's expert
outputs are added in ascending expert id whatever other tokens the call carries.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dflash.model.config import HybridConfig
from dflash.model.layers import MLP, Ops


class SparseMoE(nn.Module):
    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = nn.Linear(h, config.num_experts, bias=False)
        self.experts = nn.ModuleList(
            MLP(h, config.moe_intermediate_size) for _ in range(config.num_experts)
        )
        self.shared_expert = MLP(h, config.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(h, 1, bias=False)

    def _route(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """``logits: [..., E]`` → (weights ``[..., k]`` in logits' dtype, expert ids)."""
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            total = weights[..., 0]
            for i in range(1, self.top_k):  # slot order, the same for every row count
                total = total + weights[..., i]
            weights = weights / total[..., None]
        return weights.to(logits.dtype), chosen

    def forward(self, x: Tensor, ops: Ops | None = None) -> Tensor:
        """``x: [B, T, hidden]`` → ``[B, T, hidden]`` (``ops`` None: plain torch modules)."""
        shape = x.shape
        if ops is None:
            weights, chosen = self._route(self.gate(x))
            shared_gate = self.shared_expert_gate(x)
        else:
            logits = ops.linear(self.gate, x)  # [B, T, E]
            weights, chosen = ops.each_token_many(self._route, logits)
            shared_gate = ops.linear(self.shared_expert_gate, x)
        flat = x.reshape(-1, shape[-1])  # [N, hidden]
        weights, chosen = weights.reshape(flat.shape[0], -1), chosen.reshape(flat.shape[0], -1)
        out = torch.zeros_like(flat)
        for expert_id in torch.unique(chosen).tolist():  # ascending
            rows, slot = torch.where(chosen == expert_id)
            if ops is not None and ops.tiles is not None:
                # a subset of rows would lose their tile positions: the expert runs on every
                # row of the call (CPU) and its chosen rows are kept
                y = self.experts[expert_id](x, ops).reshape(flat.shape)[rows]
            else:
                y = self.experts[expert_id](flat[rows][None], ops)[0]
            y = y * weights[rows, slot, None]
            out.index_add_(0, rows, y.to(out.dtype))
        shared = self.shared_expert(x, ops)  # [B, T, hidden]
        if ops is None:
            gated = torch.sigmoid(shared_gate) * shared
        else:
            gated = ops.each_token(_gated, shared_gate, shared)
        result: Tensor = out.reshape(shape) + gated
        return result


def _gated(gate: Tensor, shared: Tensor) -> Tensor:
    return torch.sigmoid(gate) * shared
