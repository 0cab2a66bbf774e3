"""Residual topologies around one sublayer F, in plain PyTorch (torch only).

A wrapper is built once per sublayer, ``Topology(dim, branch, ...)``, and maps the topology's state to the new
state: a tensor (B, ..., d) for the single-stream ones, a pair (X, Y) for SiameseNorm, (B, ..., n, d) for the
hyper-connections. ``expand`` turns the embedding into the state, ``reduce`` (or SiameseFusion) the state back
into one tensor for the host's final norm and head.
"""

from __future__ import annotations

import math
from typing import Callable, Tuple

import torch
import torch.nn as nn

__all__ = ["PreNorm", "PostNorm", "HybridNorm", "SiameseNorm", "SiameseFusion", "HyperConnections",
           "ManifoldHyperConnections", "depth_divisor", "sinkhorn", "expand_streams"]

Branch = Callable[[torch.Tensor], torch.Tensor]
NormFactory = Callable[[int], nn.Module]
NORM_POSITIONS = ("after_addition", "before_sublayer")


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
    """Post-Norm, two placements of the norm:

        "after_addition"  (paper eq. 2):             x <- LN(x + F(x))
        "before_sublayer" (the HybridNorm OLMo fork): x <- LN(x);  x <- x + F(x)
    """

    def __init__(self, dim: int, branch: Branch, norm: NormFactory = nn.LayerNorm, position: str = "after_addition"):
        super().__init__()
        self.branch, self.norm, self.position = _branch_module(branch), norm(dim), _check_position(position)

    expand = staticmethod(lambda x: x)
    reduce = staticmethod(lambda x: x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.position == "before_sublayer":
            x = self.norm(x)
            return x + self.branch(x)
        return self.norm(x + self.branch(x))


class HybridNorm(nn.Module):
    """HybridNorm's stream (Zhuo et al., 2025). The attention sublayer has no input norm (its Q/K/V norms belong to
    the host's attention module) and a plain residual; the MLP sublayer normalises the stream and keeps the
    normalised value as its residual:

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
        if self.norm is not None:
            x = self.norm(x)
        return x + self.branch(x)


# ---- SiameseNorm ---------------------------------------------------------------------------------------------------
def depth_divisor(layer: int, form: str = "inv_sqrt_2layer") -> float:
    """c(l) for 0-based layer l: sqrt(2(l+1)) (the official code, default) or sqrt(l+1) (the paper's text)."""
    if form == "inv_sqrt_2layer":
        return math.sqrt(2 * (layer + 1))
    if form == "inv_sqrt_layer":
        return math.sqrt(layer + 1)
    raise ValueError(f"depth scaling form {form!r} is unknown; use inv_sqrt_2layer or inv_sqrt_layer.")


class SiameseNorm(nn.Module):
    """SiameseNorm around one sublayer: two streams share F. X is bounded, Y is Pre-Norm-like; c = c(layer)
    (``depth_divisor``; 1 with ``depth_scaling=False``); LN^in only with ``normalized_input``.

    bounded="post" (post_pre), per sublayer, LN^X where ``x_norm_position`` says:
        "before_sublayer" (default; the official DeiT/DiT Block):  X = LN^X(X); H = LN^in(X + LN^Y(Y))
                                                                  O = F(H); X = X + O / c; Y = Y + O
        "after_addition"  (the paper's section-3 text):            H = LN^in(X + LN^Y(Y)); O = F(H)
                                                                  X = LN^X(X + O / c); Y = Y + O
    bounded="hybrid" (hybrid_pre, the paper's main model; official OLMo_model_hybrid_pre.py):
        attention: H = gamma * X + LN^Y(Y); R = Attn(H); X = LN^X(X + R / c); Y = Y + R   (gamma: a learned vector, 1)
        mlp:       M = LN^in(X + LN^Y(Y));  O = MLP(M);  X = X + O / c;      Y = Y + O

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
        if self.gamma is not None:  # hybrid, attention
            o = self.branch(self.gamma.to(x.dtype) * x + self.y_norm(y))
            return self.x_norm(x + o / self.c), y + o
        before = self.bounded == "post" and self.x_norm_position == "before_sublayer"
        if before:
            x = self.x_norm(x)
        h = x + self.y_norm(y)
        o = self.branch(self.in_norm(h) if self.in_norm is not None else h)
        x = x + o / self.c
        if self.bounded == "post" and not before:
            x = self.x_norm(x)
        return x, y + o


class SiameseFusion(nn.Module):
    """The end of SiameseNorm: LN^out_X(X) + LN^out_Y(Y); the host's final norm follows. The two norms' scales
    are the fusion weights (paper section 5.2)."""

    def __init__(self, dim: int, norm: NormFactory = nn.LayerNorm):
        super().__init__()
        self.x_norm, self.y_norm = norm(dim), norm(dim)

    def forward(self, state: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = state
        return self.x_norm(x) + self.y_norm(y)


# ---- hyper-connections ----------------------------------------------------------------------------------------------
class HyperConnections(nn.Module):
    """Dynamic Hyper-Connections (Zhu et al., arXiv 2409.19606) around one sublayer, n streams H (B, ..., n, d):

        A(H) = A_s + s_a * tanh(norm(H) W_a)    A_s = [e_(layer mod n) | I_n], W_a = 0, s_a = 0.01
        B(H) = B_s + s_b * tanh(norm(H) w_b)    B_s = 1,                        w_b = 0, s_b = 0.01
        input = sum_s A[s, 0] h_s;   h_j <- sum_s A[s, 1+j] h_s + B_j * F(input)

    ``branch`` gets the mixed input as is (put its Pre-Norm inside the branch, as the HC paper's transformer does).
    ``expand`` copies the embedding into n streams; ``reduce`` sums them.
    """

    def __init__(self, n: int, dim: int, branch: Branch, layer: int = 0, norm: NormFactory = nn.LayerNorm,
                 dynamic: bool = True, scale_init: float = 0.01):
        super().__init__()
        self.n, self.branch, self.dynamic = n, _branch_module(branch), dynamic
        static_alpha = torch.zeros(n, 1 + n)
        static_alpha[layer % n, 0] = 1.0
        static_alpha[:, 1:] = torch.eye(n)
        self.static_alpha = nn.Parameter(static_alpha)
        self.static_beta = nn.Parameter(torch.ones(n))
        if dynamic:
            self.norm = norm(dim)
            self.dynamic_alpha_fn = nn.Parameter(torch.zeros(dim, 1 + n))
            self.dynamic_alpha_scale = nn.Parameter(torch.full((1,), scale_init))
            self.dynamic_beta_fn = nn.Parameter(torch.zeros(dim))
            self.dynamic_beta_scale = nn.Parameter(torch.full((1,), scale_init))

    expand = staticmethod(lambda x, n: expand_streams(x, n))

    @staticmethod
    def reduce(h: torch.Tensor) -> torch.Tensor:
        return h.sum(-2)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        alpha, beta = self.static_alpha, self.static_beta
        if self.dynamic:
            normed = self.norm(h)
            alpha = alpha + self.dynamic_alpha_scale * torch.tanh(normed @ self.dynamic_alpha_fn.to(h.dtype))
            beta = beta + self.dynamic_beta_scale * torch.tanh(normed @ self.dynamic_beta_fn.to(h.dtype))
        else:
            alpha, beta = alpha.expand(*h.shape[:-1], 1 + self.n), beta.expand(*h.shape[:-1])
        mixed = torch.einsum("...sd,...sk->...kd", h, alpha.to(h.dtype))  # (..., 1 + n, d)
        out = self.branch(mixed[..., 0, :])
        return mixed[..., 1:, :] + beta.to(h.dtype).unsqueeze(-1) * out.unsqueeze(-2)


def expand_streams(x: torch.Tensor, n: int) -> torch.Tensor:
    """(..., d) -> (..., n, d): the embedding copied into n streams (a view, no copy)."""
    return x.unsqueeze(-2).expand(*x.shape[:-1], n, x.shape[-1])


def sinkhorn(logits: torch.Tensor, iterations: int, order: str = "columns_first") -> torch.Tensor:
    """A doubly stochastic matrix from (..., n, n) logits: Sinkhorn-Knopp on exp(logits), log domain, fp32.

    "columns_first" (the mHC paper's T_r(T_c(M)) per iteration): columns are normalised, then rows, so rows sum
    to 1 exactly and columns to within the iteration's tolerance. "rows_first" is the transpose of that order
    (columns end exact)."""
    first, second = (-2, -1) if order == "columns_first" else (-1, -2)
    log_p = logits.float()
    for _ in range(iterations):
        log_p = log_p - log_p.logsumexp(dim=first, keepdim=True)
        log_p = log_p - log_p.logsumexp(dim=second, keepdim=True)
    return log_p.exp()


class ManifoldHyperConnections(nn.Module):
    """mHC (Xie et al., arXiv 2512.24880, eqs. 7-9) around one sublayer, n streams H (B, ..., n, d); per token,
    with h~ = RMS-style norm(flatten(H)) of size n*d:

        H_pre  = sigmoid(a_pre * h~ P_pre + b_pre)          H_post = 2 sigmoid(a_post * h~ P_post + b_post)
        H_res  = Sinkhorn(a_res * mat(h~ P_res) + b_res)    (doubly stochastic; fp32)
        input  = sum_s H_pre[s] h_s;   h_j <- sum_s H_res[j, s] h_s + H_post[j] * F(input)

    Init as siamesenorm/topologies/mhc.py documents: P = N(0, 1/(n d)), gates 0.01, b_pre = logit(1/n), b_post = 0,
    b_res = 0 (H_res uniform). ``reduce`` is the mean of the streams.
    """

    def __init__(self, n: int, dim: int, branch: Branch, norm: NormFactory = nn.LayerNorm, iterations: int = 20,
                 order: str = "columns_first", gate_init: float = 0.01):
        super().__init__()
        self.n, self.branch, self.iterations, self.order = n, _branch_module(branch), iterations, order
        self.norm = norm(n * dim)
        self.proj = nn.Parameter(torch.randn(n * dim, n * n + 2 * n) / math.sqrt(n * dim))
        self.gates = nn.Parameter(torch.full((3,), gate_init))
        self.bias_pre = nn.Parameter(torch.full((n,), -math.log(n - 1) if n > 1 else 0.0))
        self.bias_post = nn.Parameter(torch.zeros(n))
        self.bias_res = nn.Parameter(torch.zeros(n, n))

    expand = staticmethod(lambda x, n: expand_streams(x, n))

    @staticmethod
    def reduce(h: torch.Tensor) -> torch.Tensor:
        return h.mean(-2)

    def coefficients(self, h: torch.Tensor):
        n = self.n
        with torch.autocast(device_type=h.device.type, enabled=False):
            logits = self.norm(h.flatten(-2)).float() @ self.proj.float()
            g = self.gates.float()
            pre = torch.sigmoid(g[0] * logits[..., :n] + self.bias_pre.float())
            post = 2.0 * torch.sigmoid(g[1] * logits[..., n : 2 * n] + self.bias_post.float())
            res = sinkhorn(g[2] * logits[..., 2 * n :].unflatten(-1, (n, n)) + self.bias_res.float(),
                           self.iterations, self.order)
        return pre, post, res

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        pre, post, res = self.coefficients(h)
        inp = torch.einsum("...sd,...s->...d", h, pre.to(h.dtype))
        mixed = torch.einsum("...js,...sd->...jd", res.to(h.dtype), h)
        return mixed + post.to(h.dtype).unsqueeze(-1) * self.branch(inp).unsqueeze(-2)
