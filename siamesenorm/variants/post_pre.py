"""SiameseNorm, Post-Norm x Pre-Norm (paper section 3, with the two mechanisms of section 4.2).

Two streams share every sublayer F (attention, then MLP). X is bounded (Post-Norm-like), Y keeps a clean identity
path (Pre-Norm-like); X_0 = Y_0 = embedding. c(l) is the depth-wise scaling (default sqrt(2(l+1)); 1 when off).
For each sublayer of layer l, with ``model.post_pre_x_norm_position`` choosing where LN^X sits:

    "before_sublayer" (default; the official DeiT/DiT SiameseNorm Block, deit-model-siamesenorm.py lines 216-227):
        X  = LN^X(X)                               (attn_norm_x / ff_norm_x)
        H  = LN^in(X + LN^Y(Y))                    (attn_norm / ff_norm; attn_norm_y / ff_norm_y)
        O  = F(H);      X = X + O / c(l);   Y = Y + O
      so layer 0 sees LN^X(embedding), and the last block's X enters the fusion without a further LN^X.

    "after_addition" (the paper's section-3 text):
        H  = LN^in(X + LN^Y(Y))
        O  = F(H);      X = LN^X(X + O / c(l)); Y = Y + O

Without the normalized input (``siamese_normalized_input=false``) H = X + LN^Y(Y). After the last layer:
output = LN_final(LN^out_X(X) + LN^out_Y(Y)), LN_final being OLMo's ``ln_f``, LN^out_X / LN^out_Y (out_norm_x /
out_norm_y) living in the last block; their scales are the fusion weights. (The official head names them
pre_norm(x) and post_norm(y).)

         X --[LN^X]--+---------------(+ O/c)--[LN^X]--> X       [LN^X]: one of the two, per the knob
                     |                  ^
         Y --+--LN^Y-(+)--LN^in--F------+
             |                          |
             +--------------------(+ O)-------------------> Y

With ``siamese_mixing`` (not in the paper; its appendix A.1 names the omission): before each sublayer
[X; Y] <- H [X; Y], H doubly stochastic (siamesenorm.nn.StreamMixing), then the sublayer as above; "before_sublayer"'s
LN^X follows the mix and restores X's bound; with "after_addition" X <- LN^mix(X) right after the mix
(``attn_mix_norm_x`` / ``ff_mix_norm_x``), as the sublayer's input would otherwise read an unbounded X. With
``model.fused_streams`` ("before_sublayer") the mix is one op (siamesenorm.nn.fused.pair_mix, the attention's add
folded into the MLP's mix) before the sublayer's fused norms.

Reductions (section 3, tested for both placements): with every LN^X scale zeroed (out_norm_x included) this is
Pre-Norm (RMSNorm, normalized input on); with every LN^Y scale zeroed it is Post-Norm with the same placement
(post_norm_position = this knob; depth scaling and normalized input off).
"""

from __future__ import annotations

from ..nn.fused import stream_input
from ..nn.topologies import NORM_POSITIONS, siamese_update
from ._base import SIAMESE_KNOBS, TwoStreamBlock, mixed_sublayers
from .spec import Knob, Variant, knob

__all__ = ["SiamesePostPreBlock", "VARIANT"]


