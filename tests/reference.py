"""Each variant's equations written out with plain torch ops, reading the weights of a built model.

Independent of siamesenorm's blocks: the tests compare the blocks against these. RMSNorm models only.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def rms(x, weight, eps):
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x if weight is None else x * weight


def rope(t, theta=10_000):
    """OLMo's RoPE convention (rotate_half over the two halves of head_dim); t: (B, heads, T, hd)."""
    hd, T = t.shape[-1], t.shape[-2]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))
    ang = torch.einsum("i,j->ij", torch.arange(T, dtype=torch.float), inv)
    pos = torch.cat((ang, ang), dim=-1)
    x1, x2 = t.chunk(2, dim=-1)
    return t * pos.cos() + torch.cat((-x2, x1), dim=-1) * pos.sin()


class Ref:
    def __init__(self, model, t=None):
        self.m, self.c = model, model.config
        self.t = t  # prores: the optimizer steps taken
        self.eps = self.c.layer_norm_eps
        self.p = dict(model.named_parameters())

    def w(self, name):
        p = self.p.get(name + ".weight")
        return p

    def norm(self, name, x):
        return rms(x, self.w(name), self.eps)

    def attn(self, i, h, head_norms=False, norm_then_rope=True):
        c, b = self.c, f"transformer.blocks.{i}."
        B, T, d = h.shape
        nh, hd = c.n_heads, d // c.n_heads
        q, k, v = (h @ self.p[b + "att_proj.weight"].T).split([d, d, d], dim=-1)
        q, k, v = (t.view(B, T, nh, hd).transpose(1, 2) for t in (q, k, v))
        if head_norms and norm_then_rope:
            q, k, v = (self.norm(b + n, t) for n, t in (("q_head_norm", q), ("k_head_norm", k), ("v_head_norm", v)))
        q, k = rope(q), rope(k)
        if head_norms and not norm_then_rope:
            q, k, v = (self.norm(b + n, t) for n, t in (("q_head_norm", q), ("k_head_norm", k), ("v_head_norm", v)))
        a = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        a = a.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        out = (a @ v).transpose(1, 2).reshape(B, T, d)
        return out @ self.p[b + "attn_out.weight"].T

    def mlp(self, i, h):
        b = f"transformer.blocks.{i}."
        x, gate = (h @ self.p[b + "ff_proj.weight"].T).chunk(2, dim=-1)
        return (F.silu(gate) * x) @ self.p[b + "ff_out.weight"].T

    def logits(self, x):
        x = self.norm("transformer.ln_f", x)
        return x @ self.p["transformer.wte.weight"].T

    def embed(self, ids):
        return self.p["transformer.wte.weight"][ids]

    def depth_scale(self, i):
        if not self.c.siamese_depth_scaling:
            return 1.0
        return math.sqrt(i + 1) if self.c.siamese_depth_scaling_form == "inv_sqrt_layer" else math.sqrt(2 * (i + 1))

    # ---- the variants --------------------------------------------------------------------------------------
    def pre(self, ids, x=None):
        x = self.embed(ids) if x is None else x
        for i in range(self.c.n_layers):
            b = f"transformer.blocks.{i}."
            x = x + self.attn(i, self.norm(b + "attn_norm", x))
            x = x + self.mlp(i, self.norm(b + "ff_norm", x))
        return self.logits(x)

    def post(self, ids):
        x = self.embed(ids)
        before = self.c.post_norm_position == "before_sublayer"  # the HybridNorm fork: x = LN(x); x = x + F(x)
        for i in range(self.c.n_layers):
            b = f"transformer.blocks.{i}."
            for sub, fn in (("attn", self.attn), ("ff", self.mlp)):
                if before:
                    x = self.norm(b + sub + "_norm", x)
                    x = x + fn(i, x)
                else:
                    x = self.norm(b + sub + "_norm", x + fn(i, x))
        return self.logits(x)

    def hybrid(self, ids, norm_then_rope=True):
        x = self.embed(ids)
        for i in range(self.c.n_layers):
            b = f"transformer.blocks.{i}."
            u = self.norm(b + "ff_norm", x + self.attn(i, x, head_norms=True, norm_then_rope=norm_then_rope))
            x = u + self.mlp(i, u)
        return self.logits(x)

    def mix(self, prefix, X, Y):
        """SiameseNorm's stream mixing where the block has one: H = [[p, 1-p], [1-p, p]], p = sigmoid(z)."""
        if prefix + "bias" not in self.p:
            return X, Y, False
        z = self.p[prefix + "bias"]
        if prefix + "proj" in self.p:  # dynamic: z + gate * (RMSNorm([X, Y]) . phi), per token
            z = z + self.p[prefix + "gate"] * (self.norm(prefix + "norm", torch.cat([X, Y], -1)) @ self.p[prefix + "proj"])[..., None]
        p = torch.sigmoid(z)
        return p * X + (1 - p) * Y, (1 - p) * X + p * Y, True

    def post_pre(self, ids):
        X = Y = self.embed(ids)
        ni = self.c.siamese_normalized_input
        last = self.c.n_layers - 1
        before = self.c.post_pre_x_norm_position == "before_sublayer"  # the official DeiT/DiT Block
        for i in range(self.c.n_layers):
            b, cl = f"transformer.blocks.{i}.", self.depth_scale(i)
            for sub, fn in (("attn", self.attn), ("ff", self.mlp)):
                X, Y, mixed = self.mix(b + sub + "_mix.", X, Y)
                if mixed and not before:
                    X = self.norm(b + sub + "_mix_norm_x", X)
                if before:
                    X = self.norm(b + sub + "_norm_x", X)
                H = X + self.norm(b + sub + "_norm_y", Y)
                O = fn(i, self.norm(b + sub + "_norm", H) if ni else H)
                X = X + O / cl
                if not before:
                    X = self.norm(b + sub + "_norm_x", X)
                Y = Y + O
        b = f"transformer.blocks.{last}."
        return self.logits(self.norm(b + "out_norm_x", X) + self.norm(b + "out_norm_y", Y))

    def hybrid_pre(self, ids):
        X = Y = self.embed(ids)
        last = self.c.n_layers - 1
        for i in range(self.c.n_layers):
            b, cl = f"transformer.blocks.{i}.", self.depth_scale(i)
            X, Y, mixed = self.mix(b + "attn_mix.", X, Y)
            if mixed:
                X = self.norm(b + "attn_mix_norm_x", X)
            h = self.p[b + "gamma"] * X + self.norm(b + "attn_norm_y", Y)
            r = self.attn(i, h, head_norms=True)
            X = X + r / cl
            Y = Y + r
            X, Y, _ = self.mix(b + "ff_mix.", X, Y)
            X = self.norm(b + "attn_norm_x", X)
            M = X + self.norm(b + "ff_norm_y", Y)
            if self.c.siamese_normalized_input:
                M = self.norm(b + "ff_norm", M)
            o = self.mlp(i, M)
            Y = Y + o
            X = X + o / cl
        b = f"transformer.blocks.{last}."
        return self.logits(self.norm(b + "out_norm_x", X) + self.norm(b + "out_norm_y", Y))

    def hc(self, ids):
        n = self.c.hc_expansion_rate
        e = self.embed(ids)
        streams = [e.clone() for _ in range(n)]
        for i in range(self.c.n_layers):
            b = f"transformer.blocks.{i}."
            for sub, fn in (("attn", self.attn), ("ff", self.mlp)):
                hc = b + sub + "_hc."
                A_s, B_s = self.p[hc + "static_alpha"], self.p[hc + "static_beta"]
                Wa, wb = self.p[hc + "dynamic_alpha_fn"], self.p[hc + "dynamic_beta_fn"]
                sa, sb = self.p[hc + "dynamic_alpha_scale"], self.p[hc + "dynamic_beta_scale"]
                normed = [self.norm(hc + "norm", h) for h in streams]
                # A[s, k] and B[j] per token
                A = [[A_s[s, k] + sa * torch.tanh(normed[s] @ Wa[:, k]) for k in range(n + 1)] for s in range(n)]
                Bt = [B_s[j] + sb * torch.tanh(normed[j] @ wb) for j in range(n)]
                inp = sum(A[s][0].unsqueeze(-1) * streams[s] for s in range(n))
                out = fn(i, self.norm(b + sub + "_norm", inp))
                streams = [
                    sum(A[s][1 + j].unsqueeze(-1) * streams[s] for s in range(n)) + Bt[j].unsqueeze(-1) * out
                    for j in range(n)
                ]
        return self.logits(sum(streams))

    def deepnorm(self, ids):
        N = self.c.n_layers
        alpha = (2 * N) ** 0.25
        x = self.embed(ids)
        for i in range(N):
            b = f"transformer.blocks.{i}."
            x = self.norm(b + "attn_norm", alpha * x + self.attn(i, x))
            x = self.norm(b + "ff_norm", alpha * x + self.mlp(i, x))
        return self.logits(x)

    def residual(self, ids):
        x = d = self.embed(ids)
        for i in range(self.c.n_layers):
            b = f"transformer.blocks.{i}."
            for sub, fn in (("attn", self.attn), ("ff", self.mlp)):
                o = fn(i, x)
                x = self.norm(b + sub + "_norm", x + o)
                d = d + o
        b = f"transformer.blocks.{self.c.n_layers - 1}."
        return self.logits(x + self.norm(b + "out_norm_dual", d))

    def mixln(self, ids):
        n_post = int(self.c.mixln_post_fraction * self.c.n_layers + 1e-9)
        x = self.embed(ids)
        for i in range(self.c.n_layers):
            b = f"transformer.blocks.{i}."
            for sub, fn in (("attn", self.attn), ("ff", self.mlp)):
                if i < n_post:
                    x = self.norm(b + sub + "_norm", x + fn(i, x))
                else:
                    x = x + fn(i, self.norm(b + sub + "_norm", x))
        return self.logits(x)

    def peri(self, ids):
        x = self.norm("transformer.blocks.0.emb_norm", self.embed(ids))
        for i in range(self.c.n_layers):
            b = f"transformer.blocks.{i}."
            for sub, fn in (("attn", self.attn), ("ff", self.mlp)):
                x = x + self.norm(b + sub + "_out_norm", fn(i, self.norm(b + sub + "_norm", x)))
        return self.logits(x)

    def lns(self, ids):  # LayerNorm Scaling: each norm's output times 1 / sqrt(1-based layer)
        x = self.embed(ids)
        for i in range(self.c.n_layers):
            b = f"transformer.blocks.{i}."
            x = x + self.attn(i, self.norm(b + "attn_norm", x) / math.sqrt(i + 1))
            x = x + self.mlp(i, self.norm(b + "ff_norm", x) / math.sqrt(i + 1))
        return self.logits(x)

    def keel(self, ids):  # LN_out(alpha x + F(LN_in(x))), alpha = the number of sublayers (or of layers)
        alpha = 2 * self.c.n_layers if self.c.keel_alpha == "sublayers" else self.c.n_layers
        x = self.embed(ids)
        for i in range(self.c.n_layers):
            b = f"transformer.blocks.{i}."
            for sub, fn in (("attn", self.attn), ("ff", self.mlp)):
                x = self.norm(b + sub + "_norm", alpha * x + fn(i, self.norm(b + sub + "_in_norm", x)))
        return self.logits(x)

    def prores(self, ids):  # Pre-Norm with each sublayer's output times min(1, t / ((l + 1) T))
        x = self.embed(ids)
        for i in range(self.c.n_layers):
            b = f"transformer.blocks.{i}."
            a = min(1.0, self.t / ((i + 1) * self.c.prores_layer_steps))
            x = x + a * self.attn(i, self.norm(b + "attn_norm", x))
            x = x + a * self.mlp(i, self.norm(b + "ff_norm", x))
        return self.logits(x)

    def attnres(self, ids):  # each sublayer reads a softmax mixture over depth (of outputs, or of block sums)
        L, N = self.c.n_layers, self.c.attnres_blocks
        per_block = 1 if N == 0 else 2 * L // N  # sublayers a block

        def mix(sources, prefix):
            if len(sources) == 1:
                return sources[0]
            v = torch.stack(sources)  # (S, B, T, d)
            alpha = (self.norm(prefix + "_key_norm", v) @ self.p[prefix + "_query"]).softmax(0)
            return (alpha.unsqueeze(-1) * v).sum(0)

        emb, outs = self.embed(ids), []
        for j in range(2 * L):
            i, sub = divmod(j, 2)
            b = f"transformer.blocks.{i}."
            k = j // per_block  # the block sublayer j belongs to: blocks 0 .. k-1 are complete
            sources = [emb] + [sum(outs[m * per_block:(m + 1) * per_block]) for m in range(k)]
            if j % per_block:
                sources.append(sum(outs[k * per_block:j]))
            name, fn = (("attn", self.attn), ("ff", self.mlp))[sub]
            outs.append(fn(i, self.norm(b + name + "_norm", mix(sources, b + name))))
        last = f"transformer.blocks.{L - 1}.out"
        blocks = [sum(outs[m * per_block:(m + 1) * per_block]) for m in range(2 * L // per_block)]
        return self.logits(mix([emb] + blocks, last))

    def pre_embednorm(self, ids):
        return self.pre(ids, x=rms(self.embed(ids), None, self.eps))  # parameter-free RMSNorm, then Pre-Norm

    def hybrid_star(self, ids):
        x = self.embed(ids)
        for i in range(self.c.n_layers):
            b = f"transformer.blocks.{i}."
            if i == 0:
                x = x + self.attn(i, self.norm(b + "attn_norm", x), head_norms=True)
                x = x + self.mlp(i, self.norm(b + "ff_norm", x))
            else:
                u = self.norm(b + "ff_norm", x + self.attn(i, x, head_norms=True))
                x = u + self.mlp(i, u)
        return self.logits(x)

    def mhc_coefficients(self, prefix, streams):
        """H_pre (B,T,n), H_post (B,T,n), H_res (B,T,n,n) from the n streams, written out with plain ops."""
        n = len(streams)
        flat = self.norm(prefix + "norm", torch.cat(streams, dim=-1))
        logits = flat @ self.p[prefix + "proj"]
        g = self.p[prefix + "gates"]
        pre = torch.sigmoid(g[0] * logits[..., :n] + self.p[prefix + "bias_pre"])
        post = 2 * torch.sigmoid(g[1] * logits[..., n : 2 * n] + self.p[prefix + "bias_post"])
        m = torch.exp(g[2] * logits[..., 2 * n :].reshape(*logits.shape[:-1], n, n) + self.p[prefix + "bias_res"])
        for _ in range(self.c.mhc_sinkhorn_iterations):  # plain (not log-domain) Sinkhorn-Knopp
            if self.c.mhc_sinkhorn_order == "columns_first":  # the mHC paper: T_r(T_c(M))
                m = m / m.sum(-2, keepdim=True)
                m = m / m.sum(-1, keepdim=True)
            else:
                m = m / m.sum(-1, keepdim=True)
                m = m / m.sum(-2, keepdim=True)
        return pre, post, m

    def mhc(self, ids):
        n = self.c.mhc_expansion_rate
        streams = [self.embed(ids)] * n
        for i in range(self.c.n_layers):
            b = f"transformer.blocks.{i}."
            for sub, fn in (("attn", self.attn), ("ff", self.mlp)):
                pre, post, res = self.mhc_coefficients(b + sub + "_mhc.", streams)
                inp = sum(pre[..., s, None] * streams[s] for s in range(n))
                out = fn(i, self.norm(b + sub + "_norm", inp))
                streams = [
                    sum(res[..., j, s, None] * streams[s] for s in range(n)) + post[..., j, None] * out
                    for j in range(n)
                ]
        return self.logits(sum(streams) / n)

    def __call__(self, ids, model_type):
        return getattr(self, model_type)(ids)
