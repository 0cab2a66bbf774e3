"""What every topology shares: OLMo's sequential block cut into its two branches, and the stacked-stream state.

A block maps one tensor to one tensor, as OLMo's model loop expects. A topology with n streams carries them
concatenated on the feature axis, shape (B, T, n * d_model): block 0 widens the embedding into n streams and the
last block fuses them back to (B, T, d_model), so OLMo's own final norm ``ln_f`` is the topology's final norm and
everything that happens between blocks (KV cache, activation checkpointing, FSDP wrapping, block groups,
``last_logits_only``) sees one tensor and works unchanged.
"""

from __future__ import annotations

import os
from typing import Callable, ClassVar, Optional, Tuple

import torch
from torch.utils.checkpoint import checkpoint
from olmo.config import ModelConfig
from olmo.model import BufferCache, LayerNormBase, OLMoSequentialBlock

from ..config import depth_scale

__all__ = ["TopologyBlock", "TwoStreamBlock", "norm_params", "linear_params", "sequential_block_params"]

KVCache = Optional[Tuple[torch.Tensor, torch.Tensor]]


def norm_params(config: ModelConfig, size: Optional[int] = None, elementwise_affine: Optional[bool] = None) -> int:
    """Parameters of one LayerNormBase.build(config, size, elementwise_affine) module."""
    size = size or config.d_model
    affine = elementwise_affine or (elementwise_affine is None and config.layer_norm_with_affine)
    if not affine:
        return 0
    use_bias = config.bias_for_layer_norm if config.bias_for_layer_norm is not None else config.include_bias
    return size * (2 if use_bias else 1)


def linear_params(config: ModelConfig, fan_in: int, fan_out: int) -> int:
    return fan_in * fan_out + (fan_out if config.include_bias else 0)


def hidden_size(config: ModelConfig) -> int:
    return config.mlp_hidden_size if config.mlp_hidden_size is not None else config.mlp_ratio * config.d_model


def sequential_block_params(config: ModelConfig) -> int:
    """Parameters of OLMo's OLMoSequentialBlock, computed from the config alone."""
    d = config.d_model
    head_dim = d // config.n_heads
    qkv = d + 2 * config.effective_n_kv_heads * head_dim
    act_mult = 0.5 if str(config.activation_type) == "swiglu" else 1.0
    n = linear_params(config, d, qkv) + linear_params(config, d, d)
    n += linear_params(config, d, hidden_size(config)) + linear_params(config, int(act_mult * hidden_size(config)), d)
    n += 2 * norm_params(config)  # attn_norm, ff_norm
    if config.attention_layer_norm:
        affine = config.attention_layer_norm_with_affine
        n += norm_params(config, d, affine) + norm_params(config, config.effective_n_kv_heads * head_dim, affine)
    return n


#: Recompute the cheap parts of the variants' blocks in backward instead of saving their intermediates: every norm
#: (which saves its input, the normalised tensor and the statistics; recomputed, only the input is kept, and the
#: residual stream holds it anyway) and hc/mhc's width connections (the stream mixing). Exact: backward reruns
#: the same ops, so losses and gradients are bit-identical. It cuts the multi-stream variants' activation memory
#: (docs/performance.md); ``pre`` is OLMo's own block and is unaffected. SIAMESENORM_RECOMPUTE=0 turns it off.
RECOMPUTE = os.environ.get("SIAMESENORM_RECOMPUTE", "1") != "0"