class SiamesePostPreBlock(TwoStreamBlock):
    STREAMS = ("x_post", "y_pre")

    def __init__(self, layer_id, config, cache):
        super().__init__(layer_id, config, cache)
        self.attn_norm_x, self.attn_norm_y = self.new_norm(), self.new_norm()
        self.ff_norm_x, self.ff_norm_y = self.new_norm(), self.new_norm()
        if not self.x_norm_before_sublayer:  # no LN^X follows the mix: X's bound restored by its own norm
            for prefix in mixed_sublayers(config, layer_id):
                setattr(self, prefix + "_mix_norm_x", self.new_norm())

    @classmethod
    def unused_norms(cls, config, layer_id):
        # attn_norm / ff_norm are LN^in, the normalized-input norms: gone when that mechanism is off.
        return () if knob(config, "siamese_normalized_input") else ("attn_norm", "ff_norm")

    @property
    def x_norm_before_sublayer(self) -> bool:
        return knob(self.config, "post_pre_x_norm_position") == "before_sublayer"

    def update(self, x, attention):
        normalized = knob(self.config, "siamese_normalized_input")
        position = knob(self.config, "post_pre_x_norm_position")
        if self.fused_streams and position == "before_sublayer":
            return self.fused_update(x, attention, normalized)
        xs, ys = self.split_streams(x)
        for branch, prefix in ((attention, "attn"), (self.mlp, "ff")):
            xs, ys = self.mix(prefix, xs, ys, x_norm=None if position == "before_sublayer" else prefix + "_mix_norm_x")
            xs, ys = siamese_update(
                xs, ys, branch, x_norm=getattr(self, f"{prefix}_norm_x"), y_norm=getattr(self, f"{prefix}_norm_y"),
                in_norm=getattr(self, f"{prefix}_norm") if normalized else None, c=self.depth_scale,
                x_norm_position=position, run=self.cheap)
        return self.finish([xs, ys])

    def fused_update(self, state, attention, normalized: bool):
        """LN^X before each sublayer through the fused ops (model.fused_streams): the attention's input fusion on
        the stacked state itself (``fused_input``), the attention output's add fused with the MLP's input fusion,
        and the MLP output's add."""
        # stream mixing: the mix one op before the sublayer's (``fused_mix``); the op after the MLP's mix writes the Y
        # it passes on (``copy``), the op after the attention's does not (the MLP's mix keeps its input streams, so
        # a copy would be one more tensor kept a layer, for one pass saved)
        if hasattr(self, "attn_mix"):
            xs, ys = self.fused_mix("attn", None, state)
            xs, ys, h = stream_input(xs, ys, **self.fused_norms("attn", normalized))
        else:
            xs, ys, h = self.fused_input(state, **self.fused_norms("attn", normalized))
        r = attention(h)
        if hasattr(self, "ff_mix"):  # the attention's add folded into the mix
            xs, ys = self.fused_mix("ff", xs, ys, r)
            xs, ys, h = stream_input(xs, ys, copy=True, **self.fused_norms("ff", normalized))
        else:
            xs, ys, h = stream_input(xs, ys, r, **self.fused_norms("ff", normalized))
        return self.end(xs, ys, self.mlp(h))

    def fused_norms(self, prefix: str, normalized: bool) -> dict:
        """The fused op's arguments for sublayer ``prefix``: LN^X, LN^Y, LN^in (when ``normalized``), depth scale."""
        return dict(scale=1.0 / self.depth_scale, x_norm=True, x_weight=self.weight(getattr(self, f"{prefix}_norm_x")),
                    y_weight=self.weight(getattr(self, f"{prefix}_norm_y")), in_norm=normalized,
                    in_weight=self.weight(getattr(self, f"{prefix}_norm")) if normalized else None,
                    eps=self.config.layer_norm_eps)

    def input_scales(self, previous: "SiamesePostPreBlock | None") -> dict:
        """(scale of X, scale of Y) as each sublayer's input receives them (paper figure 6): X's scale is that of
        the LN^X it last went through, Y's that of this sublayer's LN^Y. before_sublayer: this block's attn_norm_x /
        ff_norm_x. after_addition: the previous sublayer's LN^X (None before layer 0's attention: X_0 = embedding)."""
        if self.x_norm_before_sublayer:
            return {"attention": (self.attn_norm_x, self.attn_norm_y), "mlp": (self.ff_norm_x, self.ff_norm_y)}
        x_attn = previous.ff_norm_x if previous is not None else None
        return {"attention": (x_attn, self.attn_norm_y), "mlp": (self.attn_norm_x, self.ff_norm_y)}


VARIANT = Variant(
    name="post_pre", display_name="SiameseNorm (Post-Norm + Pre-Norm)", colour="tab:olive", block=SiamesePostPreBlock,
    order=4, table_row=11,
    knobs=SIAMESE_KNOBS + (
        Knob("post_pre_x_norm_position", "before_sublayer", legacy="after_addition", choices=NORM_POSITIONS,
             doc="Where LN^X of the bounded stream sits, see siamesenorm.nn.NORM_POSITIONS. Default: the official "
                 "DeiT/DiT SiameseNorm Block (LN^X at the start of each sublayer); \"after_addition\" is the "
                 "paper's section-3 text."),
    ),
    stream_labels={"x_post": "X (bounded, Post-Norm)", "y_pre": "Y (Pre-Norm)"},
)
