"""What every OLMo adapter shares: OLMo's sequential block cut into its two sublayers, and the stacked-stream state.

A variant's block subclasses ``TopologyBlock`` and writes ``update(x, attention)``: the update rules of
siamesenorm.nn applied to OLMo's sublayers (``attention``, the call's ``AttentionCall``, and ``self.mlp``) and norms
(``normed``). OLMo's call contract (six arguments in, ``(x, KV cache)`` out) is ``TopologyBlock.forward``, written
once. A block maps one tensor to one tensor, as OLMo's model loop expects. A topology with n streams carries them
concatenated on the feature axis, (B, T, n * d_model): block 0 widens the embedding into n streams and the last block fuses them back to
(B, T, d_model) (``siamesenorm.nn.StackedStreams``, shared with the OLMo-core blocks), so OLMo's own final norm
``ln_f`` is the topology's final norm and everything that happens between blocks (KV cache, activation
checkpointing, FSDP wrapping, block groups, ``last_logits_only``) sees one tensor and works unchanged.
"""

from __future__ import annotations

import functools
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn as nn
from olmo.config import ModelConfig
from olmo.model import BufferCache, LayerNormBase, OLMoSequentialBlock
from torch.utils.checkpoint import checkpoint

from ..nn.fused import block_input, pair_mix, qkv_rope, stream_add, stream_input
from ..nn.topologies import DEPTH_SCALING_FORMS, MIXING_FORMS, StackedStreams, StreamMixing, depth_divisor
from .spec import Knob, knob

__all__ = ["TopologyBlock", "AttentionCall", "ConnectedStreamsBlock", "TwoStreamBlock", "SIAMESE_KNOBS", "depth_scale",
           "mixed_sublayers",
           "RECOMPUTE_DEFAULT", "recompute_call", "set_recompute"]

KVCache = Optional[Tuple[torch.Tensor, torch.Tensor]]
Norm = Callable[[torch.Tensor], torch.Tensor]

#: ``model.recompute_cheap`` (a config field, per run): recompute the cheap parts of every block in backward
#: instead of saving their intermediates: every norm (which saves its input, the normalised tensor and the
#: statistics; recomputed, only the input is kept, and the residual stream holds it anyway), ``pre``'s two norms
#: included, and hc/mhc's width connections (the stream mixing). Exact: backward reruns the same ops, so losses and
#: gradients are bit-identical. It trades time (the norms run twice in eager) for activation memory
#: (docs/performance.md). ``set_recompute`` changes it on a built model.
RECOMPUTE_DEFAULT = True


def recompute_call(fn: Callable, *args: torch.Tensor):
    """``fn(*args)`` with its intermediates recomputed in backward instead of saved, where autograd records
    (``fn`` must be deterministic: no dropout)."""
    if torch.is_grad_enabled() and any(a.requires_grad for a in args):
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)
    return fn(*args)