class TopologyBlock(OLMoSequentialBlock):
    """OLMo's sequential block with its forward replaced by a topology; its weights and attention are reused.

    Subclasses set ``n_streams``, write ``forward`` with ``attention_branch`` / ``mlp_branch`` and give
    ``extra_params`` (parameters they add to, or remove from, OLMo's block) so the count can be checked.
    """

    n_streams: ClassVar[int] = 1
    #: What each stream of the stacked state is, in order (used by the analysis tools).
    stream_names: ClassVar[Tuple[str, ...]] = ("residual",)
    #: OLMo block norms this topology does not use (removed so DDP sees no unused parameter).
    unused_olmo_norms: ClassVar[Tuple[str, ...]] = ()

    def __init__(self, layer_id: int, config: ModelConfig, cache: BufferCache):
        super().__init__(layer_id, config, cache)
        self.removed_norms = self.removed_olmo_norms(config, layer_id)
        for name in self.removed_norms:
            delattr(self, name)
        self.is_first = layer_id == 0
        self.is_last = layer_id == config.n_layers - 1

    # ---- parameters -------------------------------------------------------------------------------------
    def new_norm(self, size: Optional[int] = None, elementwise_affine: Optional[bool] = None) -> LayerNormBase:
        return LayerNormBase.build(self.config, size=size, elementwise_affine=elementwise_affine)

    def reset_parameters(self):
        # OLMo's reset touches attn_norm / ff_norm; a topology may have removed one, so reset what exists.
        for name in self.removed_norms:
            setattr(self, name, _NoNorm())
        try:
            super().reset_parameters()
        finally:
            for name in self.removed_norms:
                delattr(self, name)
        for module in self.children():
            if isinstance(module, LayerNormBase):
                module.reset_parameters()

    @classmethod
    def removed_olmo_norms(cls, config: ModelConfig, layer_id: int) -> Tuple[str, ...]:
        return cls.unused_olmo_norms

    @classmethod
    def extra_params(cls, config: ModelConfig, layer_id: int) -> int:
        """Parameters this block has beyond (or, negative, below) OLMo's sequential block."""
        return -len(cls.removed_olmo_norms(config, layer_id)) * norm_params(config)

    @classmethod
    def num_params_from_config(cls, config: ModelConfig, layer_id: int) -> int:
        return sequential_block_params(config) + cls.extra_params(config, layer_id)

    # ---- computation ------------------------------------------------------------------------------------
    def ckpt(self, fn: Callable, *args, **kwargs):
        """Run ``fn`` under OLMo's fine-grained activation checkpointing when it is on."""
        if self._activation_checkpoint_fn is not None:
            return self._activation_checkpoint_fn(fn, *args, **kwargs)
        return fn(*args, **kwargs)

    def attention_branch(
        self,
        h: torch.Tensor,
        attention_bias: Optional[torch.Tensor],
        layer_past: KVCache,
        use_cache: bool,
        max_doc_len: Optional[int],
        cu_doc_lens: Optional[torch.Tensor],
        out_norm: Optional[LayerNormBase] = None,
    ) -> Tuple[torch.Tensor, KVCache]:
        """dropout(Attn(h)) with OLMo's projections and attention; h: (B, T, d_model), no input norm applied here.
        ``out_norm`` (if given) normalises the attention output before dropout."""
        qkv = self.att_proj(h)
        if self.config.clip_qkv is not None:
            qkv = qkv.clamp(min=-self.config.clip_qkv, max=self.config.clip_qkv)
        q, k, v = qkv.split(self.fused_dims, dim=-1)
        att, cache = self.ckpt(
            self.attention,
            q,
            k,
            v,
            attention_bias,
            layer_past=layer_past,
            use_cache=use_cache,
            max_doc_len=max_doc_len,
            cu_doc_lens=cu_doc_lens,
        )
        if out_norm is not None:
            att = self.norm(out_norm, att)
        return self.dropout(att), cache

    def mlp_branch(self, h: torch.Tensor, out_norm: Optional[LayerNormBase] = None) -> torch.Tensor:
        """dropout(MLP(h)) with OLMo's ff_proj, activation and ff_out; ``out_norm`` (if given) before dropout."""
        h = self.ff_proj(h)
        h = self.ckpt(self.act, h)
        h = self.ff_out(h)
        if out_norm is not None:
            h = self.norm(out_norm, h)
        return self.dropout(h)

    def norm(self, module: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """``module(x)``; in training recomputed in backward (RECOMPUTE), or under OLMo's fine-grained activation
        checkpointing when that is on."""
        if self._activation_checkpoint_fn is not None:
            return self._activation_checkpoint_fn(module, x)
        return self.recompute(module, x)

    @staticmethod
    def recompute(fn: Callable, *args: torch.Tensor):
        """``fn(*args)``, its intermediates recomputed in backward instead of saved when RECOMPUTE is on and
        autograd records (``fn`` must be deterministic: no dropout)."""
        if RECOMPUTE and torch.is_grad_enabled() and any(a.requires_grad for a in args):
            return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)
        return fn(*args)

    # ---- stacked streams --------------------------------------------------------------------------------
    def split_streams(self, x: torch.Tensor) -> list[torch.Tensor]:
        """(B, T, n * d) -> n tensors (B, T, d); block 0 receives the embedding and copies it into every stream."""
        if self.is_first:
            return [x] * self.n_streams
        return list(x.chunk(self.n_streams, dim=-1))

    @staticmethod
    def stack_streams(streams: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(streams, dim=-1)

    #: Set (to a list) by the analysis tools: the last block appends its streams here just before fusing them.
    stream_capture: Optional[list] = None

    def contributions(self, streams: list[torch.Tensor]) -> list[torch.Tensor]:
        """What each stream adds to the fused state that OLMo's final norm receives (the last block fuses)."""
        return streams

    def fusion_weights(self) -> list[float]:
        """The scale each stream enters the fusion with (mean of its output norm's weight, or a constant)."""
        return [1.0] * self.n_streams

    def finish(self, streams: list[torch.Tensor]) -> torch.Tensor:
        """End of a block: stack the streams, or, in the last block, fuse them (sum of their contributions)."""
        if not self.is_last:
            return self.stack_streams(streams) if len(streams) > 1 else streams[0]
        if self.stream_capture is not None:
            self.stream_capture.append([s.detach() for s in streams])
        parts = self.contributions(streams)
        return sum(parts[1:], parts[0])

    def skip(self, x: torch.Tensor) -> torch.Tensor:
        """This block with its sublayers removed (the depth probe): the streams pass through unchanged, widened
        where this block widens the state and fused where it fuses."""
        return self.finish(self.split_streams(x))


class ConnectedStreamsBlock(TopologyBlock):
    """n streams with a learned connection around each sublayer (hc, mhc). A connection's ``width(h)`` gives
    (branch input, carried streams, per-stream output weights); h is (B, T, n, d). The depth connection, the
    same for both, is ``depth``: each stream j becomes carried_j + weight_j * F(input). Subclasses set ``n_streams`` and the two connections (named in
    ``connection_names``, attention first). ``attn_norm`` / ``ff_norm`` keep their Pre-Norm role in each branch."""

    connection_names: ClassVar[Tuple[str, str]] = ("attn_conn", "ff_conn")

    @property
    def stream_names(self) -> Tuple[str, ...]:  # type: ignore[override]
        return tuple(f"stream_{i + 1}" for i in range(self.n_streams))

    def reset_parameters(self):
        super().reset_parameters()
        for name in self.connection_names:
            getattr(self, name).reset_parameters()

    @staticmethod
    def depth(carried: torch.Tensor, weights: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """(B, T, n, d) carried streams + (B, T, n) weights x (B, T, d) sublayer output."""
        return carried + weights.unsqueeze(-1) * out.unsqueeze(-2)

    def forward(self, x, attention_bias=None, layer_past=None, use_cache=False, max_doc_len=None, cu_doc_lens=None):
        if self.is_first:  # embedding (B, T, d) -> n equal streams (B, T, n, d)
            h = x.unsqueeze(-2).expand(*x.shape[:-1], self.n_streams, x.shape[-1])
        else:
            h = x.unflatten(-1, (self.n_streams, -1))
        attn_conn, ff_conn = (getattr(self, name) for name in self.connection_names)
        inp, carried, weights = self.recompute(attn_conn.width, h)
        att, cache = self.attention_branch(
            self.norm(self.attn_norm, inp), attention_bias, layer_past, use_cache, max_doc_len, cu_doc_lens
        )
        h = self.depth(carried, weights, att)
        inp, carried, weights = self.recompute(ff_conn.width, h)
        h = self.depth(carried, weights, self.mlp_branch(self.norm(self.ff_norm, inp)))
        return self.finish(list(h.unbind(-2))), cache  # the last block fuses the streams (contributions)


def two_stream_fusion_params(config: ModelConfig, layer_id: int) -> int:
    """out_norm_x and out_norm_y, in the last block only."""
    return 2 * norm_params(config) if layer_id == config.n_layers - 1 else 0


class TwoStreamBlock(TopologyBlock):
    """Shared by both SiameseNorm blocks: two stacked streams, depth scale, final fusion in the last block."""

    n_streams = 2

    def __init__(self, layer_id, config, cache):
        super().__init__(layer_id, config, cache)
        self.depth_scale = depth_scale(config, layer_id)
        if self.is_last:
            self.out_norm_x = self.new_norm()
            self.out_norm_y = self.new_norm()

    def contributions(self, streams):  # LN^out_X(X) + LN^out_Y(Y); OLMo's ln_f follows
        x_stream, y_stream = streams
        return [self.norm(self.out_norm_x, x_stream), self.norm(self.out_norm_y, y_stream)]

    def fusion_weights(self) -> list[float]:
        return [_mean_weight(self.out_norm_x), _mean_weight(self.out_norm_y)]

    @classmethod
    def extra_params(cls, config: ModelConfig, layer_id: int) -> int:
        return super().extra_params(config, layer_id) + two_stream_fusion_params(config, layer_id)


def _mean_weight(norm: LayerNormBase) -> float:
    weight = getattr(norm, "weight", None)
    return 1.0 if weight is None else float(weight.detach().float().mean())


class _NoNorm:
    """Stand-in for a removed norm while OLMo's reset_parameters runs."""

    def reset_parameters(self):
        pass
