"""Attention Residuals (Kimi Team, "Attention Residuals", arXiv 2603.15031; the official repository
MoonshotAI/Attention-Residuals, its README's PyTorch-style pseudocode ``block_attn_res`` and ``forward``): the
residual sum replaced by softmax attention over depth. Each sublayer (attention, MLP) reads not the running sum
but a learned mixture of the earlier sublayers' outputs:

    h_l     = sum_{i=0}^{l-1} alpha_{i->l} v_i                     (the README's equation; l over sublayers)
    alpha   = softmax_i( w_l . RMSNorm(v_i) )                      (w_l: a learned pseudo-query, one per sublayer)
    v_0     = embedding,   v_i = F_i( LN_i(h_i) )                  (each sublayer keeps its Pre-Norm)
    output  = LN_final( sum_i alpha_{i->out} v_i )                 (one more pseudo-query before the final norm)

Full AttnRes (``attnres_blocks: 0``, the default) attends over every earlier sublayer output (O(L d) state a
token). Block AttnRes (``attnres_blocks: N``) partitions the n_layers into N blocks of n_layers / N layers:
inside a block the outputs are summed as in Pre-Norm (the partial sum b_n^i), and each sublayer attends over the
completed blocks' sums b_0 = embedding, b_1, ..., b_{n-1} and the partial sum; the README recommends about 8
blocks. A block's sum becomes a completed source when the next block's first sublayer starts.

Pseudo-queries start at zero (the paper: "all pseudo-query vectors must be initialized to zero"), so at step 0 every
sublayer reads the mean of its sources. Keys are normalised by a norm of the model's type (RMSNorm in every recipe
here, as in the paper), with a learned scale; the logits are not divided by sqrt(d) (the pseudocode does not).

Diagram (Full, one sublayer l)::

    v_0 ... v_{l-1} ──┬── RMSNorm ── . w_l ── softmax ──┐
                      └──────────────────── x alpha ─────┴─ h_l ── LN ── F ── v_l

Source and what is not from the paper's equations: the paper's HTML and PDF could not be read here past the
abstract; the equation for h_l, the pseudo-query, RMSNorm on the keys and the block rule are from the official
README's equation and pseudocode (which counts ATTN + MLP as two layers, as this file's sublayers); the final
aggregation before the output norm and the two pseudo-queries per transformer layer are as the paper's
reproductions state them ("one RMSNorm and one pseudo-query vector per layer", each sublayer a layer). The paper's
equation numbers were not verified here.

OLMo's block contract (one tensor in, one out): the sources travel concatenated on the feature axis,
(B, T, S * d), S = the completed sources plus the partial sum (``attn_res_sources_at``); S grows with depth, and
the last block aggregates them to (B, T, d) for OLMo's ``ln_f``.
"""

from __future__ import annotations

import torch

from ..nn.topologies import AttnResStreams
from ._base import TopologyBlock
from .spec import Knob, Variant, fail, knob

__all__ = ["AttnResBlock", "attnres_block_sublayers", "VARIANT"]


def attnres_block_sublayers(config) -> int:
    """Sublayers per AttnRes block: 1 for Full AttnRes, 2 x n_layers / N for N blocks."""
    blocks = int(knob(config, "attnres_blocks"))
    return 1 if blocks == 0 else 2 * config.n_layers // blocks


class AttnResBlock(AttnResStreams, TopologyBlock):
    """``attn_norm`` / ``ff_norm`` keep their Pre-Norm role; ``attn_query`` / ``ff_query`` are w_l of the two
    sublayers, ``attn_key_norm`` / ``ff_key_norm`` their key norms (block 0's attention has neither: it reads the
    embedding alone); the last block has ``out_query`` and ``out_key_norm`` for the final aggregation."""

    STREAMS = ("residual",)

    def __init__(self, layer_id, config, cache):
        super().__init__(layer_id, config, cache)
        self.block_sublayers = attnres_block_sublayers(config)
        self.first_sublayer = 2 * layer_id
        self.build_attn_res(config.d_model, self.new_norm, config.init_device)

    def reset_parameters(self):
        super().reset_parameters()
        self.zero_queries()

    def update(self, x, attention, branches=None):
        return self.attn_res_forward(x, branches or (attention, self.mlp), (self.attn_norm, self.ff_norm), self.cheap)

    def skip(self, x):
        """This block with its sublayers removed (the depth probe): each sublayer's output is zero."""
        return self.update(x, None, branches=(torch.zeros_like, torch.zeros_like))


def validate(config, model_type: str) -> None:
    blocks = knob(config, "attnres_blocks")
    if blocks and config.n_layers % blocks:
        fail(f"model.attnres_blocks {blocks} does not divide model.n_layers {config.n_layers}: Block AttnRes needs "
             "blocks of whole layers; pick a divisor of n_layers (about 8 blocks, the paper's choice), or 0 for Full "
             "AttnRes.")


VARIANT = Variant(
    name="attnres", display_name="AttnRes", colour="darkorchid", block=AttnResBlock, order=23, table_row=23,
    validate=validate,
    knobs=(Knob("attnres_blocks", 0, minimum=0, usual="the paper uses about 8 blocks for Block AttnRes",
                doc="attnres: 0 for Full AttnRes (every sublayer attends over every earlier sublayer output), or N "
                    "for Block AttnRes with N blocks of n_layers / N layers (N must divide n_layers)."),),
)