def _recomputed_pre_norm(block: OLMoSequentialBlock, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # the class's forward called with the norm, not bound with ``__get__``: dynamo in torch 2.11 cannot trace
    # ``function.__get__`` (a compiled pre with fused off failed so on an H200), 2.13 can
    def forward(t: torch.Tensor) -> torch.Tensor:
        return type(norm).forward(norm, t)

    if block._activation_checkpoint_fn is not None:  # OLMo's own checkpointing already wraps the norm
        return forward(x)
    return recompute_call(forward, x)


def set_recompute(model: nn.Module, on: bool) -> None:
    """Turn ``recompute_cheap`` on or off in every block of a built model (``pre``: OLMo's own block, whose two norms
    get an instance-level forward that recomputes them; the state dict is unchanged)."""
    for block in model.modules():
        if isinstance(block, TopologyBlock):
            block.recompute_cheap = on
        elif isinstance(block, OLMoSequentialBlock):
            for name in ("attn_norm", "ff_norm"):
                norm = getattr(block, name)
                if on:
                    norm.forward = functools.partial(_recomputed_pre_norm, block, norm)
                else:
                    norm.__dict__.pop("forward", None)


def depth_scale(config: ModelConfig, layer_id: int) -> float:
    """c(l): the bounded stream receives O / c(l). 1.0 when depth-wise scaling is off."""
    if not knob(config, "siamese_depth_scaling"):
        return 1.0
    return depth_divisor(layer_id, knob(config, "siamese_depth_scaling_form"))


class _Absent:
    """Stands in for a norm this topology removed while OLMo's reset_parameters, which resets both, runs."""

    def reset_parameters(self):
        pass


class AttentionCall:
    """The attention sublayer of one block call: ``attention(h)`` is dropout(Attn(h)) with OLMo's projections,
    attention and the call's arguments (bias, past keys and values, cache flag, document lengths), no input norm;
    ``out_norm`` (if given) normalises its output first. The KV cache it returns is kept on ``cache``, which the
    block returns. ``olmo_forward(x)`` is OLMo's own sequential block (Pre-Norm) with the same arguments."""

    def __init__(self, block: "TopologyBlock", attention_bias, layer_past, use_cache, max_doc_len, cu_doc_lens):
        self.block = block
        self.arguments = (attention_bias, layer_past, use_cache, max_doc_len, cu_doc_lens)
        self.cache: KVCache = None

    def __call__(self, h: torch.Tensor, out_norm: Optional[LayerNormBase] = None) -> torch.Tensor:
        out, self.cache = self.block.attention_branch(h, *self.arguments, out_norm)
        return out

    def olmo_forward(self, x: torch.Tensor) -> torch.Tensor:
        attention_bias, layer_past, use_cache, max_doc_len, cu_doc_lens = self.arguments
        x, self.cache = OLMoSequentialBlock.forward(self.block, x, attention_bias, layer_past, use_cache,
                                                    max_doc_len=max_doc_len, cu_doc_lens=cu_doc_lens)
        return x


class TopologyBlock(StackedStreams, OLMoSequentialBlock):
    """OLMo's sequential block with its forward replaced by a topology; its weights and attention are reused.

    Subclasses write ``update(x, attention)``, name their streams (``STREAMS``, or ``streams_for`` when the count
    is a knob) and list the OLMo norms they do not use (``unused_norms``: removed, so DDP sees no unused parameter)."""

    #: What each stream of the stacked state is, in order (the analysis tools label streams with these).
    STREAMS: Tuple[str, ...] = ("residual",)

    def __init__(self, layer_id: int, config: ModelConfig, cache: BufferCache):
        super().__init__(layer_id, config, cache)
        self.stream_names: Tuple[str, ...] = self.streams_for(config)
        self.n_streams = len(self.stream_names)
        for name in self.unused_norms(config, layer_id):
            delattr(self, name)  # no parameter DDP would see unused, no entry in the state dict
        self.is_first = layer_id == 0
        self.is_last = layer_id == config.n_layers - 1
        self.recompute_cheap = bool(getattr(config, "recompute_cheap", RECOMPUTE_DEFAULT))
        # model.fused_streams (RMS norms without bias, checked in validate_model_config): the ops of
        # siamesenorm/nn/fused.py where a topology has them (the two-stream updates, the per-head Q/K/V norms)
        self.fused_streams = bool(getattr(config, "fused_streams", False))
        self._captured: Optional[list] = None

    @classmethod
    def streams_for(cls, config: ModelConfig) -> Tuple[str, ...]:
        return cls.STREAMS

    @classmethod
    def unused_norms(cls, config: ModelConfig, layer_id: int) -> Tuple[str, ...]:
        """OLMo block norms (``attn_norm``, ``ff_norm``) this topology does not use in this layer."""
        return ()

    # ---- parameters -------------------------------------------------------------------------------------
    def new_norm(self, size: Optional[int] = None, elementwise_affine: Optional[bool] = None) -> LayerNormBase:
        return LayerNormBase.build(self.config, size=size, elementwise_affine=elementwise_affine)

    def reset_parameters(self):
        absent = [name for name in ("attn_norm", "ff_norm") if not hasattr(self, name)]
        try:
            for name in absent:
                object.__setattr__(self, name, _Absent())
            super().reset_parameters()  # OLMo's init of the projections (and of the norms it has)
        finally:
            for name in absent:
                object.__delattr__(self, name)
        for module in self.children():
            if isinstance(module, LayerNormBase):
                module.reset_parameters()

    # ---- the call contract, written once ------------------------------------------------------------------
    def forward(self, x, attention_bias=None, layer_past=None, use_cache=False, max_doc_len=None, cu_doc_lens=None):
        """OLMo's block call (its six arguments, ``(x, KV cache)`` back), for every adapter: the call's arguments
        go to the attention sublayer once (``AttentionCall``), the topology's ``update`` computes the new state,
        and the KV cache of the call comes back beside it."""
        attention = AttentionCall(self, attention_bias, layer_past, use_cache, max_doc_len, cu_doc_lens)
        return self.update(x, attention), attention.cache

    def update(self, x: torch.Tensor, attention: "AttentionCall") -> torch.Tensor:
        """The topology's equations: the new (stacked) state from ``x``, with ``attention(h)`` and
        ``self.mlp(h)`` as the sublayers (no input norm in either) and ``self.norm(module, h)`` for norms."""
        raise NotImplementedError(f"{type(self).__name__} must define update(x, attention)")

    # ---- OLMo's sublayers and norms, as the core's branches and norms ----------------------------------------
    def mlp(self, h: torch.Tensor, out_norm: Optional[LayerNormBase] = None) -> torch.Tensor:
        """The MLP sublayer as a branch: dropout(MLP(h)), no input norm (``mlp_branch``)."""
        return self.mlp_branch(h, out_norm)

    def normed(self, module: Optional[nn.Module]) -> Optional[Norm]:
        """``module`` as the core's norm argument (``self.norm``: recomputed in backward); None stays None."""
        return None if module is None else (lambda t: self.norm(module, t))

    def weight(self, norm: nn.Module) -> Optional[torch.Tensor]:
        """A norm's scale as the fused ops (siamesenorm/nn/fused.py) take it; None: a norm without one."""
        return getattr(norm, "weight", None)

    def ckpt(self, fn: Callable, *args, **kwargs):
        """Run ``fn`` under OLMo's fine-grained activation checkpointing when it is on."""
        if self._activation_checkpoint_fn is not None:
            return self._activation_checkpoint_fn(fn, *args, **kwargs)
        return fn(*args, **kwargs)

    def attention_branch(self, h, attention_bias, layer_past, use_cache, max_doc_len, cu_doc_lens,
                         out_norm: Optional[LayerNormBase] = None) -> Tuple[torch.Tensor, KVCache]:
        """dropout(Attn(h)) and OLMo's KV cache; h: (B, T, d_model), no input norm applied here."""
        qkv = self.att_proj(h)
        if self.config.clip_qkv is not None:
            qkv = qkv.clamp(min=-self.config.clip_qkv, max=self.config.clip_qkv)
        q, k, v = self.qkv_heads(qkv, cached=layer_past is not None or use_cache)
        att, cache = self.ckpt(self.attention, q, k, v, attention_bias, layer_past=layer_past, use_cache=use_cache,
                               max_doc_len=max_doc_len, cu_doc_lens=cu_doc_lens)
        if out_norm is not None:
            att = self.norm(out_norm, att)
        return self.dropout(att), cache

    def qkv_heads(self, qkv: torch.Tensor, cached: bool = False) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v from the fused attention projection's output: views of it, or with ``rotates_in_op`` q and k
        rotated by one op that writes q, k and v as tensors of their own (siamesenorm/nn/fused.py ``qkv_rope``), so
        that attention keeps those and not qkv whole. ``cached``: a KV cache is read or written (generation)."""
        if self.rotates_in_op(cached):
            return qkv_rope(qkv, n_q=self.config.n_heads, n_kv=self.config.effective_n_kv_heads,
                            head_dim=self.config.d_model // self.config.n_heads, rope=self.rope_tables(qkv))
        return qkv.split(self.fused_dims, dim=-1)

    def rotates_in_op(self, cached: bool) -> bool:
        """Whether RoPE runs in ``qkv_heads``' op (with ``model.fused_streams``, RoPE on, no Q/K layer norm of OLMo's
        to come first, no KV cache: OLMo caches k before RoPE, so generation keeps OLMo's own); ``attention`` then
        leaves q and k as they come."""
        return self.fused_streams and self.config.rope and self.q_norm is None and not cached

    def rope_tables(self, qkv: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """OLMo's RoPE tables (sin, cos) for qkv's T positions 0..T-1, each (T, head_dim) fp32."""
        sin, cos = self.rotary_emb.get_rotary_embedding(qkv.shape[-2], qkv.device)
        return sin[0, 0], cos[0, 0]

    def attention(self, q, k, v, attention_bias=None, layer_past=None, use_cache=False, max_doc_len=None,
                  cu_doc_lens=None):
        if not self.rotates_in_op(layer_past is not None or use_cache):
            return super().attention(q, k, v, attention_bias, layer_past=layer_past, use_cache=use_cache,
                                     max_doc_len=max_doc_len, cu_doc_lens=cu_doc_lens)
        # OLMo's attention (ai2-olmo 0.6.0) for q and k that come rotated, without a KV cache: the heads to the
        # front, the bias cast, OLMo's scaled dot-product attention, the heads back, attn_out
        B, T, C = q.shape
        hs = C // self.config.n_heads
        q = q.view(B, T, self.config.n_heads, hs).transpose(1, 2)
        k = k.view(B, T, self.config.effective_n_kv_heads, hs).transpose(1, 2)
        v = v.view(B, T, self.config.effective_n_kv_heads, hs).transpose(1, 2)
        if attention_bias is not None:
            attention_bias = self._cast_attn_bias(attention_bias[:, :, :T, :T], k.dtype)
        att = self._scaled_dot_product_attention(
            q, k, v, attn_mask=attention_bias, dropout_p=0.0 if not self.training else self.config.attention_dropout,
            is_causal=attention_bias is None, max_doc_len=max_doc_len, cu_doc_lens=cu_doc_lens)
        return self.attn_out(att.transpose(1, 2).contiguous().view(B, T, C)), None

    def mlp_branch(self, h: torch.Tensor, out_norm: Optional[LayerNormBase] = None) -> torch.Tensor:
        """dropout(MLP(h)) with OLMo's ff_proj, activation and ff_out; ``out_norm`` (if given) before dropout."""
        h = self.ff_proj(h)
        h = self.ckpt(self.act, h)
        h = self.ff_out(h)
        if out_norm is not None:
            h = self.norm(out_norm, h)
        return self.dropout(h)

    def norm(self, module: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """``module(x)`` as a cheap part (``cheap``)."""
        return self.cheap(module, x)

    def cheap(self, fn: Callable, *args: torch.Tensor):
        """``fn(*args)`` for the cheap parts (norms, stream fusion and mixing): in training recomputed in backward
        (``recompute_cheap``), or under OLMo's fine-grained activation checkpointing when that is on. The core's
        ``run``."""
        if self._activation_checkpoint_fn is not None:
            return self._activation_checkpoint_fn(fn, *args)
        return recompute_call(fn, *args) if self.recompute_cheap else fn(*args)


class ConnectedStreamsBlock(TopologyBlock):
    """n streams with a learned connection around each sublayer (hc, mhc): a siamesenorm.nn connection whose
    ``width(H)`` gives (branch input, carried streams, per-stream output weights) for H (B, T, n, d), then its
    ``depth``. ``attn_norm`` / ``ff_norm`` keep their Pre-Norm role inside each branch. Subclasses set
    ``EXPANSION_KNOB`` and build the two connections, named in ``connection_names`` (attention first)."""

    EXPANSION_KNOB: str = ""
    connection_names: Tuple[str, str] = ("attn_conn", "ff_conn")

    @classmethod
    def streams_for(cls, config: ModelConfig) -> Tuple[str, ...]:
        return tuple(f"stream_{i + 1}" for i in range(knob(config, cls.EXPANSION_KNOB)))

    def reset_parameters(self):
        super().reset_parameters()
        for name in self.connection_names:
            getattr(self, name).reset_parameters()

    def update(self, x, attention):
        h = self.stacked(x)
        attn_conn, ff_conn = (getattr(self, name) for name in self.connection_names)
        for conn, branch, pre_norm in ((attn_conn, attention, self.attn_norm), (ff_conn, self.mlp, self.ff_norm)):
            if self.fused_streams and getattr(conn, "normalizes_input", False):
                # fused: the width connection with the branch's Pre-Norm is one op that keeps only h's copy (and the
                # coefficients' fp32 logits): nothing to recompute; the depth connection reads the copy
                inp, carried, weights, h = conn.width_normed(h, self.weight(pre_norm), self.config.layer_norm_eps)
            else:
                # the width connection and the branch's Pre-Norm as one cheap part: backward keeps only h
                inp, carried, weights = self.cheap(
                    functools.partial(_width_then_norm, conn, self.branch_norm(pre_norm)), h)
            h = conn.depth(h, carried, weights, branch(inp))
        return self.finish_stacked(h)  # the last block fuses the streams (contributions)

    def branch_norm(self, norm: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        """A branch's Pre-Norm: OLMo's norm, or with ``model.fused_streams`` the same RMSNorm as one op each way
        (siamesenorm/nn/fused.py ``stream_input`` with one stream, as fused ``pre`` runs its norms); compiled, OLMo's,
        which inductor fuses with the branch input's sum (the cost model: mhc 20.5 -> 20.2 GB a layer, hc 11.8 ->
        11.3)."""
        if not self.fused_streams or torch.compiler.is_compiling():
            return norm
        weight, eps = self.weight(norm), self.config.layer_norm_eps
        return lambda t: stream_input(None, t, y_weight=weight, eps=eps)[2]


def _width_then_norm(conn: nn.Module, norm: nn.Module, h: torch.Tensor):
    inp, carried, weights = conn.width(h)
    return norm(inp), carried, weights


#: The knobs both SiameseNorm variants (post_pre, hybrid_pre) read: the two mechanisms of section 4.2.
SIAMESE_KNOBS = (
    Knob("siamese_depth_scaling", True,
         doc="Divide the update written into the bounded stream by c(l) (section 4.2)."),
    Knob("siamese_depth_scaling_form", "inv_sqrt_2layer", legacy="inv_sqrt_layer", choices=tuple(DEPTH_SCALING_FORMS),
         doc="Which c(l), see siamesenorm.nn.DEPTH_SCALING_FORMS. Default: the official code's sqrt(2(l+1)); "
             '"inv_sqrt_layer" is the paper\'s text (section 4.2).'),
    Knob("siamese_normalized_input", True,
         doc="Apply an extra norm (LN^in) to the fused input of each sublayer (section 4.2)."),
    Knob("siamese_mixing", "none", choices=MIXING_FORMS,
         doc="Mix the two streams before each sublayer by a learned 2 x 2 doubly stochastic matrix, as mHC's H_res "
             '(siamesenorm.nn.StreamMixing): "static" (one per sublayer) or "dynamic" (per token); "none": the '
             "paper's SiameseNorm (appendix A.1: no stream mixing)."),
    Knob("siamese_mixing_init", 0.95, minimum=0.5, maximum=0.999,
         doc="With siamese_mixing: the share p each stream keeps of itself at step 0 (H = [[p, 1-p], [1-p, p]])."),
)


def mixed_sublayers(config, layer_id: int) -> Tuple[str, ...]:
    """The sublayers of a SiameseNorm block whose input streams are mixed (``siamese_mixing``): both, except block
    0's attention, whose two streams are the same embedding."""
    if knob(config, "siamese_mixing") == "none":
        return ()
    return ("ff",) if layer_id == 0 else ("attn", "ff")


class TwoStreamBlock(TopologyBlock):
    """Shared by both SiameseNorm blocks: two stacked streams (X, Y), depth scale c(l), and the final fusion
    LN^out_X(X) + LN^out_Y(Y) in the last block (``out_norm_x``, ``out_norm_y``; OLMo's ln_f follows)."""

    def __init__(self, layer_id, config, cache):
        super().__init__(layer_id, config, cache)
        self.depth_scale = depth_scale(config, layer_id)
        if self.is_last:
            self.out_norm_x = self.new_norm()
            self.out_norm_y = self.new_norm()
        self.mixing = knob(config, "siamese_mixing")
        for prefix in mixed_sublayers(config, layer_id):
            setattr(self, prefix + "_mix", StreamMixing(config.d_model, self.mixing, knob(config, "siamese_mixing_init"),
                                                        norm=lambda size: self.new_norm(size),
                                                        device=config.init_device))

    def reset_parameters(self):
        super().reset_parameters()
        for prefix in ("attn", "ff"):
            if hasattr(self, prefix + "_mix"):
                getattr(self, prefix + "_mix").reset_parameters()

    def mix(self, prefix: str, xs: torch.Tensor, ys: torch.Tensor, x_norm: Optional[str] = None):
        """The two streams mixed before sublayer ``prefix`` where it has a mixing (else unchanged); ``x_norm``: the
        norm that restores X's bound right after the mix, where no LN^X follows it (``<prefix>_mix_norm_x``)."""
        mixing = getattr(self, prefix + "_mix", None)
        if mixing is None:
            return xs, ys
        xs, ys = self.cheap(mixing, xs, ys)
        return (self.norm(getattr(self, x_norm), xs) if x_norm else xs), ys

    def fused_mix(self, prefix: str, xs: Optional[torch.Tensor], ys: torch.Tensor, o: Optional[torch.Tensor] = None):
        """Sublayer ``prefix``'s stream mixing through the fused op (``pair_mix``), the previous sublayer's add
        X + O / c, Y + O folded in; ``xs`` None: ``ys`` is the stacked state the block received (read in place)."""
        mixing = getattr(self, prefix + "_mix")
        dynamic = mixing.form == "dynamic"
        return pair_mix(xs, ys, o, scale=1.0 / self.depth_scale, bias=mixing.bias,
                        gate=mixing.gate if dynamic else None, proj=mixing.proj if dynamic else None,
                        norm_weight=self.weight(mixing.norm) if dynamic else None, eps=self.config.layer_norm_eps,
                        stacked=xs is None)

    def fused_input(self, state: torch.Tensor, **kw):
        """The block's first fused op, (XA, Y1, H): on the stacked state itself (``block_input``: its gradient written
        whole by the op); block 0's state is the embedding both streams start from, taken as both."""
        return stream_input(state, state, **kw) if self.is_first else block_input(state, **kw)

    def end(self, xs: torch.Tensor, ys: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The block's last update, X + O / c and Y + O, then ``finish``; fused: written straight into the stacked
        state, and in the last block the update and the final fusion LN^out_X(X + O / c) + LN^out_Y(Y + O) as one
        op (the stream op's H with LN^X and LN^Y, no LN^in: OLMo's ln_f follows), where eager ran two RMSNorms and
        the adds outside any fused op (about 170 (B, T, d) passes a step at the 1.3B recipe, 11.8 GB). The analysis
        tools' capture (``capturing_streams``) takes the unfused path, which hands them the streams."""
        if self.fused_streams and not self.is_last:
            return stream_add(xs, ys, out, scale=1.0 / self.depth_scale)
        if self.fused_streams and self._captured is None:
            return stream_input(xs, ys, out, scale=1.0 / self.depth_scale, x_norm=True,
                                x_weight=self.weight(self.out_norm_x), y_weight=self.weight(self.out_norm_y),
                                eps=self.config.layer_norm_eps)[2]
        return self.finish([xs + out / self.depth_scale, ys + out])

    def contributions(self, streams):
        x_stream, y_stream = streams
        return [self.norm(self.out_norm_x, x_stream), self.norm(self.out_norm_y, y_stream)]

    def fusion_weights(self) -> List[float]:
        return [mean_weight(self.out_norm_x), mean_weight(self.out_norm_y)]


def mean_weight(norm: nn.Module) -> float:
    weight = getattr(norm, "weight", None)
    return 1.0 if weight is None else float(weight.detach().float().mean())
