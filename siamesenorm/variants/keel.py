"""Keel (Chen and Wei, "Post-LayerNorm Is Back: Stable, ExpressivE, and Deep", arXiv 2601.19895): Post-Norm whose
residual is a highway-style scaled shortcut, with a second norm inside the branch, after the attention and after
the MLP sublayer:

    X_{i+1} = LN_out( alpha * X_i + F( LN_in(X_i) ) )          X_0 = embedding
    alpha   = L, the number of sublayers (2 x n_layers)       (``keel_alpha``; "layers": n_layers)

OLMo's final norm follows the last block (on an already normalised state it only rescales). No special init
(the paper's point against DeepNorm): OLMo's own.

Source of the equation: the arXiv HTML of the paper could not be read past its abstract from here; the form above
is how four independent readings of the paper state it (an executive summary of the PDF: "a scalar alpha, set to
alpha = L (the total number of sub-layers)" with "an internal LayerNorm stage" and "a dual-LN structure"; a topic
page's table: x_{l+1} = LN_1(alpha x_l + F(LN_2(x_l))), "dual (RMSNorm)", "scalar alpha scaling (Highway)"; two
re-implementations write LN_out(alpha x + F(LN_in(x)))). They agree on the form; they differ on whether L counts
sublayers or layers, so the default follows the summary of the PDF (sublayers) and ``keel_alpha: layers`` gives
the other reading. Equation numbers in the paper: not verified here.

Diagram (one sublayer)::

    X ──── x alpha ───────────(+)── LN_out ── X_{i+1}
     └── LN_in ── F ───────────┘

Compared with DeepNorm (deepnorm.py: LN(alpha X + F(X)), alpha = (2N)^(1/4), beta-scaled init): Keel adds LN_in,
takes a far larger alpha and keeps the standard init.
"""

from __future__ import annotations

from ..nn.topologies import post_norm_update
from .post import PostNormBlock
from .spec import Knob, Variant

__all__ = ["KeelBlock", "keel_alpha", "VARIANT"]

KEEL_ALPHA_FORMS = ("sublayers", "layers")


def keel_alpha(n_layers: int, form: str = "sublayers") -> float:
    """alpha = L: the number of sublayers (2 per block) or, with ``form="layers"``, of blocks."""
    return float(2 * n_layers if form == "sublayers" else n_layers)


class KeelBlock(PostNormBlock):
    """``attn_norm`` / ``ff_norm`` are LN_out (Post-Norm's norms); ``attn_in_norm`` / ``ff_in_norm`` are LN_in."""

    position_knob = None  # always after the addition

    def __init__(self, layer_id, config, cache):
        super().__init__(layer_id, config, cache)
        self.residual_scale = keel_alpha(config.n_layers, getattr(config, "keel_alpha", "sublayers"))
        self.attn_in_norm = self.new_norm()
        self.ff_in_norm = self.new_norm()

    def update(self, x, attention):
        x = post_norm_update(x, lambda h: attention(self.norm(self.attn_in_norm, h)), self.normed(self.attn_norm),
                             "after_addition", self.residual_scale)
        return post_norm_update(x, lambda h: self.mlp(self.norm(self.ff_in_norm, h)), self.normed(self.ff_norm),
                                "after_addition", self.residual_scale)


VARIANT = Variant(
    name="keel", display_name="Keel", colour="teal", block=KeelBlock, order=21, table_row=21,
    knobs=(Knob("keel_alpha", "sublayers", choices=KEEL_ALPHA_FORMS,
                doc='keel: alpha = L, the number of sublayers (2 x n_layers, default: the PDF summary\'s '
                    'reading) or "layers" (n_layers).'),),
)
