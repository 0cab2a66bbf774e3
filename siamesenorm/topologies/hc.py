"""Hyper-Connections, dynamic (DHC; Zhu et al., arXiv 2409.19606), expansion rate n (``hc_expansion_rate``).

The residual stream is n copies H = (h_1 .. h_n), each (B, T, d). Every sublayer F (attention, MLP; each with
OLMo's Pre-Norm inside: F(LN(.))) gets its own hyper-connection with

    static  A_s in R^{n x (1+n)}, initialised to [e_(l mod n) | I_n];   B_s in R^n, initialised to ones
    dynamic A(H) = A_s + s_a * tanh(norm(H) W_a),   W_a in R^{d x (1+n)} initialised to 0,  s_a = 0.01
            B(H) = B_s + s_b * tanh(norm(H) w_b),   w_b in R^d initialised to 0,            s_b = 0.01

    input  = sum_s A[s, 0] h_s                       (width connection)
    h_j   <- sum_s A[s, 1+j] h_s + B_j * F(input)    (depth connection)

At initialisation layer l (both of its sublayers) reads stream l mod n and adds its output to every stream, so
all streams stay equal to the Pre-Norm state. The embedding is copied into every stream by block 0, and the last
block sums the streams; OLMo's ``ln_f`` follows.

HC paper section 4, followed by default:
  * the output weights of attention and MLP (attn_out, ff_out) start with OLMo's init divided by sqrt(n)
    (``hc_scale_output_init``): each sublayer output is written into all n streams, which the output sums. The
    paper says the std is "scaled by sqrt(n)"; dividing is the reading under which the summed output keeps a
    Pre-Norm-like scale (docs/fidelity.md);
  * weight decay on the dynamic projections W_a, w_b; none on the static A_s, B_s nor on the scales s_a, s_b
    (``hc_decay_dynamic``).
norm(H) in the dynamic part is the model's own norm (``layer_norm_type``: RMSNorm in every recipe here, eps
1e-5), one per connection, affine like the model's other norms; the HC paper's Algorithm 2 writes LayerNorm.
With the same norm the connections equal lucidrains' hyper-connections exactly (docs/fidelity.md).

    h_1 ---A---+-------------------(+ B_1 F)---> h_1
    h_2 ---A---+--> input --LN--F--+
     ...       |                   (+ B_j F)---> h_j
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from olmo.config import ModelConfig

from ..config import knob
from .base import ConnectedStreamsBlock, TopologyBlock, norm_params

__all__ = ["HyperConnection", "HyperConnectionBlock"]

_DYNAMIC_SCALE_INIT = 0.01


class HyperConnection(nn.Module):
    """The width and depth connections around one sublayer."""

    def __init__(self, block: TopologyBlock, n: int, read_stream: int):
        super().__init__()
        d, device = block.config.d_model, block.config.init_device
        self.n, self.read_stream = n, read_stream
        #: Parameters of this module that take weight decay (siamesenorm.train builds the optimizer groups).
        self.weight_decay_params = (
            ("dynamic_alpha_fn", "dynamic_beta_fn") if knob(block.config, "hc_decay_dynamic") else ()
        )
        self.norm = block.new_norm()
        self.static_alpha = nn.Parameter(torch.zeros(n, 1 + n, device=device))
        self.static_beta = nn.Parameter(torch.ones(n, device=device))
        self.dynamic_alpha_fn = nn.Parameter(torch.zeros(d, 1 + n, device=device))
        self.dynamic_alpha_scale = nn.Parameter(torch.full((1,), _DYNAMIC_SCALE_INIT, device=device))
        self.dynamic_beta_fn = nn.Parameter(torch.zeros(d, device=device))
        self.dynamic_beta_scale = nn.Parameter(torch.full((1,), _DYNAMIC_SCALE_INIT, device=device))
        self.reset_parameters()

    def reset_parameters(self):
        self.norm.reset_parameters()
        with torch.no_grad():
            self.static_alpha.zero_()
            self.static_alpha[self.read_stream, 0] = 1.0
            self.static_alpha[:, 1:] = torch.eye(self.n, device=self.static_alpha.device)
            self.static_beta.fill_(1.0)
            self.dynamic_alpha_fn.zero_()
            self.dynamic_beta_fn.zero_()
            self.dynamic_alpha_scale.fill_(_DYNAMIC_SCALE_INIT)
            self.dynamic_beta_scale.fill_(_DYNAMIC_SCALE_INIT)

    def width(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h: (B, T, n, d) -> branch input (B, T, d), carried streams (B, T, n, d), beta (B, T, n)."""
        normed = self.norm(h)
        alpha = self.static_alpha + self.dynamic_alpha_scale * torch.tanh(normed @ self.dynamic_alpha_fn.to(h.dtype))
        beta = self.static_beta + self.dynamic_beta_scale * torch.tanh(normed @ self.dynamic_beta_fn.to(h.dtype))
        mixed = torch.einsum("btsd,btsk->btkd", h, alpha.to(h.dtype))  # (B, T, 1 + n, d)
        return mixed[:, :, 0], mixed[:, :, 1:], beta.to(h.dtype)

    @staticmethod
    def num_params(config: ModelConfig, n: int) -> int:
        d = config.d_model
        return norm_params(config) + n * (1 + n) + n + d * (1 + n) + 1 + d + 1


class HyperConnectionBlock(ConnectedStreamsBlock):
    connection_names = ("attn_hc", "ff_hc")

    def __init__(self, layer_id, config, cache):
        super().__init__(layer_id, config, cache)
        self.n_streams = config.hc_expansion_rate
        read = layer_id % self.n_streams
        self.attn_hc = HyperConnection(self, self.n_streams, read)
        self.ff_hc = HyperConnection(self, self.n_streams, read)

    def reset_parameters(self):
        super().reset_parameters()
        if knob(self.config, "hc_scale_output_init"):
            with torch.no_grad():
                for linear in (self.attn_out, self.ff_out):
                    linear.weight.div_(math.sqrt(self.n_streams))

    @classmethod
    def extra_params(cls, config: ModelConfig, layer_id: int) -> int:
        return super().extra_params(config, layer_id) + 2 * HyperConnection.num_params(config, config.hc_expansion_rate)
