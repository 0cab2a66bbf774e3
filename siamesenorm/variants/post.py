"""Post-Norm, after the attention and after the MLP sublayer. Two placements (``model.post_norm_position``):

    "after_addition" (default; paper eq. 2, the original Transformer):
        X_{i+1} = LN_i(X_i + F_i(X_i))                 X_0 = embedding; the last block's output is normalised
    "before_sublayer" (the HybridNorm OLMo fork's Post-Norm switch, its model.py lines 815-821 and 870-881):
        X'      = LN_i(X_i)
        X_{i+1} = X' + F_i(X')                         X_0 enters LN, the last block's output reaches ln_f as is

Both are the same chain of "add, normalise" steps shifted by one norm: the fork normalises the embedding and
leaves the last sum to OLMo's ``ln_f``. OLMo's final norm ``ln_f`` follows the last block in both; on an already
normalised state it only rescales. Note: OLMo's own ``norm_after`` flag computes X + LN(F(X)), which is neither.
"""

from __future__ import annotations

from typing import Optional

from ..nn.topologies import NORM_POSITIONS, post_norm_update
from ._base import TopologyBlock
from .spec import Knob, Variant, knob

__all__ = ["PostNormBlock", "VARIANT"]


class PostNormBlock(TopologyBlock):
    """``attn_norm`` and ``ff_norm`` (OLMo's names) are the norms of the attention and the MLP sublayer.

    ``residual_scale`` multiplies X before the addition: 1 here, DeepNorm's alpha in its subclass."""

    residual_scale: float = 1.0
    #: The config field that picks the placement; None: always after the addition (DeepNorm, Mix-LN's Post-LN layers).
    position_knob: Optional[str] = "post_norm_position"

    def update(self, x, attention):
        position = knob(self.config, self.position_knob) if self.position_knob is not None else "after_addition"
        x = post_norm_update(x, attention, self.normed(self.attn_norm), position, self.residual_scale)
        x = post_norm_update(x, self.mlp, self.normed(self.ff_norm), position, self.residual_scale)
        return x


VARIANT = Variant(
    name="post", display_name="Post-Norm", colour="tab:orange", block=PostNormBlock, order=1, table_row=3,
    knobs=(Knob("post_norm_position", "after_addition", legacy="after_addition", choices=NORM_POSITIONS,
                doc='Where the norm sits, see siamesenorm.nn.NORM_POSITIONS. Default: paper eq. 2 (classic '
                    'Post-LN); "before_sublayer" is the HybridNorm OLMo fork\'s Post-Norm switch.'),),
)
