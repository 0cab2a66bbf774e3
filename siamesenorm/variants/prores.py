"""ProRes, Progressive Residual Warmup (Chen et al., arXiv 2603.05369; the authors' code, dandingsky/ProRes, read
for its facts: ``torchrun_main.py`` lines 362-415 for the schedule, ``modeling_llama.py`` lines 419-436 for where
the scale acts), over Pre-Norm, the paper's default (``pre_prores``):

    X'      = X_l + a_l(t) * Attn( LN_attn(X_l) )
    X_{l+1} = X'  + a_l(t) * MLP(  LN_ff(X')    )
    a_l(t)  = min(1, t / T_l),   T_l = (l + 1) * T          l = 0 .. L-1; t = optimizer steps taken before this step

``T`` is ``prores_layer_steps`` (the paper's T; its scripts use T = 1000 with "--prores_warmup_steps" = T x L):
layer 0 reaches its full residual after T steps, the last layer after L x T, and from then on ``prores`` is
Pre-Norm exactly. At t = 0 every block is the identity (a = 0): the first step trains the embedding and the head
only, as in the authors' code. Only the code's default schedule ("linear") is built.

Diagram (one sublayer)::

    X ──┬─────────────────────────(+)── X'
        └─ LN ── F ── x a_l(t) ────┘

The scale depends on the training step, which no forward sees: each block keeps its a_l in a buffer
(``prores_scale``, saved with the weights, so an export or an evaluation of a checkpoint uses the scale it was
trained to), and each framework's adapter sets it before every step with ``set_training_step`` (ai2-olmo:
SiameseTrainer.train_step; OLMo-core: RunCallback.pre_step).
"""

from __future__ import annotations

import torch

from ._base import TopologyBlock
from .spec import Knob, Variant

__all__ = ["ProResBlock", "prores_scale", "set_training_step", "VARIANT"]


def prores_scale(layer_id: int, step: int, layer_steps: int) -> float:
    """a_l(t) = min(1, t / ((l + 1) T)) for the 0-based ``layer_id``, ``step`` = t optimizer steps taken."""
    return min(1.0, max(0, step) / float((layer_id + 1) * layer_steps))


def set_training_step(model: torch.nn.Module, step: int) -> int:
    """Set every ProRes block's scale for the step that follows ``step`` optimizer steps; returns how many blocks
    have one (0 for every other MODEL_TYPE: the call is a no-op there)."""
    n = 0
    for module in model.modules():
        if hasattr(module, "prores_scale") and hasattr(module, "prores_layer_steps"):
            module.prores_scale.fill_(prores_scale(module.prores_layer_id, step, module.prores_layer_steps))
            n += 1
    return n


class ProResBlock(TopologyBlock):
    def __init__(self, layer_id, config, cache):
        super().__init__(layer_id, config, cache)
        self.prores_layer_id = layer_id
        self.prores_layer_steps = int(getattr(config, "prores_layer_steps", 1000))
        self.register_buffer("prores_scale", torch.zeros((), device=config.init_device
                                                         if config.init_device not in (None, "meta") else None))

    def reset_parameters(self):
        super().reset_parameters()
        self.prores_scale.fill_(0.0)  # step 0

    def update(self, x, attention):
        scale = self.prores_scale.to(x.dtype)
        x = x + scale * attention(self.norm(self.attn_norm, x))
        return x + scale * self.mlp(self.norm(self.ff_norm, x))


VARIANT = Variant(
    name="prores", display_name="ProRes", colour="slateblue", block=ProResBlock, order=22, table_row=22,
    knobs=(Knob("prores_layer_steps", 1000, minimum=1, usual="the paper's scripts use 1000",
                doc="prores: T, the steps layer 0 takes to reach its full residual (layer l takes (l + 1) T)."),),
)
