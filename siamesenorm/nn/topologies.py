"""Residual topologies around one sublayer F, in plain PyTorch (torch only).

Each topology's update rule is written once, as a function of the streams, the sublayer F and the norms
(``post_norm_update``, ``hybrid_norm_update``, ``siamese_update``, ``siamese_hybrid_attention``, and the
connections' ``width`` / ``depth``). The modules below own their norms and call these functions; the OLMo blocks in
siamesenorm/variants/ call the same functions with OLMo's sublayers and norms, so both run one definition.

A wrapper is built once per sublayer, ``Topology(dim, branch, ...)``, and maps the topology's state to the new
state: a tensor (B, ..., d) for the single-stream ones, a pair (X, Y) for SiameseNorm, (B, ..., n, d) for the
hyper-connections. ``expand`` turns the embedding into the state, ``reduce`` (or SiameseFusion) the state back
into one tensor for the host's final norm and head.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from .fused import hc_width, mhc_width, rms_project, stream_mix
from .fused import sinkhorn as fused_sinkhorn
from .fused import sinkhorn_reference as sinkhorn

__all__ = ["PreNorm", "PostNorm", "HybridNorm", "SiameseNorm", "SiameseFusion", "HyperConnection",
           "HyperConnections", "ManifoldHyperConnection", "ManifoldHyperConnections", "post_norm_update",
           "hybrid_norm_update", "siamese_input", "siamese_update", "siamese_hybrid_attention", "depth_divisor", "sinkhorn",
           "expand_streams", "StackedStreams", "NORM_POSITIONS", "DEPTH_SCALING_FORMS", "SINKHORN_ORDERS",
           "depth_attention", "attn_res_sublayer", "attn_res_sources_at", "AttnResStreams", "StreamMixing", "MIXING_FORMS"]

Branch = Callable[[torch.Tensor], torch.Tensor]
Norm = Callable[[torch.Tensor], torch.Tensor]
NormFactory = Callable[[int], nn.Module]

#: Where a Post-Norm-style norm sits (post, and post_pre's bounded stream X):
#: "after_addition": x <- LN(x + F(x)) (paper eq. 2 and section 3's text);
#: "before_sublayer": x <- LN(x); x <- x + F(x) (the official DeiT/DiT SiameseNorm Block, the HybridNorm fork's
#: Post-Norm switch): the same chain of "add, normalise" shifted by one norm.
NORM_POSITIONS: Tuple[str, ...] = ("after_addition", "before_sublayer")

#: c(l) for the 0-based layer l: the bounded stream receives O / c(l). "inv_sqrt_2layer" is what the paper's
#: reference code computes (sqrt(2(l+1))); "inv_sqrt_layer" is the paper's text (section 4.2: sqrt(l+1)).
DEPTH_SCALING_FORMS: dict = {
    "inv_sqrt_layer": lambda layer: math.sqrt(layer + 1),
    "inv_sqrt_2layer": lambda layer: math.sqrt(2 * (layer + 1)),
}

#: mhc's Sinkhorn-Knopp order within one iteration: "columns_first" is the mHC paper's T_r(T_c(.)) (rows end exact),
#: "rows_first" normalises rows then columns (columns end exact).
SINKHORN_ORDERS: Tuple[str, ...] = ("columns_first", "rows_first")


def _branch_module(branch: Branch) -> nn.Module:
    """Keep a module branch registered (its parameters train with the wrapper); wrap a plain function."""
    return branch if isinstance(branch, nn.Module) else _Function(branch)


class _Function(nn.Module):
    def __init__(self, fn: Branch):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def _check_position(position: str) -> str:
    if position not in NORM_POSITIONS:
        raise ValueError(f"norm position {position!r} is unknown; use one of: {', '.join(NORM_POSITIONS)}.")
    return position


# ---- one stream ----------------------------------------------------------------------------------------------------
def post_norm_update(x: torch.Tensor, branch: Branch, norm: Norm, position: str = "after_addition",
                     alpha: float = 1.0) -> torch.Tensor:
    """Post-Norm around one sublayer, the norm where ``position`` says; ``alpha`` scales the residual (DeepNorm):

        "after_addition":   x <- LN(alpha x + F(x))
        "before_sublayer":  x <- LN(x);  x <- alpha x + F(x)
    """
    if position == "before_sublayer":
        x = norm(x)
        return (x if alpha == 1.0 else alpha * x) + branch(x)
    return norm((x if alpha == 1.0 else alpha * x) + branch(x))


def hybrid_norm_update(x: torch.Tensor, branch: Branch, norm: Optional[Norm] = None) -> torch.Tensor:
    """HybridNorm's stream around one sublayer: x <- x + F(x) (attention, ``norm`` None), or
    u = LN(x); x <- u + F(u) (MLP: the normalised value is also the residual)."""
    if norm is not None:
        x = norm(x)
    return x + branch(x)


class PreNorm(nn.Module):
    """Pre-Norm:   x <- x + F(LN(x))."""

    def __init__(self, dim: int, branch: Branch, norm: NormFactory = nn.LayerNorm):
        super().__init__()
        self.branch, self.norm = _branch_module(branch), norm(dim)

    expand = staticmethod(lambda x: x)
    reduce = staticmethod(lambda x: x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.branch(self.norm(x))


class PostNorm(nn.Module):
    """Post-Norm (``post_norm_update``), two placements of the norm:

        "after_addition"  (paper eq. 2):             x <- LN(alpha x + F(x))
        "before_sublayer" (the HybridNorm OLMo fork): x <- LN(x);  x <- alpha x + F(x)

    alpha = 1, or DeepNorm's (2 N)^(1/4) for N layers.
    """

    def __init__(self, dim: int, branch: Branch, norm: NormFactory = nn.LayerNorm, position: str = "after_addition",
                 alpha: float = 1.0):
        super().__init__()
        self.branch, self.norm, self.position = _branch_module(branch), norm(dim), _check_position(position)
        self.alpha = alpha

    expand = staticmethod(lambda x: x)
    reduce = staticmethod(lambda x: x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return post_norm_update(x, self.branch, self.norm, self.position, self.alpha)


class HybridNorm(nn.Module):
    """HybridNorm's stream (Zhuo et al., 2025; ``hybrid_norm_update``). The attention sublayer has no input norm
    (its Q/K/V norms belong to the host's attention module) and a plain residual; the MLP sublayer normalises the
    stream and keeps the normalised value as its residual:

        attention:  x <- x + Attn(x)
        mlp:        u = LN(x);  x <- u + MLP(u)
    """

    def __init__(self, dim: int, branch: Branch, sublayer: str, norm: NormFactory = nn.LayerNorm):
        super().__init__()
        if sublayer not in ("attention", "mlp"):
            raise ValueError(f"sublayer must be 'attention' or 'mlp' (got {sublayer!r}).")
        self.branch, self.sublayer = _branch_module(branch), sublayer
        self.norm = norm(dim) if sublayer == "mlp" else None

    expand = staticmethod(lambda x: x)
    reduce = staticmethod(lambda x: x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return hybrid_norm_update(x, self.branch, self.norm)


# ---- SiameseNorm ---------------------------------------------------------------------------------------------------
def depth_divisor(layer: int, form: str = "inv_sqrt_2layer") -> float:
    """c(l) for 0-based layer l: sqrt(2(l+1)) (the official code, default) or sqrt(l+1) (the paper's text)."""
    if form not in DEPTH_SCALING_FORMS:
        raise ValueError(f"depth scaling form {form!r} is unknown; use one of: {', '.join(DEPTH_SCALING_FORMS)}.")
    return float(DEPTH_SCALING_FORMS[form](layer))


Run = Callable[..., object]


def _direct(fn: Callable, *args):
    return fn(*args)


def siamese_input(x: torch.Tensor, y: torch.Tensor, *, y_norm: Norm, x_norm: Optional[Norm] = None,
                  in_norm: Optional[Norm] = None,
                  x_norm_position: str = "before_sublayer") -> Tuple[torch.Tensor, torch.Tensor]:
    """The input fusion of one SiameseNorm sublayer: (X, H) with X = LN^X(X) where LN^X precedes the sublayer
    (else X unchanged) and H = LN^in(X + LN^Y(Y)) (H = X + LN^Y(Y) without ``in_norm``)."""
    if x_norm is not None and x_norm_position == "before_sublayer":
        x = x_norm(x)
    h = x + y_norm(y)
    return x, (in_norm(h) if in_norm is not None else h)


def siamese_update(x: torch.Tensor, y: torch.Tensor, branch: Branch, *, y_norm: Norm, x_norm: Optional[Norm] = None,
                   in_norm: Optional[Norm] = None, c: float = 1.0, x_norm_position: str = "before_sublayer",
                   run: Run = _direct) -> Tuple[torch.Tensor, torch.Tensor]:
    """One sublayer of SiameseNorm: the two streams share F. LN^X only where ``x_norm`` is given (post_pre's
    bounded stream; hybrid_pre's MLP has none), LN^in only where ``in_norm`` is given (the normalized input):

        "before_sublayer":  X = LN^X(X);  H = LN^in(X + LN^Y(Y));  O = F(H);  X = X + O / c;         Y = Y + O
        "after_addition":                 H = LN^in(X + LN^Y(Y));  O = F(H);  X = LN^X(X + O / c);   Y = Y + O

    ``run(fn, *tensors)`` calls the norm parts (the input fusion ``siamese_input``, and LN^X after the addition);
    the default calls them directly; the OLMo blocks pass their recompute-in-backward, so that only X and Y are
    kept for backward, not the normalised tensors.
    """
    fuse = functools.partial(siamese_input, y_norm=y_norm, x_norm=x_norm, in_norm=in_norm,
                             x_norm_position=x_norm_position)
    x, h = run(fuse, x, y)
    o = branch(h)
    x = x + o / c
    if x_norm is not None and x_norm_position == "after_addition":
        x = run(x_norm, x)
    return x, y + o


def siamese_hybrid_attention(x: torch.Tensor, y: torch.Tensor, branch: Branch, *, gamma: torch.Tensor, y_norm: Norm,
                             x_norm: Optional[Norm], c: float = 1.0,
                             run: Run = _direct) -> Tuple[torch.Tensor, torch.Tensor]:
    """hybrid_pre's attention sublayer (official OLMo_model_hybrid_pre.py): gamma (a learned vector, 1 at init)
    stands in for the norm HybridNorm omits on the attention input; ``run`` as in ``siamese_update``:

        H = gamma * X + LN^Y(Y);  R = Attn(H);  X = LN^X(X + R / c);  Y = Y + R

    With ``x_norm`` None, X + R / c is returned before LN^X, for a caller that applies LN^X at the start of the MLP
    sublayer (``siamese_update(..., x_norm=LN^X, x_norm_position="before_sublayer")``): the same X, and backward
    then keeps one tensor fewer (the OLMo block does this).
    """
    o = branch(run(lambda xs, ys: gamma.to(xs.dtype) * xs + y_norm(ys), x, y))
    x = x + o / c
    return (run(x_norm, x) if x_norm is not None else x), y + o


#: ``siamese_mixing``: how SiameseNorm's two streams are mixed before each sublayer (``StreamMixing``).
MIXING_FORMS = ("none", "static", "dynamic")


class StreamMixing(nn.Module):
    """SiameseNorm with stream mixing: before a sublayer the two streams (X bounded, Y Pre-Norm) are mixed by a
    learned 2 x 2 doubly stochastic matrix, as mHC mixes its n streams with H_res (Xie et al., arXiv 2512.24880,
    eq. 8: H_res = Sinkhorn(exp(a * mat(h~ P_res) + b_res))):

        [X; Y] <- H [X; Y],    H = [[p, 1 - p], [1 - p, p]],    p = sigmoid(z)
        z = b                                  ("static")
        z = b + a * (RMSNorm([X, Y]) . phi)    ("dynamic", per token; phi in R^{2d}, a a gate)

    Every 2 x 2 doubly stochastic matrix has this form (Birkhoff: a mix of the identity and the swap), and the
    Sinkhorn limit of exp(M) for any 2 x 2 M is it with z = (M11 + M22 - M12 - M21) / 2, so mHC's projection of
    a 2 x 2 H_res is computed here in closed form, exactly (mHC's 20 iterations approach it; tested against
    ``sinkhorn``); the four entries of mHC's P_res and b_res reduce to the one combination phi and b.

    Init: b = logit(``init``) (``siamese_mixing_init``, 0.95: X and Y start 5% mixed, so the model starts close to
    SiameseNorm without mixing; mHC's own init, H_res uniform, would start from X = Y = their mean, the two-stream
    design erased at step 0), phi ~ N(0, 1/(2d)) and a = 0.01 as mHC's P and gates. Columns sum to 1, so X + Y is
    unchanged by the mix (mHC's argument: the streams' sum keeps its identity path); p and 1 - p in fp32.
    """

    def __init__(self, dim: int, form: str = "static", init: float = 0.95, norm: NormFactory = nn.RMSNorm,
                 gate_init: float = 0.01, device=None):
        super().__init__()
        if form not in MIXING_FORMS[1:]:
            raise ValueError(f"stream mixing form {form!r} is unknown; use one of: {', '.join(MIXING_FORMS[1:])}.")
        self.form, self.init, self.gate_init = form, init, gate_init
        self.bias = nn.Parameter(torch.empty((), device=device))
        if form == "dynamic":
            self.norm = norm(2 * dim)
            self.proj = nn.Parameter(torch.empty(2 * dim, device=device))
            self.gate = nn.Parameter(torch.empty((), device=device))
        self.reset_parameters()

    def reset_parameters(self):
        with torch.no_grad():
            self.bias.fill_(math.log(self.init / (1.0 - self.init)))
            if self.form == "dynamic":
                self.norm.reset_parameters()
                nn.init.normal_(self.proj, std=1.0 / math.sqrt(self.proj.shape[0]))
                self.gate.fill_(self.gate_init)

    def coefficient(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """p, fp32: a scalar (static) or (..., 1) per token (dynamic)."""
        z = self.bias.float()
        if self.form == "dynamic":
            h = self.norm(torch.cat([x, y], dim=-1))
            z = z + self.gate.float() * torch.matmul(h.float(), self.proj.float()).unsqueeze(-1)
        return torch.sigmoid(z)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        p = self.coefficient(x, y)
        q = (1.0 - p).to(x.dtype)
        p = p.to(x.dtype)
        return p * x + q * y, q * x + p * y


class SiameseNorm(nn.Module):
    """SiameseNorm around one sublayer: two streams share F. X is bounded, Y is Pre-Norm-like; c = c(layer)
    (``depth_divisor``; 1 with ``depth_scaling=False``); LN^in only with ``normalized_input``.

    bounded="post" (post_pre), per sublayer, LN^X where ``x_norm_position`` says (``siamese_update``):
        "before_sublayer" (default; the official DeiT/DiT Block):  X = LN^X(X); H = LN^in(X + LN^Y(Y))
                                                                  O = F(H); X = X + O / c; Y = Y + O
        "after_addition"  (the paper's section-3 text):            H = LN^in(X + LN^Y(Y)); O = F(H)
                                                                  X = LN^X(X + O / c); Y = Y + O
    bounded="hybrid" (hybrid_pre, the paper's main model; official OLMo_model_hybrid_pre.py):
        attention: H = gamma * X + LN^Y(Y); R = Attn(H); X = LN^X(X + R / c); Y = Y + R   (``siamese_hybrid_attention``)
        mlp:       M = LN^in(X + LN^Y(Y));  O = MLP(M);  X = X + O / c;      Y = Y + O   (``siamese_update``, no LN^X)

         X --[LN^X]--+-----------(+ O/c)--[LN^X]--> X
                     |              ^
         Y --+--LN^Y-(+)--LN^in--F--+
             +-------------------(+ O)-----------> Y
    """

    def __init__(self, dim: int, branch: Branch, layer: int, norm: NormFactory = nn.LayerNorm,
                 bounded: str = "post", sublayer: str = "attention", x_norm_position: str = "before_sublayer",
                 depth_scaling: bool = True, depth_scaling_form: str = "inv_sqrt_2layer",
                 normalized_input: bool = True):
        super().__init__()
        if bounded not in ("post", "hybrid") or sublayer not in ("attention", "mlp"):
            raise ValueError("bounded must be 'post' or 'hybrid' and sublayer 'attention' or 'mlp'.")
        self.branch, self.bounded, self.sublayer = _branch_module(branch), bounded, sublayer
        self.x_norm_position = _check_position(x_norm_position)
        self.c = depth_divisor(layer, depth_scaling_form) if depth_scaling else 1.0
        self.y_norm = norm(dim)
        hybrid_attention = bounded == "hybrid" and sublayer == "attention"
        self.x_norm = norm(dim) if bounded == "post" or hybrid_attention else None
        self.in_norm = norm(dim) if normalized_input and not hybrid_attention else None
        self.gamma = nn.Parameter(torch.ones(dim)) if hybrid_attention else None

    @staticmethod
    def expand(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """X_0 = Y_0 = the embedding."""
        return x, x

    def forward(self, state: Tuple[torch.Tensor, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        x, y = state
        if self.gamma is not None:
            return siamese_hybrid_attention(x, y, self.branch, gamma=self.gamma, y_norm=self.y_norm,
                                            x_norm=self.x_norm, c=self.c)
        return siamese_update(x, y, self.branch, y_norm=self.y_norm, x_norm=self.x_norm, in_norm=self.in_norm,
                              c=self.c, x_norm_position=self.x_norm_position)


class SiameseFusion(nn.Module):
    """The end of SiameseNorm: LN^out_X(X) + LN^out_Y(Y); the host's final norm follows. The two norms' scales
    are the fusion weights (paper section 5.2)."""

    def __init__(self, dim: int, norm: NormFactory = nn.LayerNorm):
        super().__init__()
        self.x_norm, self.y_norm = norm(dim), norm(dim)

    def forward(self, state: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = state
        return self.x_norm(x) + self.y_norm(y)


# ---- Attention Residuals ------------------------------------------------------------------------------------------
def _rms_key(norm: Norm) -> Optional[Tuple[Optional[torch.Tensor], float]]:
    """(scale or None, eps) of an RMSNorm without bias (torch's ``nn.RMSNorm``, OLMo's ``RMSLayerNorm``, OLMo-core's
    ``RMSNorm``), the key norm of every AttnRes recipe here; None for any other norm."""
    if type(norm).__name__ not in ("RMSNorm", "RMSLayerNorm") or getattr(norm, "bias", None) is not None:
        return None
    eps = getattr(norm, "eps", None)
    return getattr(norm, "weight", None), torch.finfo(torch.float32).eps if eps is None else float(eps)


class _RMSLogits(torch.autograd.Function):
    """The logits of an RMSNorm key without bias, z_i r_i with z_i = v_i . u and r_i = rsqrt(||v_i||^2 / d + eps):
    (..., S, d) sources and the query u (d,) (the norm's scale folded in, fp32) -> (..., S) fp32. Its gradient is
    one expression, dv_i = g_i r_i u - (g_i z_i r_i^3 / d) v_i (two passes over the sources' size, and one more
    read for du = sum g_i r_i v_i), where autograd would differentiate the product and the norm apart and sum
    their gradients (six).

    The same arithmetic as siamesenorm.nn.fused ``rms_project`` with one column, kept apart on purpose: this is
    the eager form (plain torch ops, as every variant's unfused path; AttnRes has no fused path), the product in
    the sources' dtype as autocast runs the written form's and no squared copy of the sources (``vector_norm``;
    from bf16 sources on a CPU it still writes an fp32 copy, and backward writes dv in fp32 before the cast);
    ``rms_project`` is the fused connections' op (hc's, mHC's, under ``model.fused_streams``), whose CPU fallback
    also writes the squares: through it a 64 x 32 Full AttnRes step (fp32) on a CPU took twice as long (the same
    process, alternating). Every Full AttnRes record at 64 x 32 ran this op."""

    @staticmethod
    def forward(ctx, v: torch.Tensor, u: torch.Tensor, eps: float) -> torch.Tensor:
        # the product in the sources' own dtype (bf16 under autocast, as autocast runs the written form's product;
        # no fp32 copy of the sources), the norm accumulated in fp32
        z = torch.matmul(v, u.to(v.dtype)).float()
        r = torch.rsqrt(torch.linalg.vector_norm(v, dim=-1, dtype=torch.float32).square() / v.shape[-1] + eps)
        ctx.save_for_backward(v, u, z, r)
        return z * r

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        v, u, z, r = ctx.saved_tensors
        g = g.float()
        gz = g * r
        dv = torch.addcmul(gz.unsqueeze(-1) * u, (-g * z * r.pow(3) / v.shape[-1]).unsqueeze(-1), v)
        du = torch.matmul(gz.unsqueeze(-2).to(v.dtype), v).float().reshape(-1, v.shape[-1]).sum(0)
        return dv.to(v.dtype), du, None


def depth_attention(sources: torch.Tensor, query: torch.Tensor, key_norm: Norm,
                    more: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    """AttnRes's aggregation over depth: (..., S, d) sources, and ``more`` sources (..., d) after them, -> (..., d),

        h = sum_i alpha_i v_i,    alpha = softmax_i( w . RMSNorm(v_i) )

    with ``query`` w (d,) a learned pseudo-query (zero at init: the mean of the sources), the keys the sources
    normalised by ``key_norm``, the values the sources themselves; the softmax in fp32.

    With an RMSNorm key norm without bias (``_rms_key``; every recipe here) the logits are computed as
    ``(v_i . (g * w)) * rsqrt(||v_i||^2 / d + eps)``, the norm's scale g folded into the query and each source's
    rms from its norm, so the normalised copy of the sources is never written; ``sources`` may be a view of the
    block's state and ``more`` the block's own outputs, so the sources are never stacked into a new tensor either
    (both were most of a deep AttnRes model's step). Any other key norm is applied to the stacked sources as
    written. The two forms are the same equation; they differ by fp32 rounding."""
    if sources.shape[-2] + len(more) == 1:
        return sources[..., 0, :] if sources.shape[-2] else more[0]
    rms = _rms_key(key_norm)
    if rms is None:
        if more:
            sources = torch.cat([sources, torch.stack(list(more), dim=-2)], dim=-2)
        logits = torch.matmul(key_norm(sources).float(), query.float())
        weights = logits.softmax(dim=-1).to(sources.dtype)
        return torch.matmul(weights.unsqueeze(-2), sources).squeeze(-2)
    weight, eps = rms
    u = query.float() if weight is None else weight.float() * query.float()
    logits = torch.cat([_RMSLogits.apply(v, u, eps) for v in [sources] + [m.unsqueeze(-2) for m in more]], dim=-1)
    weights = logits.softmax(dim=-1).to(sources.dtype)
    n = sources.shape[-2]
    out = torch.matmul(weights[..., :n].unsqueeze(-2), sources).squeeze(-2)
    for j, m in enumerate(more):
        out = out + weights[..., n + j, None] * m
    return out


def attn_res_sources_at(sublayers_done: int, block_sublayers: int) -> Tuple[int, bool]:
    """(completed sources, whether a partial block sum follows them) in the state after ``sublayers_done``
    sublayers, with blocks of ``block_sublayers`` sublayers (1: Full AttnRes). The embedding is the first
    completed source; a block's sum is committed when the next block's first sublayer starts."""
    if sublayers_done == 0:
        return 1, False
    return 1 + (sublayers_done - 1) // block_sublayers, True


def attn_res_sublayer(held: torch.Tensor, more: List[torch.Tensor], partial: bool, index: int,
                      block_sublayers: int, branch: Branch, *, pre_norm: Norm, query: torch.Tensor, key_norm: Norm,
                      run: Run = _direct) -> Tuple[torch.Tensor, List[torch.Tensor], bool]:
    """One sublayer (0-based ``index`` over all 2L) of AttnRes. The sources are ``held`` (..., S, d) (a view of the
    state the block received) then ``more`` (the block's own, (..., d) each); ``partial`` says whether the last
    source is the open partial block sum. At the start of a block the partial sum becomes a completed source; the
    sublayer reads h = depth_attention(every source) through its Pre-Norm, and its output F(LN(h)) is added to
    the block's partial sum (started by it at a block's start). ``run`` calls the Pre-Norm (the cheap part, as in
    ``siamese_update``); the read itself is not recomputed in backward: it keeps O(S) scalars a token beside the
    O(S d) state it reads in place. Returns (held, more, partial) after it."""
    if partial and index % block_sublayers == 0:
        partial = False

    out = branch(run(pre_norm, depth_attention(held, query, key_norm, more)))
    if not partial:
        return held, more + [out], True
    if more:
        return held, more[:-1] + [more[-1] + out], True
    return held[..., :-1, :], [held[..., -1, :] + out], True


# ---- hyper-connections ----------------------------------------------------------------------------------------------
def expand_streams(x: torch.Tensor, n: int) -> torch.Tensor:
    """(..., d) -> (..., n, d): the embedding copied into n streams (a view, no copy)."""
    return x.unsqueeze(-2).expand(*x.shape[:-1], n, x.shape[-1])


class StackedStreams:
    """The stacked-stream state of a block, whatever the host framework: n streams carried concatenated on the
    feature axis, (B, T, n * d), so that a block maps one tensor to one tensor. Block 0 widens the embedding into
    n streams, the last block fuses them back to (B, T, d) for the host's final norm and head.

    A host block sets ``n_streams``, ``is_first``, ``is_last`` and ``_captured`` (None), and has ``norm(module, x)``
    (the adapters of siamesenorm/variants/ and siamesenorm/olmo_core/ do).
    """

    n_streams: int = 1
    is_first: bool = False
    is_last: bool = False
    _captured: Optional[list] = None

    def split_streams(self, x: torch.Tensor) -> List[torch.Tensor]:
        """(B, T, n * d) -> n tensors (B, T, d); block 0 receives the embedding and copies it into every stream."""
        if self.is_first:
            return [x] * self.n_streams
        return list(x.chunk(self.n_streams, dim=-1))

    def stacked(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, n * d) -> (B, T, n, d), the layout the connections mix; block 0 widens the embedding (a view)."""
        return expand_streams(x, self.n_streams) if self.is_first else x.unflatten(-1, (self.n_streams, -1))

    @contextlib.contextmanager
    def capturing_streams(self):
        """Within the block, each forward of this (last) block appends its streams, just before it fuses them, to
        the yielded list (the analysis tools' lens and stream magnitudes)."""
        self._captured = []
        try:
            yield self._captured
        finally:
            self._captured = None

    def contributions(self, streams: List[torch.Tensor]) -> List[torch.Tensor]:
        """What each stream adds to the fused state that the host's final norm receives (the last block fuses)."""
        return streams

    def fusion_weights(self) -> List[float]:
        """The scale each stream enters the fusion with (mean of its output norm's weight, or a constant)."""
        return [1.0] * self.n_streams

    def finish(self, streams: List[torch.Tensor]) -> torch.Tensor:
        """End of a block: stack the streams, or, in the last block, fuse them (sum of their contributions)."""
        if not self.is_last:
            return torch.cat(streams, dim=-1) if len(streams) > 1 else streams[0]
        if self._captured is not None:
            self._captured.append([s.detach() for s in streams])
        parts = self.contributions(streams)
        return sum(parts[1:], parts[0])

    def finish_stacked(self, h: torch.Tensor) -> torch.Tensor:
        """``finish`` for streams that are already one tensor h (B, T, n, d) (hc's and mhc's connections): a middle
        block returns h's view (B, T, n * d), the same values as the cat of its streams without the copy (the cat
        read and wrote every stream once forward and its backward stacked the gradients again: 4 (B, T, d) passes a
        layer at n = 2, 8 at n = 4, each way); the last block fuses them as ``finish`` does."""
        if self.is_last:
            return self.finish(list(h.unbind(-2)))
        return h.flatten(-2)

    def skip(self, x: torch.Tensor) -> torch.Tensor:
        """This block with its sublayers removed (the depth probe): the streams pass through unchanged, widened
        where this block widens the state and fused where it fuses."""
        return self.finish(self.split_streams(x))


class AttnResStreams(StackedStreams):
    """The state of an AttnRes block (siamesenorm/variants/attnres.py), whatever the host framework: the completed
    sources and the partial block sum concatenated on the feature axis, (B, T, S * d), S growing with depth; the
    last block aggregates them with ``out_query`` / ``out_key_norm`` for the host's final norm. A host block sets
    ``first_sublayer`` (2 x its layer index), ``block_sublayers``, the queries and key norms (``attn_query`` and
    ``attn_key_norm`` absent in block 0, whose attention reads the embedding alone) and calls ``attn_res_forward``."""

    first_sublayer: int = 0
    block_sublayers: int = 1

    def build_attn_res(self, dim: int, new_norm: Callable[[], nn.Module], device=None) -> None:
        """The pseudo-queries (zero) and key norms: one pair a sublayer (none for block 0's attention, which reads
        the embedding alone), one more pair in the last block for the final aggregation; and ``n_streams``."""
        self.n_streams = self.sources_received()
        for prefix in (("ff",) if self.is_first else ("attn", "ff")) + (("out",) if self.is_last else ()):
            setattr(self, prefix + "_query", nn.Parameter(torch.zeros(dim, device=device)))
            setattr(self, prefix + "_key_norm", new_norm())

    def zero_queries(self) -> None:
        for name in ("attn_query", "ff_query", "out_query"):
            if hasattr(self, name):
                nn.init.zeros_(getattr(self, name))

    def sources_received(self) -> int:
        """How many (B, T, d) sources the state this block receives holds: its ``n_streams``, which the cost and
        memory models read as the block's input width (it grows with depth: 1 + 2l in Full AttnRes)."""
        n, partial = attn_res_sources_at(self.first_sublayer, self.block_sublayers)
        return n + int(partial)

    def sources(self, x: torch.Tensor) -> Tuple[List[torch.Tensor], Optional[torch.Tensor]]:
        """(completed sources, partial sum or None) from the state this block receives."""
        n, partial = attn_res_sources_at(self.first_sublayer, self.block_sublayers)
        parts = [x] if self.is_first else list(x.chunk(n + int(partial), dim=-1))
        return parts[:n], (parts[n] if partial else None)

    def attn_res_forward(self, x: torch.Tensor, branches: Sequence[Branch], pre_norms: Sequence[Norm],
                         run: Run = _direct) -> torch.Tensor:
        """The block: its two sublayers over the sources of ``x`` read in place (a (B, T, S, d) view), then the
        state it passes on, ``x`` with the block's outputs after it (one copy of the state a block)."""
        n, partial = attn_res_sources_at(self.first_sublayer, self.block_sublayers)
        held, more = x.unsqueeze(-2) if self.is_first else x.unflatten(-1, (n + int(partial), -1)), []
        for j, (branch, pre_norm, name) in enumerate(zip(branches, pre_norms, ("attn", "ff"))):
            held, more, partial = attn_res_sublayer(
                held, more, partial, self.first_sublayer + j, self.block_sublayers, branch, pre_norm=pre_norm,
                query=getattr(self, name + "_query", None), key_norm=getattr(self, name + "_key_norm", None), run=run)
        return self.finish_sources(held, more, run)

    def finish_sources(self, held: torch.Tensor, more: List[torch.Tensor], run: Run = _direct) -> torch.Tensor:
        """End of a block: the sources concatenated on the feature axis, or, in the last block, aggregated with
        ``out_query`` / ``out_key_norm`` through ``run`` (recomputed under ``recompute_cheap``, as it always was:
        once a model, where the sublayers' reads are not)."""
        if not self.is_last:
            return torch.cat([held.flatten(-2)] + more, dim=-1)

        def aggregate(*tensors):
            return depth_attention(tensors[0], self.out_query, self.out_key_norm, tensors[1:])

        out = run(aggregate, held, *more)
        if self._captured is not None:
            self._captured.append([out.detach()])
        return out

    def finish(self, streams: List[torch.Tensor]) -> torch.Tensor:
        """``finish_sources`` for sources given as a list (``StackedStreams``' contract)."""
        return self.finish_sources(torch.stack(streams, dim=-2), [])

    def state_streams(self, x: torch.Tensor) -> List[torch.Tensor]:
        """The analyses' view of the state this block receives (hidden magnitudes, massive activations): the sum
        of its sources, what Pre-Norm's residual stream would hold; one stream."""
        completed, partial = self.sources(x)
        return [sum(completed[1:] + ([partial] if partial is not None else []), completed[0])]


def depth_connection(carried: torch.Tensor, weights: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The depth connection of hc and mhc: (..., n, d) carried streams + (..., n) weights x (..., d) output F."""
    return carried + weights.unsqueeze(-1) * out.unsqueeze(-2)


def _rms_project(x: torch.Tensor, norm: nn.Module, proj: torch.Tensor) -> torch.Tensor:
    """RMSNorm(x) @ proj computed as (x @ (w proj)) * rstd(x), fp32 out, as one op each way (siamesenorm/nn/fused.py
    ``rms_project``): x read once in its own dtype for both the product (accumulated in fp32 against the fp32
    w proj) and rstd, so that neither the normalised copy of x nor an fp32 copy of it is ever written (the fused
    connections' coefficients; ``norm`` an RMSNorm without bias, its weight w and eps read from it)."""
    weight, eps = getattr(norm, "weight", None), getattr(norm, "eps", None)
    eps = torch.finfo(torch.float32).eps if eps is None else eps  # nn.RMSNorm's default
    wp = proj.float() if weight is None else weight.float()[:, None] * proj.float()
    return rms_project(x, wp, eps)


def _mix_streams(h: torch.Tensor, m: torch.Tensor, layout: str) -> torch.Tensor:
    """Weighted sums of the streams h (..., n, d): sum_s m[.., s, ..] h[..., s, :], the weights m laid out as
    ``layout`` says: "s" (..., n) -> (..., d); "js" (..., k, n) or "sj" (..., n, k) -> (..., k, d).

    Eager one batched product (a bmm: H read once, the sums written once); compiled, the broadcast product and its
    sum, which inductor fuses into one kernel with its neighbours where the bmm would stay an extern kernel of its
    own (and its backward two more). The broadcast follows m's layout because inductor's fusion does: with mHC's
    "js" weights transposed to "sj" (or its branch input's "s" given a k of 1), its compiled backward with recompute
    off moved about 1 GB more a layer; hc's "sj" as "js" cost two kernels more.

    Eager "s" is the product H^T m, (d, n) @ (n, 1) a token, rather than m^T H, (1, n) @ (n, d): the same sums, but
    the weights' gradient is then H g, (n, d) @ (d, 1), a matrix-vector product, where as g H^T, (1, d) @ (d, n), it
    went to a tensor-core kernel of 32 x 32 tiles for 1 x n outputs (on an H100: 1.25 ms a call at 8,192 tokens of
    d 2048, 10 ms of a 4-layer step; results/gpu/h100-2026-11-27)."""
    if torch.compiler.is_compiling():
        hs = {"s": h, "js": h.unsqueeze(-3), "sj": h.unsqueeze(-2)}[layout]
        return (m.unsqueeze(-1) * hs).sum(layout.index("s") - len(layout) - 1)
    if layout == "s":
        return (h.transpose(-1, -2) @ m.unsqueeze(-1)).squeeze(-1)
    return torch.einsum(f"...{layout},...sd->...{layout.replace('s', '')}d", m, h)


def _fusable_norm(norm: nn.Module, name: str) -> None:
    if isinstance(norm, nn.LayerNorm) or getattr(norm, "bias", None) is not None:
        raise ValueError(f"the fused {name} connection needs an RMSNorm without bias as its norm")


class _Connection(nn.Module):
    """What hc's and mHC's connections share: ``width(H)`` -> (branch input, carried, weights), then
    ``depth(H, carried, weights, F)`` -> the new streams. Unfused, ``carried`` is the mixed streams (..., n, d) and
    the depth connection adds weights x F to them; ``fused`` (``model.fused_streams``), ``carried`` is the mixing
    matrix m (..., n, n) (mhc's in fp32) and one op mixes and adds, out_j = sum_s m[j, s] h_s + weights_j F in fp32
    (siamesenorm/nn/fused.py ``stream_mix``: the mixed streams are never written)."""

    fused: bool = False
    #: Whether ``stream_mix`` also mixes under ``torch.compile``, or gives way to plain arithmetic that inductor fuses
    #: into its neighbours; chosen per connection by the cost model's compiled count (the 1.3B recipe, fused,
    #: recompute on): hc with the op 215.6 + 440.7 MB forward + backward against 211.3 + 453.2 without it (a middle
    #: block at 256 tokens); mhc, since its width connection is one op (``mhc_width``), 15.4 GB a layer with the op
    #: against 15.7 without it at the recipe's 16,384 tokens (before that op, 240.4 + 510.8 MB against 232.1 + 515.0
    #: at 256 tokens: then the op was off for mhc).
    MIX_IN_OP_COMPILED = True

    @property
    def mixes_in_op(self) -> bool:
        """Whether ``stream_mix`` mixes: fused, and under ``torch.compile`` only where MIX_IN_OP_COMPILED says."""
        return self.fused and (self.MIX_IN_OP_COMPILED or not torch.compiler.is_compiling())

    def depth(self, h: torch.Tensor, carried: torch.Tensor, weights: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.mixes_in_op:
            return stream_mix(h, carried, weights, out)
        return depth_connection(carried, weights, out)


class HyperConnection(_Connection):
    """The width connection of dynamic Hyper-Connections (Zhu et al., arXiv 2409.19606) around one sublayer, for n
    streams H (B, ..., n, d); ``width(H)`` gives (branch input, carried streams, B), ``depth`` the rest:

        A(H) = A_s + s_a * tanh(norm(H) W_a)    A_s = [e_(layer mod n) | I_n], W_a = 0, s_a = 0.01
        B(H) = B_s + s_b * tanh(norm(H) w_b)    B_s = 1,                        w_b = 0, s_b = 0.01
        input = sum_s A[s, 0] h_s;   h_j <- sum_s A[s, 1+j] h_s + B_j * F(input)

    ``weight_decay_params`` names the parameters that take weight decay (the HC paper's section 4: the dynamic
    projections, with ``decay_dynamic``); the static weights and the scales take none. ``fused``
    (``model.fused_streams``; the norm an RMSNorm without bias): the mixing and the depth connection as one op
    (``_Connection``; ``width`` then gives the matrix m[j, s] = A[s, 1+j]), and both dynamic projections as one
    product with the norm's division after it, norm(H) [W_a | w_b] = (H @ (w [W_a | w_b])) * rstd(H), one op each
    way (siamesenorm/nn/fused.py ``rms_project``: H read in its own dtype, accumulated in fp32), so the normalised
    streams are never written; with the branch's Pre-Norm (``width_normed``, what the blocks call when fused and
    dynamic), the projection, the input and its norm as one op each way (``hc_width``).
    """

    def __init__(self, n: int, dim: int, layer: int = 0, norm: NormFactory = nn.LayerNorm, dynamic: bool = True,
                 scale_init: float = 0.01, decay_dynamic: bool = True, device=None, fused: bool = False):
        super().__init__()
        self.n, self.read_stream, self.dynamic, self.scale_init = n, layer % n, dynamic, scale_init
        self.fused = fused
        self.static_alpha = nn.Parameter(torch.empty(n, 1 + n, device=device))
        self.static_beta = nn.Parameter(torch.empty(n, device=device))
        self.weight_decay_params: Tuple[str, ...] = ()
        if dynamic:
            self.norm = norm(dim)
            self.dynamic_alpha_fn = nn.Parameter(torch.empty(dim, 1 + n, device=device))
            self.dynamic_alpha_scale = nn.Parameter(torch.empty(1, device=device))
            self.dynamic_beta_fn = nn.Parameter(torch.empty(dim, device=device))
            self.dynamic_beta_scale = nn.Parameter(torch.empty(1, device=device))
            if decay_dynamic:
                self.weight_decay_params = ("dynamic_alpha_fn", "dynamic_beta_fn")
            if fused:
                _fusable_norm(self.norm, "hc")
        self.reset_parameters()

    def reset_parameters(self):
        with torch.no_grad():
            self.static_alpha.zero_()
            self.static_alpha[self.read_stream, 0] = 1.0
            self.static_alpha[:, 1:] = torch.eye(self.n, device=self.static_alpha.device)
            self.static_beta.fill_(1.0)
            if self.dynamic:
                self.norm.reset_parameters()
                self.dynamic_alpha_fn.zero_()
                self.dynamic_beta_fn.zero_()
                self.dynamic_alpha_scale.fill_(self.scale_init)
                self.dynamic_beta_scale.fill_(self.scale_init)

    @property
    def normalizes_input(self) -> bool:
        """Whether ``width_normed`` gives the branch its normalised input in one op (fused, dynamic, mixing in the
        op): then the caller's Pre-Norm is that op's."""
        return self.fused and self.dynamic and self.mixes_in_op

    def width_normed(self, h: torch.Tensor, in_weight: Optional[torch.Tensor], in_eps: float
                     ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``width`` with the branch's Pre-Norm, an RMSNorm of weight ``in_weight`` (or none) and ``in_eps``, applied
        to the branch input, as one op each way (siamesenorm/nn/fused.py ``hc_width``): the streams read once for the
        coefficients' logits, the input and its norm; the normalised input written once, in h's dtype (the input
        coefficients stay fp32, where ``width`` rounds them to h's dtype before the sum). Returns (normalised input,
        m (..., n, n) fp32, B (..., n) fp32, h's copy), the copy for ``depth`` to read in h's place (then h has one
        consumer, the op, which adds the depth's gradient into dh itself); ``normalizes_input`` says when it
        applies."""
        weight, eps = getattr(self.norm, "weight", None), getattr(self.norm, "eps", None)
        eps = torch.finfo(torch.float32).eps if eps is None else eps  # nn.RMSNorm's default
        proj = torch.cat([self.dynamic_alpha_fn, self.dynamic_beta_fn[:, None]], dim=-1)  # (d, 1 + n + 1)
        logits, inp, copy = hc_width(h, proj, self.static_alpha[:, 0], self.dynamic_alpha_scale, in_weight,
                                     proj_weight=weight, eps=eps, in_eps=in_eps)
        alpha = self.static_alpha[:, 1:] + self.dynamic_alpha_scale * torch.tanh(logits[..., 1:-1])
        beta = self.static_beta + self.dynamic_beta_scale * torch.tanh(logits[..., -1])
        return inp, alpha.transpose(-1, -2), beta, copy

    def width(self, h: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h: (..., n, d) -> branch input (..., d), carried streams (..., n, d), B (..., n); in h's dtype.
        Fused: the carried streams' place holds m (..., n, n), m[j, s] = A[s, 1+j]."""
        alpha, beta = self.static_alpha, self.static_beta
        if self.dynamic and self.fused:
            proj = torch.cat([self.dynamic_alpha_fn, self.dynamic_beta_fn[:, None]], dim=-1)  # (d, 1 + n + 1)
            logits = _rms_project(h, self.norm, proj)
            alpha = alpha + self.dynamic_alpha_scale * torch.tanh(logits[..., :-1])
            beta = beta + self.dynamic_beta_scale * torch.tanh(logits[..., -1])
        elif self.dynamic:
            normed = self.norm(h)
            alpha = alpha + self.dynamic_alpha_scale * torch.tanh(normed @ self.dynamic_alpha_fn.to(h.dtype))
            beta = beta + self.dynamic_beta_scale * torch.tanh(normed @ self.dynamic_beta_fn.to(h.dtype))
        else:
            alpha, beta = alpha.expand(*h.shape[:-1], 1 + self.n), beta.expand(*h.shape[:-1])
        if self.mixes_in_op:
            inp = _mix_streams(h, alpha[..., 0].to(h.dtype), "s")
            return inp, alpha[..., 1:].transpose(-1, -2), beta
        mixed = _mix_streams(h, alpha.to(h.dtype), "sj")  # (..., 1 + n, d)
        return mixed[..., 0, :], mixed[..., 1:, :], beta.to(h.dtype)


class HyperConnections(HyperConnection):
    """Dynamic Hyper-Connections around one sublayer F (``HyperConnection``'s rule):
    h_j <- sum_s A[s, 1+j] h_s + B_j * F(sum_s A[s, 0] h_s).

    ``branch`` gets the mixed input as is (put its Pre-Norm inside the branch, as the HC paper's transformer does).
    ``expand`` copies the embedding into n streams; ``reduce`` sums them.
    """

    def __init__(self, n: int, dim: int, branch: Branch, layer: int = 0, norm: NormFactory = nn.LayerNorm,
                 dynamic: bool = True, scale_init: float = 0.01, fused: bool = False):
        super().__init__(n, dim, layer=layer, norm=norm, dynamic=dynamic, scale_init=scale_init, fused=fused)
        self.branch = _branch_module(branch)

    expand = staticmethod(lambda x, n: expand_streams(x, n))

    @staticmethod
    def reduce(h: torch.Tensor) -> torch.Tensor:
        return h.sum(-2)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        inp, carried, beta = self.width(h)
        return self.depth(h, carried, beta, self.branch(inp))


class ManifoldHyperConnection(_Connection):
    """The width connection of mHC (Xie et al., arXiv 2512.24880, eqs. 7-9) around one sublayer, n streams
    H (B, ..., n, d); per token, with h~ = norm(flatten(H)) of size n*d:

        H_pre  = sigmoid(a_pre * h~ P_pre + b_pre)          H_post = 2 sigmoid(a_post * h~ P_post + b_post)
        H_res  = Sinkhorn(a_res * mat(h~ P_res) + b_res)    (doubly stochastic; fp32, autocast off)
        input  = sum_s H_pre[s] h_s;   h_j <- sum_s H_res[j, s] h_s + H_post[j] * F(input)

    Init (docs/fidelity.md): P = N(0, 1/(n d)), gates 0.01, b_pre = logit(1/n), b_post = 0, b_res = 0 (H_res uniform).

    ``fused`` (``model.fused_streams``; the norm an RMSNorm without bias): the same coefficients in fewer passes, as
    the mHC paper's kernels compute them: h~ P = (flatten(H) @ (w P)) * rstd, the norm's division after the product,
    one op each way (siamesenorm/nn/fused.py ``rms_project``: flatten(H) read once in its own dtype, neither the
    normalised (n d)-wide copy nor an fp32 one written; accumulated in fp32 against fp32 w P, TF32 products on a GPU
    for bf16 streams, where OLMo's norm rounds h~ to the streams' dtype before its scale), Sinkhorn as one op each
    way (siamesenorm/nn/fused.py ``sinkhorn``), and the mixing
    with the depth connection as one (``_Connection``; ``width`` then gives H_res in the carried streams' place);
    with the branch's Pre-Norm (``width_normed``, what the blocks call when fused), the projection, H_pre, the input
    and its norm as one op each way (``mhc_width``).
    """

    def __init__(self, n: int, dim: int, norm: NormFactory = nn.LayerNorm, iterations: int = 20,
                 order: str = "columns_first", gate_init: float = 0.01, device=None, fused: bool = False):
        super().__init__()
        if order not in SINKHORN_ORDERS:
            raise ValueError(f"Sinkhorn order {order!r} is unknown; use one of: {', '.join(SINKHORN_ORDERS)}.")
        self.n, self.iterations, self.order, self.gate_init = n, iterations, order, gate_init
        self.norm = norm(n * dim)
        if fused:
            _fusable_norm(self.norm, "mHC")
        self.fused = fused
        self.proj = nn.Parameter(torch.empty(n * dim, n * n + 2 * n, device=device))  # P_pre | P_post | P_res
        self.gates = nn.Parameter(torch.empty(3, device=device))  # a_pre, a_post, a_res
        self.bias_pre = nn.Parameter(torch.empty(n, device=device))
        self.bias_post = nn.Parameter(torch.empty(n, device=device))
        self.bias_res = nn.Parameter(torch.empty(n, n, device=device))
        self.reset_parameters()

    def reset_parameters(self):
        n = self.n
        self.norm.reset_parameters()
        with torch.no_grad():
            nn.init.normal_(self.proj, std=1.0 / math.sqrt(self.proj.shape[0]))
            self.gates.fill_(self.gate_init)
            self.bias_pre.fill_(-math.log(n - 1) if n > 1 else 0.0)  # logit(1/n)
            self.bias_post.zero_()
            self.bias_res.zero_()

    def coefficients(self, h: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h: (..., n, d) -> H_pre (..., n), H_post (..., n), H_res (..., n, n); all fp32."""
        n = self.n
        with torch.autocast(device_type=h.device.type, enabled=False):
            logits = _rms_project(h.flatten(-2), self.norm, self.proj) if self.fused \
                else self.norm(h.flatten(-2)).float() @ self.proj.float()
            g = self.gates.float()
            pre = torch.sigmoid(g[0] * logits[..., :n] + self.bias_pre.float())
            post = 2.0 * torch.sigmoid(g[1] * logits[..., n : 2 * n] + self.bias_post.float())
            res_logits = g[2] * logits[..., 2 * n :].unflatten(-1, (n, n)) + self.bias_res.float()
            res = fused_sinkhorn(res_logits, self.iterations, self.order == "columns_first") if self.fused \
                else sinkhorn(res_logits, self.iterations, self.order)
        return pre, post, res

    @property
    def normalizes_input(self) -> bool:
        """Whether ``width_normed`` gives the branch its normalised input in one op (fused)."""
        return self.fused

    def width_normed(self, h: torch.Tensor, in_weight: Optional[torch.Tensor], in_eps: float
                     ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``width`` with the branch's Pre-Norm (an RMSNorm of weight ``in_weight`` or none, ``in_eps``) applied to
        the branch input, the logits, H_pre, the input and its norm as one op each way (siamesenorm/nn/fused.py
        ``mhc_width``: the flattened streams read once, the normalised input written once; H_pre stays fp32 where
        ``width`` rounds it to h's dtype before the sum); H_post and H_res from the other logits as ``coefficients``
        computes them, and h's copy for ``depth`` (as hc's ``width_normed``)."""
        n = self.n
        weight, eps = getattr(self.norm, "weight", None), getattr(self.norm, "eps", None)
        eps = torch.finfo(torch.float32).eps if eps is None else eps  # nn.RMSNorm's default
        with torch.autocast(device_type=h.device.type, enabled=False):
            g = self.gates.float()
            logits, inp, copy = mhc_width(h, self.proj, self.bias_pre, g[0], in_weight, proj_weight=weight, eps=eps,
                                          in_eps=in_eps)
            post = 2.0 * torch.sigmoid(g[1] * logits[..., n : 2 * n] + self.bias_post.float())
            res_logits = g[2] * logits[..., 2 * n :].unflatten(-1, (n, n)) + self.bias_res.float()
            res = fused_sinkhorn(res_logits, self.iterations, self.order == "columns_first")
        if self.mixes_in_op:
            return inp, res, post, copy
        return inp, _mix_streams(copy, res.to(h.dtype), "js"), post.to(h.dtype), copy

    def width(self, h: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> branch input (..., d), mixed streams H_res H (..., n, d), H_post (..., n), in h's dtype; fused:
        H_res (..., n, n) and H_post in fp32 (the op mixes)."""
        pre, post, res = self.coefficients(h)
        inp = _mix_streams(h, pre.to(h.dtype), "s")
        if self.mixes_in_op:
            return inp, res, post
        mixed = _mix_streams(h, res.to(h.dtype), "js")
        return inp, mixed, post.to(h.dtype)


class ManifoldHyperConnections(ManifoldHyperConnection):
    """mHC around one sublayer F (``ManifoldHyperConnection``'s rule): h_j <- sum_s H_res[j, s] h_s + H_post[j] F(input).
    ``reduce`` is the mean of the streams."""

    def __init__(self, n: int, dim: int, branch: Branch, norm: NormFactory = nn.LayerNorm, iterations: int = 20,
                 order: str = "columns_first", gate_init: float = 0.01, fused: bool = False):
        super().__init__(n, dim, norm=norm, iterations=iterations, order=order, gate_init=gate_init, fused=fused)
        self.branch = _branch_module(branch)

    expand = staticmethod(lambda x, n: expand_streams(x, n))

    @staticmethod
    def reduce(h: torch.Tensor) -> torch.Tensor:
        return h.mean(-2)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        inp, carried, post = self.width(h)
        return self.depth(h, carried, post, self.branch(inp))
