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
  * ``model.fused_streams``: Sinkhorn as one op each way and the norm's division after the product
    (siamesenorm/nn/fused.py ``sinkhorn``; ManifoldHyperConnection's docstring);
  * output: the mean of the n streams (at init all streams are equal, so the model starts as Pre-Norm);
    OLMo's ``ln_f`` follows. Block 0 copies the embedding into every stream.
"""

from __future__ import annotations

from ..nn.topologies import SINKHORN_ORDERS, ManifoldHyperConnection
from ._base import ConnectedStreamsBlock
from .spec import Knob, Variant, knob

__all__ = ["ManifoldHyperConnectionBlock", "VARIANT"]


class ManifoldHyperConnectionBlock(ConnectedStreamsBlock):
    EXPANSION_KNOB = "mhc_expansion_rate"
    connection_names = ("attn_mhc", "ff_mhc")

    def __init__(self, layer_id, config, cache):
        super().__init__(layer_id, config, cache)
        args = dict(n=self.n_streams, dim=config.d_model, norm=lambda size: self.new_norm(size),
                    iterations=knob(config, "mhc_sinkhorn_iterations"), order=knob(config, "mhc_sinkhorn_order"),
                    device=config.init_device, fused=self.fused_streams)
        self.attn_mhc = ManifoldHyperConnection(**args)
        self.ff_mhc = ManifoldHyperConnection(**args)

    def contributions(self, streams):  # the mean of the streams
        return [s / self.n_streams for s in streams]

    def fusion_weights(self):
        return [1.0 / self.n_streams] * self.n_streams


VARIANT = Variant(
    name="mhc", display_name="mHC", colour="black", block=ManifoldHyperConnectionBlock, order=10, table_row=10,
    knobs=(
        Knob("mhc_expansion_rate", 4, minimum=1, usual="mHC uses 4",
             doc="Number of residual streams n (the mHC paper's 4)."),
        Knob("mhc_sinkhorn_iterations", 20, minimum=1, usual="mHC uses 20",
             doc="Sinkhorn-Knopp iterations that make each residual mixing matrix doubly stochastic."),
        Knob("mhc_sinkhorn_order", "columns_first", legacy="rows_first", choices=SINKHORN_ORDERS,
             doc="The order within one Sinkhorn iteration, see siamesenorm.nn.SINKHORN_ORDERS (default: the mHC "
                 "paper's)."),
    ),
)
