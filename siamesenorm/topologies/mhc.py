"""Manifold-constrained Hyper-Connections (mHC; Xie et al., arXiv 2512.24880), expansion rate n
(``mhc_expansion_rate``, default 4).

The residual state is n streams H = (h_1 .. h_n), each (B, T, d). Around every sublayer F (attention, MLP; each
with OLMo's Pre-Norm inside: F(LN(.))), per token, with h~ = RMSNorm(flatten(H)) of size n*d:

    H_pre  = sigmoid(a_pre * h~ P_pre + b_pre)                       in (0, 1)^n
    H_post = 2 * sigmoid(a_post * h~ P_post + b_post)                in (0, 2)^n
    H_res  = Sinkhorn(a_res * mat(h~ P_res) + b_res)                 n x n, doubly stochastic
    input  = sum_s H_pre[s] h_s
    h_j   <- sum_s H_res[j, s] h_s + H_post[j] * F(input)

Sinkhorn(M) alternately normalises the columns and rows of exp(M) (``mhc_sinkhorn_iterations``, 20, in the log
domain; columns first, then rows, as the paper's T_r(T_c(.)): ``mhc_sinkhorn_order``), so H_res has rows and columns summing to 1 and the residual mixing can neither grow nor shrink the
streams' mean. The coefficients are computed in fp32 with autocast off, whatever the training precision.

Choices where implementations disagree (documented in docs/architecture.md):
  * init: P = N(0, 1/(n*d)) (unit-variance logits before the gates), gates a = 0.01, b_post = 0 (H_post = 1:
    every stream receives F's output, as in Hyper-Connections), b_pre = logit(1/n) (the branch reads the mean
    of the streams; 0 for n = 1), b_res = 0 (H_res starts uniform, 1/n everywhere). Uniform rather than
    near-identity because Sinkhorn converges slowly near a permutation matrix: from a 0.95-diagonal start,
    20 iterations left column sums 1.8e-3 off 1, from the uniform start 2.4e-7 (scripts/sinkhorn_convergence.py);
  * the factor 2 on H_post is kept (so that the init above gives 1);
  * output: the mean of the n streams (at init all streams are equal, so the model starts as Pre-Norm);
    OLMo's ``ln_f`` follows. Block 0 copies the embedding into every stream.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from olmo.config import ModelConfig

from ..config import knob
from ..nn.topologies import sinkhorn  # the one definition, shared with the plain-PyTorch core
from .base import ConnectedStreamsBlock, TopologyBlock, norm_params

__all__ = ["ManifoldHyperConnection", "ManifoldHyperConnectionBlock", "sinkhorn"]

_GATE_INIT = 0.01


class ManifoldHyperConnection(nn.Module):
    """The pre / post / residual mappings around one sublayer."""

    def __init__(self, block: TopologyBlock, n: int, iterations: int, order: str = "columns_first"):
        super().__init__()
        d, device = block.config.d_model, block.config.init_device
        self.n, self.iterations, self.order = n, iterations, order
        self.norm = block.new_norm(n * d)
        self.proj = nn.Parameter(torch.empty(n * d, n * n + 2 * n, device=device))  # P_pre | P_post | P_res
        self.gates = nn.Parameter(torch.empty(3, device=device))  # a_pre, a_post, a_res
        self.bias_pre = nn.Parameter(torch.empty(n, device=device))
        self.bias_post = nn.Parameter(torch.empty(n, device=device))
        self.bias_res = nn.Parameter(torch.empty(n, n, device=device))
        self.reset_parameters()

    def reset_parameters(self):
        n = self.n
        self.norm.reset_parameters()
        with torch.no_grad():
            nn.init.normal_(self.proj, std=1.0 / math.sqrt(self.proj.shape[0]))
            self.gates.fill_(_GATE_INIT)
            self.bias_pre.fill_(-math.log(n - 1) if n > 1 else 0.0)  # logit(1/n)
            self.bias_post.zero_()
            self.bias_res.zero_()

    def coefficients(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h: (B, T, n, d) -> H_pre (B, T, n), H_post (B, T, n), H_res (B, T, n, n); all fp32."""
        n = self.n
        with torch.autocast(device_type=h.device.type, enabled=False):
            normed = self.norm(h.flatten(-2)).float()
            logits = normed @ self.proj.float()
            gates = self.gates.float()
            pre = torch.sigmoid(gates[0] * logits[..., :n] + self.bias_pre.float())
            post = 2.0 * torch.sigmoid(gates[1] * logits[..., n : 2 * n] + self.bias_post.float())
            res_logits = gates[2] * logits[..., 2 * n :].unflatten(-1, (n, n)) + self.bias_res.float()
            res = sinkhorn(res_logits, self.iterations, self.order)
        return pre, post, res

    def width(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> branch input (B, T, d), mixed streams H_res H (B, T, n, d), H_post (B, T, n), in h's dtype."""
        pre, post, res = self.coefficients(h)
        inp = torch.einsum("btsd,bts->btd", h, pre.to(h.dtype))
        mixed = torch.einsum("btjs,btsd->btjd", res.to(h.dtype), h)
        return inp, mixed, post.to(h.dtype)

    @staticmethod
    def num_params(config: ModelConfig, n: int) -> int:
        d = config.d_model
        return norm_params(config, n * d) + n * d * (n * n + 2 * n) + 3 + 2 * n + n * n


class ManifoldHyperConnectionBlock(ConnectedStreamsBlock):
    connection_names = ("attn_mhc", "ff_mhc")

    def __init__(self, layer_id, config, cache):
        super().__init__(layer_id, config, cache)
        self.n_streams = config.mhc_expansion_rate
        args = (self.n_streams, config.mhc_sinkhorn_iterations, knob(config, "mhc_sinkhorn_order"))
        self.attn_mhc = ManifoldHyperConnection(self, *args)
        self.ff_mhc = ManifoldHyperConnection(self, *args)

    def contributions(self, streams):  # the mean of the streams
        return [s / self.n_streams for s in streams]

    def fusion_weights(self) -> list[float]:
        return [1.0 / self.n_streams] * self.n_streams

    @classmethod
    def extra_params(cls, config: ModelConfig, layer_id: int) -> int:
        n = config.mhc_expansion_rate
        return super().extra_params(config, layer_id) + 2 * ManifoldHyperConnection.num_params(config, n)
