"""Sparse mixture-of-experts MLP of Qwen3-Next (router, top-k experts, gated shared expert).

``softmax`` router in float32 → top-``k`` experts per token (weights renormalised when
``norm_topk_prob``) → weighted sum of the chosen SwiGLU experts, plus
``sigmoid(shared_expert_gate(x)) · shared_expert(x)``. Parameter names follow the Hugging
Face checkpoints (``mlp.gate``, ``mlp.experts.{e}.{gate,up,down}_proj``,
``mlp.shared_expert.*``, ``mlp.shared_expert_gate``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dflash.model.config import HybridConfig
from dflash.model.layers import MLP


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

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [N, hidden]
        logits = self.gate(flat)  # [N, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # [N, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(logits.dtype)
        out = torch.zeros_like(flat)
        for expert_id in torch.unique(chosen).tolist():
            rows, slot = torch.where(chosen == expert_id)
            y = self.experts[expert_id](flat[rows]) * weights[rows, slot, None]
            out.index_add_(0, rows, y.to(out.dtype))
        shared = torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        result: Tensor = (out + shared).reshape(shape)
        return result
