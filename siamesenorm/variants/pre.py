"""Pre-Norm (paper eq. 1), for the attention and for the MLP sublayer:

    X_{i+1} = X_i + F_i(LN_i(X_i))

This is OLMo's own ``OLMoSequentialBlock`` (with ``norm_after: false``), built by OLMo's own factory: nothing is
re-implemented, so ``pre`` is bit-identical to stock OLMo.
"""

from olmo.model import OLMoSequentialBlock as PreNormBlock

from .spec import Variant

__all__ = ["PreNormBlock", "VARIANT"]

VARIANT = Variant(name="pre", display_name="Pre-Norm", colour="tab:blue", block=None, order=0, table_row=0)
