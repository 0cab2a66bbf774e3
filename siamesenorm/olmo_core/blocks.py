"""Every MODEL_TYPE as an OLMo-core 3 transformer block: OLMo-core's own attention, feed-forward and norms, and the
update rules of ``siamesenorm.nn`` (the functions the ai2-olmo adapters in siamesenorm/variants/ call, so each rule
has one definition for both frameworks). The equations of each variant are in the docstring of its file in
siamesenorm/variants/; the classes here only say which OLMo-core module plays which part.

Each topology is written once, as a mixin over OLMo-core's block, and hosted twice (``hosted``): over its dense
``TransformerBlock`` (``CORE_BLOCKS``) and over its ``MoETransformerBlock`` (``CORE_MOE_BLOCKS``), where the
feed-forward F of the update rules is OLMo-core's MoE: its router, experts, shared expert and auxiliary losses,
unchanged; only the residual / normalisation topology around it is ours.

The state between blocks is the one tensor OLMo-core's model loop passes on (``StackedStreams``): n streams
concatenated on the feature axis, widened from the embedding by block 0 and fused by the last block before
OLMo-core's LM head (its final norm and output layer). Differences from the ai2-olmo blocks (docs/architecture.md):

- names: OLMo-core's ``attention_norm`` / ``feed_forward_norm`` play OLMo's ``attn_norm`` / ``ff_norm``; the
  variant's own parameters keep the ai2-olmo names (``attn_norm_x``, ``gamma``, ``attn_hc.static_alpha``, ...);
  the attention and MLP weights are OLMo-core's (``w_q``/``w_k``/``w_v``/``w_out``, ``w1``/``w2``/``w3``).
  ``siamesenorm.olmo_core.config`` maps state dicts both ways.
- the cheap parts (norms, stream fusion and mixing) run directly: OLMo-core's own activation checkpointing modes
  decide what is recomputed, not ``model.recompute_cheap``.
- the hybrid family's per-head Q/K/V norms: OLMo-core's per-head Q and K norms (``use_head_qk_norm``) and a V norm
  this module adds (``VHeadNormAttention``), all before RoPE as in HybridNorm.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace
from types import SimpleNamespace
from typing import Callable, Dict, Optional, Tuple, Type

import torch
import torch.nn as nn

from siamesenorm.olmo_core import require_olmo_core

require_olmo_core()

from olmo_core.nn.attention import Attention  # noqa: E402
from olmo_core.nn.layer_norm import LayerNormConfig, LayerNormType  # noqa: E402
from olmo_core.nn.transformer.block import MoETransformerBlock, TransformerBlock, TransformerBlockBase  # noqa: E402

from siamesenorm.models.core_state import QKV_HEAD_NORM_TYPES  # noqa: F401 (re-exported)
from siamesenorm.nn.topologies import (
    AttnResStreams,
    HyperConnection,
    ManifoldHyperConnection,
    StackedStreams,
    StreamMixing,
    hybrid_norm_update,
    post_norm_update,
    siamese_hybrid_attention,
    siamese_update,
)
from siamesenorm.variants._base import depth_scale, mixed_sublayers
from siamesenorm.variants.attnres import attnres_block_sublayers
from siamesenorm.variants.deepnorm import deepnorm_alpha, deepnorm_beta
from siamesenorm.variants.keel import keel_alpha
from siamesenorm.variants.lns import layernorm_scale
from siamesenorm.variants.mixln import mixln_post_layers
from siamesenorm.variants.spec import knob

__all__ = ["CoreTopologyBlock", "VHeadNormAttention", "TOPOLOGIES", "CORE_BLOCKS", "CORE_MOE_BLOCKS", "hosted",
           "core_block_class"]

Branch = Callable[[torch.Tensor], torch.Tensor]


class CoreTopologyBlock(StackedStreams):
    """The forward of a topology over an OLMo-core block, dense or MoE: a mixin whose host is OLMo-core's
    ``TransformerBlock`` (attention, feed-forward, two norms) or ``MoETransformerBlock`` (the same with
    ``feed_forward_moe``: OLMo-core's router, experts and auxiliary losses, unchanged). ``hosted`` makes the
    concrete classes, ``CORE_BLOCKS`` / ``CORE_MOE_BLOCKS`` list them.

    ``knobs``: the variant knobs (a dict; a missing knob has its default). A topology writes ``forward(x, *,
    loss_div_factor=None, **kwargs)`` over ``attn, mlp = self.sublayers(kwargs, loss_div_factor)``, the core's two
    branches, and lists the OLMo-core norms it does not use."""

    STREAMS: Tuple[str, ...] = ("residual",)

    def __init__(self, *, knobs: Optional[dict] = None, **kwargs):
        super().__init__(**kwargs)
        self.knobs = SimpleNamespace(**(knobs or {}))
        self._layer_norm: LayerNormConfig = kwargs["layer_norm"]
        self._init_device = kwargs.get("init_device", "cpu")
        self.branch_dropout = nn.Dropout(kwargs.get("dropout") or 0.0)
        self.stream_names = self.streams_for(self.knobs)
        self.n_streams = len(self.stream_names)
        self.is_first = self.block_idx == 0
        self.is_last = self.block_idx == self.n_layers - 1
        self._captured = None
        for name in self.unused_norms(self.knobs, self.block_idx):
            delattr(self, name)

    @classmethod
    def streams_for(cls, knobs) -> Tuple[str, ...]:
        return cls.STREAMS

    @classmethod
    def unused_norms(cls, knobs, block_idx: int) -> Tuple[str, ...]:
        """OLMo-core norms (``attention_norm``, ``feed_forward_norm``) this topology does not use in this block."""
        return ()

    def knob(self, name: str):
        return knob(self.knobs, name)

    def new_norm(self, size: Optional[int] = None, elementwise_affine: Optional[bool] = None) -> nn.Module:
        """A norm like the block's others (the config's ``layer_norm``), of ``size`` (default d_model)."""
        config = self._layer_norm if elementwise_affine is None else replace(self._layer_norm,
                                                                            elementwise_affine=elementwise_affine)
        return config.build(size or self.d_model, init_device=self._init_device)

    # ---- the host's sublayers as the core's branches -----------------------------------------------------------
    def sublayers(self, kwargs: dict, loss_div_factor=None, attn_out_norm: Optional[nn.Module] = None,
                  ff_out_norm: Optional[nn.Module] = None) -> Tuple[Branch, Branch]:
        """(attn, mlp): branch(h) = dropout(Attn(h)) with OLMo-core's attention and this forward's keyword
        arguments (RoPE buffers, document lengths), and dropout(F(h)) with the block's feed-forward, dense or MoE
        (then with the trainer's ``loss_div_factor`` for its auxiliary losses); an ``*_out_norm`` normalises that
        sublayer's output first."""
        feed_forward = (functools.partial(self.feed_forward_moe, loss_div_factor=loss_div_factor)
                        if self.is_moe else self.feed_forward)
        return (functools.partial(self._branch, functools.partial(self.attention, **kwargs), attn_out_norm),
                functools.partial(self._branch, feed_forward, ff_out_norm))

    def _branch(self, sublayer: Branch, out_norm: Optional[nn.Module], h: torch.Tensor) -> torch.Tensor:
        out = sublayer(h)
        return self.branch_dropout(out_norm(out) if out_norm is not None else out)

    def feed_forward_matrices(self) -> Tuple[Tuple[torch.Tensor, ...], Tuple[torch.Tensor, ...]]:
        """(input matrices, output matrices) of the feed-forward: w1, w3 and w2 of the dense SwiGLU, or of every
        expert and the shared expert of an MoE (DeepNorm's and hc's init scaling act on them)."""
        if not self.is_moe:
            return (self.feed_forward.w1.weight, self.feed_forward.w3.weight), (self.feed_forward.w2.weight,)
        experts, shared = self.feed_forward_moe.experts.mlp, self.feed_forward_moe.shared_mlp
        inputs, outputs = [experts.w1, experts.w3], [experts.w2]
        if shared is not None:
            inputs += [shared.w1.weight, shared.w3.weight]
            outputs.append(shared.w2.weight)
        return tuple(inputs), tuple(outputs)

    def norm(self, module: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return module(x)

    def pre_norm_forward(self, x: torch.Tensor, kwargs: dict, loss_div_factor=None) -> torch.Tensor:
        """OLMo-core's own block: x + Attn(LN(x)), then x + MLP(LN(x))."""
        attn, mlp = self.sublayers(kwargs, loss_div_factor)
        x = x + attn(self.attention_norm(x))
        return x + mlp(self.feed_forward_norm(x))


class VHeadNormAttention(Attention):
    """OLMo-core's attention with a per-head norm on V as well (``v_norm``), for HybridNorm's Q/K/V norms: Q and K
    use OLMo-core's per-head norms (``use_head_qk_norm``), all three before RoPE (which leaves V alone)."""

    v_norm: nn.Module

    def _prepare_qkv(self, x: torch.Tensor, **kwargs):
        q, k, v = super()._prepare_qkv(x, **kwargs)
        return q, k, self.v_norm(v)


def _add_v_head_norm(block: CoreTopologyBlock) -> None:
    if type(block.attention) is not Attention or not block.attention.use_head_qk_norm or block.attention.q_norm is None:
        raise ValueError("the HybridNorm family needs OLMo-core's default attention with per-head Q/K norms "
                         "(sequence_mixer: qk_norm set, use_head_qk_norm: true); siamesenorm.olmo_core."
                         "transformer_config sets both")
    block.attention.__class__ = VHeadNormAttention  # adds only _prepare_qkv's V norm; same module otherwise
    affine = block.attention.q_norm.weight is not None
    block.attention.v_norm = block.new_norm(block.attention.head_dim, elementwise_affine=affine)


# ---- one topology per MODEL_TYPE (pre is OLMo-core's own block) ---------------------------------------------
class PostNorm(CoreTopologyBlock):
    residual_scale: float = 1.0
    position_knob: Optional[str] = "post_norm_position"

    def forward(self, x, *, loss_div_factor=None, **kwargs):
        attn, mlp = self.sublayers(kwargs, loss_div_factor)
        position = self.knob(self.position_knob) if self.position_knob is not None else "after_addition"
        x = post_norm_update(x, attn, self.attention_norm, position, self.residual_scale)
        return post_norm_update(x, mlp, self.feed_forward_norm, position, self.residual_scale)


class DeepNorm(PostNorm):
    position_knob = None

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.residual_scale = deepnorm_alpha(self.n_layers)
        self.init_scale = deepnorm_beta(self.n_layers)

    def scale_init(self) -> None:
        """DeepNorm's beta on the V, output and MLP weights, after OLMo-core's init (``init_variant_weights``)."""
        with torch.no_grad():
            inputs, outputs = self.feed_forward_matrices()
            for weight in (self.attention.w_v.weight, self.attention.w_out.weight, *inputs, *outputs):
                weight.mul_(self.init_scale)


class Keel(PostNorm):
    """Keel (siamesenorm/variants/keel.py): LN_out(alpha x + F(LN_in(x))); LN_out are OLMo-core's two norms."""

    position_knob = None

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.residual_scale = keel_alpha(self.n_layers, self.knob("keel_alpha"))
        self.attn_in_norm = self.new_norm()
        self.ff_in_norm = self.new_norm()

    def forward(self, x, *, loss_div_factor=None, **kwargs):
        attn, mlp = self.sublayers(kwargs, loss_div_factor)
        x = post_norm_update(x, lambda h: attn(self.attn_in_norm(h)), self.attention_norm, "after_addition",
                             self.residual_scale)
        return post_norm_update(x, lambda h: mlp(self.ff_in_norm(h)), self.feed_forward_norm, "after_addition",
                                self.residual_scale)


class LayerNormScaled(CoreTopologyBlock):
    """LayerNorm Scaling (siamesenorm/variants/lns.py): x + F(LN(x) / sqrt(l)), l the 1-based layer; OLMo-core's
    own ``LayerNormScaledTransformerBlock`` computes the same (tested), over the dense block only."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.norm_scale = layernorm_scale(self.block_idx)

    def forward(self, x, *, loss_div_factor=None, **kwargs):
        attn, mlp = self.sublayers(kwargs, loss_div_factor)
        x = x + attn(self.attention_norm(x) * self.norm_scale)
        return x + mlp(self.feed_forward_norm(x) * self.norm_scale)


class ProRes(CoreTopologyBlock):
    """ProRes (siamesenorm/variants/prores.py): x + a_l(t) F(LN(x)); a_l(t) in the buffer ``prores_scale``, set
    before every step by the run layer's callback (``set_training_step``)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.prores_layer_id = self.block_idx
        self.prores_layer_steps = int(self.knob("prores_layer_steps"))
        self.register_buffer("prores_scale", torch.zeros((), device=self._init_device))

    def scale_init(self) -> None:
        """Step 0 (after OLMo-core's init, which leaves a buffer built on the meta device unset)."""
        self.prores_scale.fill_(0.0)

    def forward(self, x, *, loss_div_factor=None, **kwargs):
        attn, mlp = self.sublayers(kwargs, loss_div_factor)
        scale = self.prores_scale.to(x.dtype)
        x = x + scale * attn(self.attention_norm(x))
        return x + scale * mlp(self.feed_forward_norm(x))


class AttnRes(AttnResStreams, CoreTopologyBlock):
    """Attention Residuals (siamesenorm/variants/attnres.py): each sublayer reads a softmax mixture over depth
    through its Pre-Norm (OLMo-core's two norms); the pseudo-queries start at zero (``scale_init``)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.block_sublayers = attnres_block_sublayers(SimpleNamespace(**vars(self.knobs), n_layers=self.n_layers))
        self.first_sublayer = 2 * self.block_idx
        self.build_attn_res(self.d_model, self.new_norm, self._init_device)

    def scale_init(self) -> None:
        self.zero_queries()

    def forward(self, x, *, loss_div_factor=None, **kwargs):
        return self.attn_res_forward(x, self.sublayers(kwargs, loss_div_factor),
                                     (self.attention_norm, self.feed_forward_norm))

    def skip(self, x):
        return self.attn_res_forward(x, (torch.zeros_like, torch.zeros_like),
                                     (self.attention_norm, self.feed_forward_norm))


class MixLN(PostNorm):
    position_knob = None

    def forward(self, x, *, loss_div_factor=None, **kwargs):
        if self.block_idx < mixln_post_layers(SimpleNamespace(**vars(self.knobs), n_layers=self.n_layers)):
            return super().forward(x, loss_div_factor=loss_div_factor, **kwargs)
        return self.pre_norm_forward(x, kwargs, loss_div_factor)


class HybridNorm(CoreTopologyBlock):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        _add_v_head_norm(self)

    @classmethod
    def unused_norms(cls, knobs, block_idx):
        return ("attention_norm",)  # the Q/K/V norms replace the attention's input norm

    def forward(self, x, *, loss_div_factor=None, **kwargs):
        attn, mlp = self.sublayers(kwargs, loss_div_factor)
        x = hybrid_norm_update(x, attn)
        return hybrid_norm_update(x, mlp, self.feed_forward_norm)


class HybridStar(HybridNorm):
    @classmethod
    def unused_norms(cls, knobs, block_idx):
        return () if block_idx == 0 else ("attention_norm",)

    def forward(self, x, *, loss_div_factor=None, **kwargs):
        if not self.is_first:
            return super().forward(x, loss_div_factor=loss_div_factor, **kwargs)
        return self.pre_norm_forward(x, kwargs, loss_div_factor)


class PeriNorm(CoreTopologyBlock):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.attn_out_norm = self.new_norm()
        self.ff_out_norm = self.new_norm()
        if self.is_first:
            self.emb_norm = self.new_norm()

    def forward(self, x, *, loss_div_factor=None, **kwargs):
        attn, mlp = self.sublayers(kwargs, loss_div_factor, self.attn_out_norm, self.ff_out_norm)
        if self.is_first:
            x = self.emb_norm(x)
        x = x + attn(self.attention_norm(x))
        return x + mlp(self.feed_forward_norm(x))

    def skip(self, x):
        return self.emb_norm(x) if self.is_first else x


class PreEmbedNorm(CoreTopologyBlock):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        if self.is_first:  # RMSNorm without a scale, whatever the config's norm type (as the ai2-olmo block)
            self.emb_norm = LayerNormConfig(name=LayerNormType.rms, eps=self._layer_norm.eps, elementwise_affine=False,
                                            bias=False).build(self.d_model, init_device=self._init_device)

    def forward(self, x, *, loss_div_factor=None, **kwargs):
        if self.is_first:
            x = self.emb_norm(x)
        return self.pre_norm_forward(x, kwargs, loss_div_factor)

    def skip(self, x):
        return self.emb_norm(x) if self.is_first else x


class ResiDual(CoreTopologyBlock):
    STREAMS = ("post_ln", "accumulator")

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        if self.is_last:
            self.out_norm_dual = self.new_norm()

    def forward(self, x, *, loss_div_factor=None, **kwargs):
        attn, mlp = self.sublayers(kwargs, loss_div_factor)
        xs, ds = self.split_streams(x)
        for branch, norm in ((attn, self.attention_norm), (mlp, self.feed_forward_norm)):
            o = branch(xs)
            xs = norm(xs + o)  # X: Post-LN
            ds = ds + o  # D collects the raw sublayer output
        return self.finish([xs, ds])

    def contributions(self, streams):  # X + LN^D(D)
        xs, ds = streams
        return [xs, self.out_norm_dual(ds)]


class TwoStream(CoreTopologyBlock):
    """Both SiameseNorm blocks: c(l) and the final fusion LN^out_X(X) + LN^out_Y(Y) in the last block."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.depth_scale = depth_scale(self.knobs, self.block_idx)
        if self.is_last:
            self.out_norm_x = self.new_norm()
            self.out_norm_y = self.new_norm()
        self.mixing = self.knob("siamese_mixing")
        self.mixed = mixed_sublayers(self.knobs, self.block_idx)
        for prefix in self.mixed:
            setattr(self, prefix + "_mix", StreamMixing(self.d_model, self.mixing, self.knob("siamese_mixing_init"),
                                                        norm=lambda size: self.new_norm(size),
                                                        device=self._init_device))

    def scale_init(self) -> None:
        """The stream mixings' init (after OLMo-core's, which leaves parameters built on the meta device unset)."""
        for prefix in self.mixed:
            getattr(self, prefix + "_mix").reset_parameters()

    def mix(self, prefix: str, xs, ys, x_norm: Optional[str] = None):
        """As the ai2-olmo block's ``mix`` (siamesenorm/variants/_base.py TwoStreamBlock)."""
        if prefix not in self.mixed:
            return xs, ys
        xs, ys = getattr(self, prefix + "_mix")(xs, ys)
        return (getattr(self, x_norm)(xs) if x_norm else xs), ys

    def contributions(self, streams):
        x_stream, y_stream = streams
        return [self.out_norm_x(x_stream), self.out_norm_y(y_stream)]


class SiamesePostPre(TwoStream):
    STREAMS = ("x_post", "y_pre")

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.attn_norm_x, self.attn_norm_y = self.new_norm(), self.new_norm()
        self.ff_norm_x, self.ff_norm_y = self.new_norm(), self.new_norm()
        if self.knob("post_pre_x_norm_position") != "before_sublayer":
            for prefix in self.mixed:
                setattr(self, prefix + "_mix_norm_x", self.new_norm())

    @classmethod
    def unused_norms(cls, knobs, block_idx):
        # attention_norm / feed_forward_norm are LN^in, the normalized-input norms
        return () if knob(knobs, "siamese_normalized_input") else ("attention_norm", "feed_forward_norm")

    def forward(self, x, *, loss_div_factor=None, **kwargs):
        attn, mlp = self.sublayers(kwargs, loss_div_factor)
        xs, ys = self.split_streams(x)
        normalized = self.knob("siamese_normalized_input")
        position = self.knob("post_pre_x_norm_position")
        for branch, prefix, in_norm in ((attn, "attn", "attention_norm"),
                                        (mlp, "ff", "feed_forward_norm")):
            xs, ys = self.mix(prefix, xs, ys, x_norm=None if position == "before_sublayer" else prefix + "_mix_norm_x")
            xs, ys = siamese_update(
                xs, ys, branch, x_norm=getattr(self, f"{prefix}_norm_x"), y_norm=getattr(self, f"{prefix}_norm_y"),
                in_norm=getattr(self, in_norm) if normalized else None, c=self.depth_scale, x_norm_position=position)
        return self.finish([xs, ys])


class SiameseHybridPre(TwoStream):
    STREAMS = ("x_hybrid", "y_pre")

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        _add_v_head_norm(self)
        self.gamma = nn.Parameter(torch.ones(self.d_model, device=self._init_device, dtype=torch.float32))
        self.attn_norm_y = self.new_norm()
        self.attn_norm_x = self.new_norm()
        self.ff_norm_y = self.new_norm()
        if "attn" in self.mixed:
            self.attn_mix_norm_x = self.new_norm()

    @classmethod
    def unused_norms(cls, knobs, block_idx):
        normalized = knob(knobs, "siamese_normalized_input")
        return ("attention_norm",) if normalized else ("attention_norm", "feed_forward_norm")

    def reset_parameters(self):
        nn.init.ones_(self.gamma)

    def forward(self, x, *, loss_div_factor=None, **kwargs):
        attn, mlp = self.sublayers(kwargs, loss_div_factor)
        xs, ys = self.split_streams(x)
        xs, ys = self.mix("attn", xs, ys, x_norm="attn_mix_norm_x")
        xs, ys = siamese_hybrid_attention(xs, ys, attn, gamma=self.gamma, y_norm=self.attn_norm_y,
                                          x_norm=None, c=self.depth_scale)
        in_norm = self.feed_forward_norm if self.knob("siamese_normalized_input") else None
        xs, ys = self.mix("ff", xs, ys)
        xs, ys = siamese_update(xs, ys, mlp, y_norm=self.ff_norm_y, x_norm=self.attn_norm_x, in_norm=in_norm,
                                c=self.depth_scale, x_norm_position="before_sublayer")
        return self.finish([xs, ys])


class ConnectedStreams(CoreTopologyBlock):
    """hc and mhc: a connection of siamesenorm.nn around each sublayer, whose branch keeps its Pre-Norm."""

    EXPANSION_KNOB = ""
    connection_names: Tuple[str, str] = ("attn_conn", "ff_conn")

    @classmethod
    def streams_for(cls, knobs):
        return tuple(f"stream_{i + 1}" for i in range(knob(knobs, cls.EXPANSION_KNOB)))

    def forward(self, x, *, loss_div_factor=None, **kwargs):
        attn, mlp = self.sublayers(kwargs, loss_div_factor)
        h = self.stacked(x)
        attn_conn, ff_conn = (getattr(self, name) for name in self.connection_names)
        for conn, branch, pre_norm in ((attn_conn, attn, self.attention_norm),
                                       (ff_conn, mlp, self.feed_forward_norm)):
            inp, carried, weights = conn.width(h)
            h = conn.depth(h, carried, weights, branch(pre_norm(inp)))
        return self.finish_stacked(h)


class HyperConnections(ConnectedStreams):
    EXPANSION_KNOB = "hc_expansion_rate"
    connection_names = ("attn_hc", "ff_hc")

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        args = dict(n=self.n_streams, dim=self.d_model, layer=self.block_idx, norm=lambda size: self.new_norm(size),
                    decay_dynamic=self.knob("hc_decay_dynamic"), device=self._init_device)
        self.attn_hc = HyperConnection(**args)
        self.ff_hc = HyperConnection(**args)

    def scale_init(self) -> None:
        """The output weights start divided by sqrt(n) (``hc_scale_output_init``), after OLMo-core's init."""
        if self.knob("hc_scale_output_init"):
            with torch.no_grad():
                for weight in (self.attention.w_out.weight, *self.feed_forward_matrices()[1]):
                    weight.div_(math.sqrt(self.n_streams))


class ManifoldHyperConnections(ConnectedStreams):
    EXPANSION_KNOB = "mhc_expansion_rate"
    connection_names = ("attn_mhc", "ff_mhc")

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        args = dict(n=self.n_streams, dim=self.d_model, norm=lambda size: self.new_norm(size),
                    iterations=self.knob("mhc_sinkhorn_iterations"), order=self.knob("mhc_sinkhorn_order"),
                    device=self._init_device)
        self.attn_mhc = ManifoldHyperConnection(**args)
        self.ff_mhc = ManifoldHyperConnection(**args)

    def contributions(self, streams):  # the mean of the streams
        return [s / self.n_streams for s in streams]


#: MODEL_TYPE -> the topology (``pre``: none, OLMo-core's own forward).
TOPOLOGIES: Dict[str, Optional[Type[CoreTopologyBlock]]] = {
    "pre": None, "post": PostNorm, "hybrid": HybridNorm, "hc": HyperConnections, "post_pre": SiamesePostPre,
    "hybrid_pre": SiameseHybridPre, "deepnorm": DeepNorm, "residual": ResiDual, "mixln": MixLN, "peri": PeriNorm,
    "mhc": ManifoldHyperConnections, "hybrid_star": HybridStar, "pre_embednorm": PreEmbedNorm,
    "lns": LayerNormScaled, "keel": Keel, "prores": ProRes, "attnres": AttnRes,
}


def hosted(topology: Optional[Type[CoreTopologyBlock]], host: Type[TransformerBlockBase]) -> Type[TransformerBlockBase]:
    """The block class of ``topology`` over OLMo-core's ``host`` block, a module-level class named
    ``<Topology>Block`` (dense) or ``<Topology>MoEBlock``; no topology: the host itself."""
    if topology is None:
        return host
    name = topology.__name__ + ("MoEBlock" if host is MoETransformerBlock else "Block")
    cls = type(name, (topology, host), {"__module__": __name__, "__qualname__": name,
                                        "__doc__": f"{topology.__name__} over OLMo-core's {host.__name__}."})
    globals()[name] = cls  # importable by name (pickling, config round trips)
    return cls


#: MODEL_TYPE -> OLMo-core block class, over its dense block and over its MoE block.
CORE_BLOCKS: Dict[str, Type[TransformerBlockBase]] = {t: hosted(c, TransformerBlock) for t, c in TOPOLOGIES.items()}
CORE_MOE_BLOCKS: Dict[str, Type[TransformerBlockBase]] = {t: hosted(c, MoETransformerBlock)
                                                          for t, c in TOPOLOGIES.items()}



def core_block_class(model_type: str, moe: bool = False) -> Type[TransformerBlockBase]:
    try:
        return (CORE_MOE_BLOCKS if moe else CORE_BLOCKS)[model_type]
    except KeyError:
        raise ValueError(f"MODEL_TYPE {model_type!r} has no OLMo-core block yet; the OLMo-core path has "
                         f"{', '.join(CORE_BLOCKS)}") from None
