"""OLMo-core configs for our variants, and the weight mapping between the two frameworks.

``SiameseBlockConfig`` is OLMo-core's ``TransformerBlockConfig`` with two fields more, ``model_type`` and
``knobs``; OLMo-core builds blocks from it as from its own block types (``TransformerConfig.block``, per-block
``block_overrides``), and its config files round-trip it (``_CLASS_``). The block is chosen by the selection rule
of the ai2-olmo path: the ``MODEL_TYPE`` environment variable, else ``model_type``, else ``pre``.

``transformer_config(model_config)`` turns one of our model configs (a recipe's ``model:``, a
``SiameseModelConfig``) into OLMo-core's ``TransformerConfig`` for the same model: same widths, heads, norms,
RoPE, SwiGLU hidden size, biases, tying. ``olmo_to_core_state`` / ``core_to_olmo_state`` map a state dict between
the ai2-olmo model and that OLMo-core model (OLMo's fused Q/K/V and SwiGLU projections split into OLMo-core's
``w_q``/``w_k``/``w_v`` and ``w1``/``w3``, names moved, nothing else changed), so the two give the same logits
(tests/olmo_core/test_olmo_core.py, every MODEL_TYPE).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import torch
from olmo_core.nn.attention import AttentionConfig
from olmo_core.nn.feed_forward import FeedForwardConfig
from olmo_core.nn.layer_norm import LayerNormConfig, LayerNormType
from olmo_core.nn.lm_head import LMHeadConfig
from olmo_core.nn.moe import MoEConfig, MoERouterConfig, MoEType
from olmo_core.nn.rope import RoPEConfig
from olmo_core.nn.transformer.config import TransformerBlockConfig, TransformerConfig, TransformerType

from siamesenorm.models.config import resolve_model_type, validate_model_config
from siamesenorm.models.core_state import core_to_olmo_state, olmo_to_core_state  # noqa: F401 (re-exported)
from siamesenorm.olmo_core import moe_kernels
from siamesenorm.olmo_core.blocks import QKV_HEAD_NORM_TYPES, core_block_class  # checks the OLMo-core release first
from siamesenorm.variants import VARIANTS

__all__ = ["SiameseBlockConfig", "SiameseTransformerConfig", "transformer_config", "moe_config", "olmo_to_core_state",
           "core_to_olmo_state", "enum_value"]


def enum_value(field) -> str:
    """An OLMo config enum (or a plain string) as its string value."""
    return str(getattr(field, "value", field))


@dataclass
class SiameseBlockConfig(TransformerBlockConfig):
    """OLMo-core's block config plus the variant: ``model_type`` (chosen as on the ai2-olmo path: the ``MODEL_TYPE``
    environment variable, else this field, else ``pre``) and its ``knobs`` (model config fields of siamesenorm.models.config, e.g. ``{"siamese_depth_scaling": false}``; a knob not
    given has its default)."""

    model_type: Optional[str] = None
    knobs: Dict[str, Any] = field(default_factory=dict)

    def build(self, *, d_model: int, block_idx: int, n_layers: int, init_device: str = "cpu", cache=None):
        model_type, _ = resolve_model_type(self)  # reads self.model_type as it reads model.model_type
        if self.feed_forward_moe is not None:
            moe_kernels.install()  # PyTorch permutation kernels where OLMo-core has no Triton (CPU)
        block_class = core_block_class(model_type, moe=self.feed_forward_moe is not None)
        kwargs = self.as_dict(exclude_none=True, recurse=False)
        for name in ("name", "model_type", "knobs"):
            kwargs.pop(name, None)
        kwargs.update(d_model=d_model, block_idx=block_idx, n_layers=n_layers, init_device=init_device,
                      cache=cache)
        if model_type != "pre":
            kwargs["knobs"] = dict(self.knobs)
        return block_class(**kwargs)


@dataclass
class SiameseTransformerConfig(TransformerConfig):
    """OLMo-core's ``TransformerConfig``; the model it builds runs each block's ``scale_init`` (DeepNorm's beta,
    hc's output scaling) right after OLMo-core's own ``init_weights``, which re-initialises the attention and
    feed-forward weights of every block and offers no per-block hook. Its parameter counts (the one OLMo-core
    logs before building, the active count of an MoE) include the variant's own parameters."""

    olmo_init: Optional[Dict[str, Any]] = None
    """The recipe's initialisation as ai2-olmo 0.6.0 reads it (``model.init_fn`` and its fields, ``olmo_init``
    below); applied after OLMo-core's own init, so every matrix ai2-olmo initialises gets its distribution."""

    @property
    def num_params(self) -> int:
        """All parameters, ours too (OLMo-core's count knows only its own block types)."""
        return super().num_params + self._variant_params()

    @property
    def num_active_params(self) -> int:
        """The parameters a token uses (an MoE's unrouted experts left out), ours too."""
        return super().num_active_params + self._variant_params()

    def _variant_params(self) -> int:
        """What the variant's blocks hold beyond OLMo-core's count of their config (stream norms, gamma, the
        connections; less an unused norm), counted on blocks built on the meta device (nothing is allocated)."""
        extra = 0
        for index, block_config in enumerate(self.resolved_block_configs):
            block = block_config.build(d_model=self.d_model, block_idx=index, n_layers=self.n_layers,
                                       init_device="meta")
            extra += sum(p.numel() for p in block.parameters()) - block_config.num_params(self.d_model)
        return extra

    def build(self, *, init_device: str = "cpu"):
        model = super().build(init_device=init_device)
        model.init_weights = functools.partial(_init_as_recipe, model.init_weights, model, self.olmo_init)
        return model


def _init_as_recipe(init_weights, model, olmo_init: Optional[Dict[str, Any]], *args, **kwargs):
    """OLMo-core's init, then ai2-olmo's distribution for every matrix it initialises, then the variants' scaling
    (DeepNorm's beta, hc's output scaling), in the order the ai2-olmo path applies them."""
    generator = init_weights(*args, **kwargs)
    if olmo_init is not None:
        apply_olmo_init(model, olmo_init, generator)
    for block in model.blocks.values():
        if hasattr(block, "scale_init"):
            block.scale_init()
    return generator


# ---- ai2-olmo's initialisation, per tensor ------------------------------------------------------------------------
#: OLMo-core parameter name -> the role ai2-olmo 0.6.0's reset_parameters gives its counterpart.
_INIT_ROLES = (
    (re.compile(r"^embeddings\.weight$"), "embedding"),
    (re.compile(r"^blocks\.(\d+)\.attention\.w_[qkv]\.weight$"), "input"),  # ai2-olmo's fused att_proj
    (re.compile(r"^blocks\.(\d+)\.feed_forward\.w[13]\.weight$"), "input"),  # its fused ff_proj
    (re.compile(r"^blocks\.(\d+)\.attention\.w_out\.weight$"), "attention_output"),
    (re.compile(r"^blocks\.(\d+)\.feed_forward\.w2\.weight$"), "mlp_output"),
    (re.compile(r"^lm_head\.w_out\.weight$"), "head"),
)


def olmo_init_fields(model_config) -> Dict[str, Any]:
    """What ai2-olmo's initialisation reads from a model config."""
    return {"init_fn": enum_value(model_config.init_fn), "init_std": float(model_config.init_std),
            "init_cutoff_factor": model_config.init_cutoff_factor, "emb_init_std": model_config.emb_init_std,
            "scale_emb_init": bool(model_config.scale_emb_init), "d_model": int(model_config.d_model),
            "n_layers": int(model_config.n_layers)}


def olmo_init_spec(name: str, fan_in: int, fields: Dict[str, Any]) -> Optional[Tuple[float, Optional[float]]]:
    """(std, cutoff in stds or None for an untruncated normal) that ai2-olmo 0.6.0 draws the OLMo-core tensor
    ``name`` from (olmo/model.py reset_parameters of OLMo, OLMoBlock and OLMoSequentialBlock; ``fan_in``: the
    tensor's input features); None for a tensor ai2-olmo does not initialise that way (norms, MoE, our own)."""
    role, layer = None, 0
    for pattern, kind in _INIT_ROLES:
        match = pattern.match(name)
        if match:
            role, layer = kind, int(match.group(1)) if match.groups() else 0
            break
    if role is None:
        return None
    fn, std, d, n = fields["init_fn"], fields["init_std"], fields["d_model"], fields["n_layers"]
    cutoff = fields["init_cutoff_factor"]
    if fn == "normal":
        table = {"embedding": fields["emb_init_std"] or std, "input": std, "attention_output": std,
                 "mlp_output": std, "head": std}
        return table[role], cutoff
    if fn == "mitchell":
        table = {"embedding": fields["emb_init_std"] or d ** -0.5, "input": d ** -0.5,
                 "attention_output": (2 * d * (layer + 1)) ** -0.5, "mlp_output": (2 * fan_in * (layer + 1)) ** -0.5,
                 "head": d ** -0.5}
        return table[role], cutoff or 3.0
    if fn == "full_megatron":
        embedding = fields["emb_init_std"] if fields["emb_init_std"] is not None else \
            std * d ** 0.5 if fields["scale_emb_init"] else std
        table = {"embedding": embedding, "input": std, "attention_output": std / (2.0 * n) ** 0.5,
                 "mlp_output": std / (2.0 * n) ** 0.5, "head": d ** -0.5}
        return table[role], cutoff or 3.0
    raise ValueError(f"model.init_fn {fn} has no OLMo-core mapping here; use normal, mitchell or full_megatron")


@torch.no_grad()
def apply_olmo_init(model: torch.nn.Module, fields: Dict[str, Any], generator: torch.Generator) -> None:
    """Every matrix ai2-olmo initialises drawn as it draws it (truncated at the same cutoff); the biases of those
    layers zero, as ai2-olmo's init_normal leaves them."""
    modules = dict(model.named_modules())
    for name, param in model.named_parameters():
        fan_in = param.shape[-1] if param.dim() == 2 else 0
        spec = olmo_init_spec(name, fan_in, fields)
        if spec is None:
            continue
        std, cutoff = spec
        if cutoff is None:
            torch.nn.init.normal_(param, mean=0.0, std=std, generator=generator)
        else:
            torch.nn.init.trunc_normal_(param, mean=0.0, std=std, a=-cutoff * std, b=cutoff * std,
                                        generator=generator)
        bias = getattr(modules.get(name.rsplit(".", 1)[0]), "bias", None)
        if isinstance(bias, torch.nn.Parameter):
            torch.nn.init.zeros_(bias)


def _norm_config(model_config, elementwise_affine: Optional[bool] = None) -> LayerNormConfig:
    kind = enum_value(model_config.layer_norm_type)
    if kind not in ("rms", "default"):
        raise ValueError(f"model.layer_norm_type {kind} has no OLMo-core counterpart here; use rms or default")
    bias = model_config.bias_for_layer_norm
    bias = model_config.include_bias if bias is None else bias
    affine = model_config.layer_norm_with_affine if elementwise_affine is None else elementwise_affine
    return LayerNormConfig(name=LayerNormType.rms if kind == "rms" else LayerNormType.default,
                           eps=model_config.layer_norm_eps, elementwise_affine=affine, bias=bias and affine)


def _refuse_unsupported(model_config) -> None:
    activation = enum_value(model_config.activation_type)
    problems = {
        "model.activation_type must be swiglu (OLMo-core's feed-forward is SwiGLU)": activation != "swiglu",
        "model.alibi is not in OLMo-core; use rope": model_config.alibi,
        "model.scale_logits has no OLMo-core counterpart": model_config.scale_logits,
        "model.block_group_size must be 1": model_config.block_group_size != 1,
        "model.block_type must be sequential": enum_value(model_config.block_type) != "sequential",
    }
    for message, bad in problems.items():
        if bad:
            raise ValueError(f"the OLMo-core path cannot build this model: {message}")


def moe_config(moe, d_model: int) -> MoEConfig:
    """OLMo-core's ``MoEConfig`` for a recipe's ``moe:`` (``siamesenorm.run.recipe.MoESettings``): SwiGLU experts
    without biases, softmax top-k routing, dropless unless a capacity factor is given."""
    shared = moe.shared_hidden_size
    return MoEConfig(
        name=MoEType.dropless if moe.capacity_factor is None else MoEType.default, num_experts=moe.num_experts,
        hidden_size=moe.hidden_size or d_model // 2, capacity_factor=moe.capacity_factor,
        router=MoERouterConfig(top_k=moe.top_k), lb_loss_weight=moe.lb_loss_weight,
        z_loss_weight=moe.z_loss_weight,
        shared_mlp=FeedForwardConfig(hidden_size=shared, bias=False) if shared else None)


def transformer_config(model_config, model_type: Optional[str] = None, moe=None) -> TransformerConfig:
    """OLMo-core's ``TransformerConfig`` for one of our model configs (``SiameseModelConfig`` or OLMo's own);
    ``model_type`` as in ``siamesenorm.build_model`` (argument > ``MODEL_TYPE`` > ``model.model_type`` > pre).
    ``moe`` (a recipe's ``moe:``): an MoE transformer, each block's feed-forward OLMo-core's MoE."""
    _refuse_unsupported(model_config)
    name, _ = resolve_model_type(model_config, model_type)
    validate_model_config(model_config, name)  # the checks of the ai2-olmo path, with its one-line messages
    core_block_class(name)
    head_dim = model_config.d_model // model_config.n_heads
    qk_norm = None  # OLMo's Q/K norms, or the HybridNorm family's per-head ones
    if name in QKV_HEAD_NORM_TYPES or model_config.attention_layer_norm:
        qk_norm = _norm_config(model_config, model_config.attention_layer_norm_with_affine)
    attention = AttentionConfig(
        n_heads=model_config.n_heads, n_kv_heads=model_config.effective_n_kv_heads, head_dim=head_dim,
        bias=model_config.include_bias, clip_qkv=model_config.clip_qkv, qk_norm=qk_norm,
        use_head_qk_norm=True if name in QKV_HEAD_NORM_TYPES else None,
        rope=RoPEConfig(theta=model_config.rope_theta, full_precision=model_config.rope_full_precision)
        if model_config.rope else None,
        dropout=model_config.attention_dropout or None)
    hidden = (model_config.mlp_hidden_size if model_config.mlp_hidden_size is not None
              else model_config.mlp_ratio * model_config.d_model) // 2  # OLMo's SwiGLU projects to 2 x hidden
    block = SiameseBlockConfig(
        sequence_mixer=attention, layer_norm=_norm_config(model_config),
        feed_forward=FeedForwardConfig(hidden_size=hidden, bias=model_config.include_bias) if moe is None else None,
        feed_forward_moe=moe_config(moe, model_config.d_model) if moe is not None else None,
        dropout=model_config.residual_dropout or None, model_type=name,
        knobs={k.name: getattr(model_config, k.name) for k in VARIANTS[name].knobs if hasattr(model_config, k.name)})
    vocab = model_config.embedding_size or model_config.vocab_size
    return SiameseTransformerConfig(
        name=TransformerType.default if moe is None else TransformerType.moe, d_model=model_config.d_model, vocab_size=vocab, n_layers=model_config.n_layers, block=block,
        lm_head=LMHeadConfig(layer_norm=_norm_config(model_config), bias=model_config.include_bias),
        embedding_norm=_norm_config(model_config) if model_config.embedding_layer_norm else None,
        init_std=model_config.init_std, tie_word_embeddings=bool(model_config.weight_tying),
        olmo_init=olmo_init_fields(model_config) if moe is None else None)



