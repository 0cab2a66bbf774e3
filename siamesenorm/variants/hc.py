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

from ..nn.topologies import HyperConnection
from ._base import ConnectedStreamsBlock
from .spec import Knob, Variant, knob

__all__ = ["HyperConnectionBlock", "VARIANT"]


class HyperConnectionBlock(ConnectedStreamsBlock):
    EXPANSION_KNOB = "hc_expansion_rate"
    connection_names = ("attn_hc", "ff_hc")

    def __init__(self, layer_id, config, cache):
        super().__init__(layer_id, config, cache)
        args = dict(n=self.n_streams, dim=config.d_model, layer=layer_id, norm=lambda size: self.new_norm(size),
                    decay_dynamic=knob(config, "hc_decay_dynamic"), device=config.init_device,
                    fused=self.fused_streams)
        self.attn_hc = HyperConnection(**args)
        self.ff_hc = HyperConnection(**args)

    def reset_parameters(self):
        super().reset_parameters()
        if knob(self.config, "hc_scale_output_init"):
            with torch.no_grad():
                for linear in (self.attn_out, self.ff_out):
                    linear.weight.div_(math.sqrt(self.n_streams))


VARIANT = Variant(
    name="hc", display_name="Hyper-Connections", colour="tab:purple", block=HyperConnectionBlock, order=3,
    table_row=9,
    knobs=(
        Knob("hc_expansion_rate", 2, minimum=1, usual="the paper uses 2",
             doc="Number of residual streams n (the paper's baseline is DHCx2)."),
        Knob("hc_scale_output_init", True, legacy=False,
             doc="Divide the init of the attention and MLP output weights (attn_out, ff_out) by sqrt(n) (HC paper "
                 "section 4), since every sublayer's output is written into all n streams."),
        Knob("hc_decay_dynamic", True, legacy=False,
             doc="Weight decay on the dynamic projections (dynamic_alpha_fn, dynamic_beta_fn), none on the static "
                 "connection weights and the dynamic scales (HC paper section 4). False: no decay on any HC "
                 "coefficient."),
    ),
)
