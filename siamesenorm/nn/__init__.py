"""The residual topologies in plain PyTorch: no ai2-olmo import anywhere under siamesenorm.nn.

Each topology wraps one sublayer (attention or MLP: any ``callable(tensor) -> tensor`` of the host model) and does
the stream bookkeeping around it explicitly::

    state = SiameseNorm.expand(x)                       # the embedding -> the topology's state (here: X, Y)
    for l, block in enumerate(blocks):
        state = attn_wrappers[l](state)                 # each wrapper: SiameseNorm(dim, block.attn, layer=l, ...)
        state = mlp_wrappers[l](state)
    h = fusion(state)                                   # SiameseFusion: LN_a(X) + LN_b(Y); the host's final norm follows

``norm`` is the class to build norms with (``nn.LayerNorm``, ``nn.RMSNorm``, or any ``norm(dim)`` factory).
The equations are in each class's docstring; docs/fidelity.md says which source each default follows.
"""

from .topologies import *  # noqa: F401,F403
from .topologies import __all__  # noqa: F401
