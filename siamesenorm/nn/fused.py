"""SiameseNorm's stream updates and input fusion in one pass over the streams, independent of the compiler.

One sublayer's input side, per token (row of d features; every norm an RMSNorm, each optional part by flag):

    X1 = X + O * s,  Y1 = Y + O                       (with the previous sublayer's output O; without, X1 = X, Y1 = Y)
    XA = LN^X(X1)                                     (with ``x_weight``/``x_norm``; else XA = X1)
    Z  = gamma * XA + LN^Y(Y1)                        (gamma only where given: hybrid_pre's attention)
    H  = LN^in(Z)                                     (with ``in_norm``; else H = Z)

returns (XA, Y1, H): the two streams after the update and the sublayer's input. Without X (one stream, ``x``
None: Pre-Norm's add and norm, the fair baseline) it is Y1 = Y + O, H = LN^in(LN^Y(Y1)). ``block_input`` is a
block's first call on the stacked state (X, Y) OLMo's loop carries: its halves read in place, its gradient written
whole by the backward. ``stream_add`` is the end of a block: X + O * s and Y + O written side by side into the
stacked state; its backward hands the stacked gradient's halves on as they are and writes dO. Eager runs this as about
30 kernels that each read and write a (rows, d) tensor; one Triton kernel reads X, Y, O once and writes XA, Y1, H
(and X1 where LN^X follows the add, for backward). Backward is one kernel too: it keeps only Y1 and X1 (XA when
there is no LN^X), recomputes the norms from them, and writes dX, dY, dO with each weight's gradient summed over
its rows by program and then over programs.

``head_norm`` is HybridNorm's attention side (hybrid, hybrid_star, hybrid_pre): the per-head RMSNorms of q, k and
v over the fused QKV projection's output and then RoPE on q and k, one kernel each way (read qkv once, write q, k
and v as tensors of their own), with a weight per group (q's, k's, v's) where eager runs three norms of about eight
kernels each and RoPE's a dozen more. Backward keeps the outputs, which attention keeps anyway, and one rstd a head:
it turns q and k back by RoPE's inverse and divides by the weight to recover the normalised input.

``sinkhorn`` is mHC's Sinkhorn-Knopp (``sinkhorn_reference``, the core's eager one): a token's 2 x iterations
normalisations in one kernel each way; backward keeps only the logits and replays the iterations in registers.

``stream_mix`` is hc's and mHC's depth connection with the stream mixing, out_j = sum_s m[j, s] h_s + b_j F: one
kernel reads the carried streams and the sublayer's output once and writes the new streams once, where eager
writes the mixed streams, the n scaled copies of F and their sum; backward keeps only the op's inputs.

``rms_project`` is hc's and mHC's coefficient projection, RMSNorm(x) @ P as (x @ (w P)) * rstd(x): one kernel
reads the streams once in their own dtype for the product (fp32 accumulation) and rstd, where eager writes an fp32
copy (or the normalised one) and reads it; backward one kernel for dx and one for dW.

``hc_width`` / ``mhc_width`` are hc's and mHC's width connection with the branch's Pre-Norm: the coefficients'
logits (``rms_project``'s product: per stream for hc, over the flattened streams for mHC), the input coefficients,
the branch input and its RMSNorm in one kernel that reads the streams once and writes the normalised input once,
with a copy of the streams for the depth connection to read (so that the streams' two gradients meet in this op's
backward kernel, not in an autograd sum); backward one kernel writes dh once (and dW's kernel reads the streams
again); nothing d wide is recomputed, and the copy is kept in the streams' place.

``pair_mix`` is SiameseNorm with stream mixing (``siamese_mixing``): the previous sublayer's add and the two streams'
doubly stochastic mix, p from the streams in registers (static: a learned scalar; dynamic: per token, from the
RMS-normalised concatenated streams), one kernel each way; backward keeps only the op's inputs and recomputes p.

``stream_input`` picks the Triton kernel for CUDA tensors when Triton is installed (or every device under
``TRITON_INTERPRET=1``, Triton's interpreter, which the tests use on CPU), and ``reference`` (plain torch, fp32
inside, the same arithmetic) otherwise. ``check`` compares the op with autograd of ``reference`` for every flag
combination (the tests run it, and the GPU check on CUDA).
"""

from __future__ import annotations

import functools
import itertools
import os
import re
from typing import Callable, List, Optional, Tuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines without Triton: the torch reference runs
    triton = None

Tensor = torch.Tensor


def _rms(u: Tensor, w: Optional[Tensor], eps: float) -> Tensor:
    out = u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + eps)
    return out * w.float() if w is not None else out


def reference(x: Optional[Tensor], y: Tensor, o: Optional[Tensor] = None, *, scale: float = 1.0,
              x_norm: bool = False, x_weight: Optional[Tensor] = None, y_weight: Optional[Tensor] = None,
              gamma: Optional[Tensor] = None, in_norm: bool = False, in_weight: Optional[Tensor] = None,
              eps: float = 1e-5) -> Tuple[Optional[Tensor], Tensor, Tensor]:
    """The fused op's arithmetic in plain torch (fp32 inside, outputs in the streams' dtype); ``x`` None: one
    stream (XA None, Z = LN^Y(Y1))."""
    dtype = y.dtype
    y1 = y.float() + o.float() if o is not None else y.float()
    z = _rms(y1, y_weight, eps)
    xa = None
    if x is not None:
        x1 = x.float() + o.float() * scale if o is not None else x.float()
        xa = _rms(x1, x_weight, eps) if x_norm else x1
        z = z + (xa * gamma.float() if gamma is not None else xa)
    h = _rms(z, in_weight, eps) if in_norm else z
    return (xa.to(dtype) if xa is not None else None), y1.to(dtype), h.to(dtype)


if triton is not None:

    @triton.jit
    def _rstd(u, d, eps):
        return 1.0 / tl.sqrt(tl.sum(u * u, axis=0) / d + eps)

    @triton.jit
    def _forward_kernel(X, Y, O, XA, Y1, H, X1, WX, WY, G, WIN, x_stride, y_stride, o_stride, out_stride, d, scale,
                        eps, HAS_X: tl.constexpr, HAS_O: tl.constexpr, X_NORM: tl.constexpr, HAS_WX: tl.constexpr,
                        HAS_WY: tl.constexpr, HAS_G: tl.constexpr, IN_NORM: tl.constexpr, HAS_WIN: tl.constexpr,
                        HAS_H: tl.constexpr, COPY: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < d
        y = tl.load(Y + row * y_stride + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_O:
            o = tl.load(O + row * o_stride + cols, mask=mask, other=0.0).to(tl.float32)
            y = y + o
        if HAS_O or COPY:  # COPY: the streams written as tensors of their own, even where unchanged
            tl.store(Y1 + row * out_stride + cols, y.to(Y1.dtype.element_ty), mask=mask)
        if HAS_X:
            xa = tl.load(X + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_O:
                xa = xa + o * scale
            if X_NORM:
                if HAS_O:  # without O, X1 is X itself: the backward reads X
                    tl.store(X1 + row * d + cols, xa.to(X1.dtype.element_ty), mask=mask)
                xa = xa * _rstd(xa, d, eps)
                if HAS_WX:
                    xa = xa * tl.load(WX + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_O or X_NORM or COPY:  # else X passes through unchanged and is not written
                tl.store(XA + row * out_stride + cols, xa.to(XA.dtype.element_ty), mask=mask)
        if HAS_H:
            z = y * _rstd(y, d, eps)
            if HAS_WY:
                z = z * tl.load(WY + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_X:
                if HAS_G:
                    z = z + xa * tl.load(G + cols, mask=mask, other=0.0).to(tl.float32)
                else:
                    z = z + xa
            h = z
            if IN_NORM:
                h = z * _rstd(z, d, eps)
                if HAS_WIN:
                    h = h * tl.load(WIN + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(H + row * d + cols, h.to(H.dtype.element_ty), mask=mask)

    @triton.jit
    def _norm_backward(u, w, grad, d, eps, HAS_W: tl.constexpr):
        """(du, u_hat) for out = u_hat * w, u_hat = u * rstd(u), given d out = grad."""
        r = _rstd(u, d, eps)
        u_hat = u * r
        g = grad * w if HAS_W else grad
        return r * (g - u_hat * (tl.sum(g * u_hat, axis=0) / d)), u_hat

    @triton.jit
    def _backward_kernel(XS, Y1, DXA, DY1, DH, DX, DY, DO, WX, WY, G, WIN, PWX, PWY, PG, PWIN, xs_stride, y1_stride,
                         dxa_stride, dy1_stride, dxy_stride, rows, d, scale, eps, HAS_X: tl.constexpr,
                         HAS_O: tl.constexpr, X_NORM: tl.constexpr, HAS_WX: tl.constexpr, HAS_WY: tl.constexpr,
                         HAS_G: tl.constexpr, IN_NORM: tl.constexpr, HAS_WIN: tl.constexpr, HAS_H: tl.constexpr,
                         HAS_DY1: tl.constexpr, HAS_DXA: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr,
                         BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < d
        zero = tl.zeros([BLOCK], tl.float32)
        wx = tl.load(WX + cols, mask=mask, other=0.0).to(tl.float32) if HAS_WX else zero
        wy = tl.load(WY + cols, mask=mask, other=0.0).to(tl.float32) if HAS_WY else zero
        gm = tl.load(G + cols, mask=mask, other=0.0).to(tl.float32) if HAS_G else zero
        win = tl.load(WIN + cols, mask=mask, other=0.0).to(tl.float32) if HAS_WIN else zero
        acc_wx = tl.zeros([BLOCK], tl.float32)
        acc_wy = tl.zeros([BLOCK], tl.float32)
        acc_g = tl.zeros([BLOCK], tl.float32)
        acc_win = tl.zeros([BLOCK], tl.float32)
        for i in range(ROWS_PER_PROGRAM):
            row = (pid * ROWS_PER_PROGRAM + i).to(tl.int64)
            m = mask & (row < rows)
            dy1 = zero  # no gradient of Y1 arrives where Y passes through (no O): none read, none materialised
            if HAS_DY1:
                dy1 = tl.load(DY1 + row * dy1_stride + cols, mask=m, other=0.0).to(tl.float32)
            dxa = zero
            xa = zero
            if HAS_X:
                if HAS_DXA:  # none where X passed through: as dY1
                    dxa = tl.load(DXA + row * dxa_stride + cols, mask=m, other=0.0).to(tl.float32)
                xs = zero
                if X_NORM or HAS_H:  # X1 with LN^X, else XA; the end-of-block add needs neither stream
                    xs = tl.load(XS + row * xs_stride + cols, mask=m, other=0.0).to(tl.float32)
                xa = xs
                if X_NORM:
                    xa = xs * _rstd(xs, d, eps)
                    if HAS_WX:
                        xa = xa * wx
            if HAS_H:
                y1 = tl.load(Y1 + row * y1_stride + cols, mask=m, other=0.0).to(tl.float32)
                dh = tl.load(DH + row * d + cols, mask=m, other=0.0).to(tl.float32)
                y_hat = y1 * _rstd(y1, d, eps)
                z = y_hat * wy if HAS_WY else y_hat
                if HAS_X:
                    z = z + (xa * gm if HAS_G else xa)
                dz = dh
                if IN_NORM:
                    dz, z_hat = _norm_backward(z, win, dh, d, eps, HAS_WIN)
                    if HAS_WIN:
                        acc_win += dh * z_hat
                if HAS_X:
                    if HAS_G:
                        acc_g += dz * xa
                        dxa += dz * gm
                    else:
                        dxa += dz
                dyn, _ = _norm_backward(y1, wy, dz, d, eps, HAS_WY)
                if HAS_WY:
                    acc_wy += dz * y_hat
                dy1 += dyn
            if HAS_H:  # the end of a block hands dX and dY on as they arrived: it writes dO only
                tl.store(DY + row * dxy_stride + cols, dy1.to(DY.dtype.element_ty), mask=m)
            if HAS_X:
                dx1 = dxa
                if X_NORM:
                    dx1, x_hat = _norm_backward(xs, wx, dxa, d, eps, HAS_WX)
                    if HAS_WX:
                        acc_wx += dxa * x_hat
                if HAS_H:
                    tl.store(DX + row * dxy_stride + cols, dx1.to(DX.dtype.element_ty), mask=m)
                if HAS_O:
                    tl.store(DO + row * d + cols, (dx1 * scale + dy1).to(DO.dtype.element_ty), mask=m)
            elif HAS_O:
                tl.store(DO + row * d + cols, dy1.to(DO.dtype.element_ty), mask=m)
        if HAS_WX:
            tl.store(PWX + pid * d + cols, acc_wx, mask=mask)
        if HAS_WY:
            tl.store(PWY + pid * d + cols, acc_wy, mask=mask)
        if HAS_G:
            tl.store(PG + pid * d + cols, acc_g, mask=mask)
        if HAS_WIN:
            tl.store(PWIN + pid * d + cols, acc_win, mask=mask)


def _rows(t: Tensor, d: int) -> Tuple[Tensor, int]:
    """(t as (rows, d), the row stride): read in place when its rows are d contiguous features a fixed stride apart
    (a contiguous tensor, or one stream of a stacked state); otherwise a contiguous copy."""
    lead, strides = t.shape[:-1], t.stride()[:-1]
    if t.stride(-1) == 1 and lead and all(strides[i] == strides[i + 1] * lead[i + 1] for i in range(len(lead) - 1)):
        return t.as_strided((t.numel() // d, d), (strides[-1], 1)), strides[-1]
    return t.contiguous().view(-1, d), d


#: Rows a program of the row-block backwards (the stream op's, the head norms', the pair mix's), which sum their
#: weights' gradients per program and then over programs; and the head-norm backward's warps (a rows x 128 fp32
#: tile of each of several tensors at 16 heads of 128). Tunable (``TUNABLES``). Set from the H200's tuning
#: (results/gpu/h200-2026-11-28, 1.3B width, 4 x 2048 tokens): at 64 rows and 4 warps HybridNorm's head-norm
#: backward (normalising, weights, RoPE) took 6,749 us a call, 26.8 ms of a 4-layer step; at 16 rows and 8 warps
#: 538 us, the stream op's backward 168 -> 117 us (hybrid_pre) and 132 -> 83 us (pre), pre's RoPE-only head backward
#: 137 -> 125 us.
_ROWS_PER_PROGRAM = 16
_HEAD_WARPS = 8


def _warps(d: int) -> int:
    """Warps for a kernel that holds whole rows of d features as fp32 vectors (several live at once in the
    backwards): one warp per 256 features, 4 to 8, so that d = 2048 spreads each vector over 256 threads (8 values a
    thread) instead of 128 (16), as Triton's layer-norm tutorial sizes it; the same 4 as before below d = 2048."""
    return min(max(triton.next_power_of_2(d) // 256, 4), 8)


def _empty(like: Tensor) -> Tensor:
    return like.new_empty(0)


def _flags(x, o, weights, x_norm, in_norm, has_h):
    x_weight, y_weight, gamma, in_weight = weights
    return dict(HAS_X=x is not None, HAS_O=o is not None, X_NORM=bool(x_norm), HAS_WX=x_weight is not None,
                HAS_WY=y_weight is not None, HAS_G=gamma is not None, IN_NORM=bool(in_norm),
                HAS_WIN=in_weight is not None, HAS_H=bool(has_h))


def _triton_forward(x, y, o, weights, scale, x_norm, in_norm, has_h, eps, stacked=False, copy=False):
    if stacked:  # y is the stacked state (X, Y): its halves read in place
        d = y.shape[-1] // 2
        state, s_stride = _rows(y, 2 * d)
        (xr, xs), (yr, ys) = (state[:, :d], s_stride), (state[:, d:], s_stride)
        x = xr
    else:
        d = y.shape[-1]
        yr, ys = _rows(y, d)
        xr, xs = _rows(x, d) if x is not None else (yr, 0)
    orows, o_stride = _rows(o, d) if o is not None else (yr, 0)
    rows = yr.shape[0]
    new = functools.partial(torch.empty, dtype=y.dtype, device=y.device)
    write_x, write_y = x is not None and (o is not None or x_norm or copy), o is not None or copy
    if has_h:
        xa, y1, h, out_stride = new((rows, d)) if write_x else xr, new((rows, d)) if write_y else yr, new((rows, d)), d
    else:  # the end of a block: both streams written side by side
        stacked_out = new((rows, 2 * d))
        xa, y1, h, out_stride = stacked_out[:, :d], stacked_out[:, d:], xr, 2 * d
    write_x1 = x_norm and o is not None  # without O, X1 is X: the backward reads X
    x1 = new((rows, d)) if write_x1 else xa
    _forward_kernel[(rows,)](xr, yr, orows, xa, y1, h, x1, *(w if w is not None else yr for w in weights), xs, ys,
                             o_stride, out_stride, d, float(scale), float(eps), COPY=bool(copy),
                             BLOCK=triton.next_power_of_2(d), num_warps=_warps(d), **_flags(x, o, weights, x_norm, in_norm, has_h))
    if not has_h:
        return stacked_out, None, None, None
    return (xa if write_x else None), (y1 if write_y else None), h, (x1 if write_x1 else None)


def _torch_forward(x, y, o, weights, scale, x_norm, in_norm, has_h, eps, stacked=False, copy=False):
    """The same outputs as the kernel, in plain torch (CPU, or CUDA without Triton)."""
    if stacked:
        d = y.shape[-1] // 2
        x, y = y[..., :d], y[..., d:]
    if not has_h:
        return torch.cat([(x.float() + o.float() * scale).to(x.dtype), (y.float() + o.float()).to(y.dtype)], -1), \
            None, None, None
    x_weight, y_weight, gamma, in_weight = weights
    xa, y1, h = reference(x, y, o, scale=scale, x_norm=x_norm, x_weight=x_weight, y_weight=y_weight, gamma=gamma,
                          in_norm=in_norm, in_weight=in_weight, eps=eps)
    changed = o is not None
    x1 = (x.float() + o.float() * scale).to(x.dtype) if x is not None and x_norm and changed else None
    if x is not None:  # a stream that passes through unchanged is written only when asked (``copy``)
        xa = xa if changed or x_norm else (x.clone() if copy else None)
    return xa, (y1 if changed else y.clone() if copy else None), h, x1


def _norm_backward_torch(u, w, grad, eps):
    """(du, u_hat) for out = u_hat * w, u_hat = u * rstd(u): what the kernel's _norm_backward computes."""
    r = torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + eps)
    u_hat = u * r
    g = grad * w if w is not None else grad
    return r * (g - u_hat * (g * u_hat).mean(-1, keepdim=True)), u_hat


def _torch_backward(xs, y1, dxa, dy1, dh, weights, scale, x_norm, in_norm, has_h, has_o, has_x, eps, has_dy1=True,
                    has_dxa=True):
    """The kernel's backward in plain torch, written out (not autograd): tested against autograd of ``reference``."""
    wx, wy, gm, win = (w.float() if w is not None else None for w in weights)
    # an op's outputs may not alias its inputs
    dy1 = dy1.float().clone() if has_dy1 else torch.zeros(y1.shape, dtype=torch.float32, device=y1.device)
    dxa = (dxa.float().clone() if has_dxa else torch.zeros(dy1.shape, dtype=torch.float32, device=dy1.device)) \
        if has_x else None
    grads = [None, None, None, None]
    xs = xs.float() if has_x else None
    xa = _rms(xs, wx, eps) if has_x and x_norm else xs
    if has_h:
        y1, dh = y1.float(), dh.float()
        y_hat = _rms(y1, None, eps)
        z = y_hat * wy if wy is not None else y_hat
        if has_x:
            z = z + (xa * gm if gm is not None else xa)
        dz = dh
        if in_norm:
            dz, z_hat = _norm_backward_torch(z, win, dh, eps)
            if win is not None:
                grads[3] = (dh * z_hat).reshape(-1, z.shape[-1]).sum(0)
        if has_x and gm is not None:
            grads[2] = (dz * xa).reshape(-1, z.shape[-1]).sum(0)
            dxa = dxa + dz * gm
        elif has_x:
            dxa = dxa + dz
        dyn, _ = _norm_backward_torch(y1, wy, dz, eps)
        if wy is not None:
            grads[1] = (dz * y_hat).reshape(-1, z.shape[-1]).sum(0)
        dy1 = dy1 + dyn
    dx1 = dxa
    if has_x and x_norm:
        dx1, x_hat = _norm_backward_torch(xs, wx, dxa, eps)
        if wx is not None:
            grads[0] = (dxa * x_hat).reshape(-1, xs.shape[-1]).sum(0)
    do = (dx1 * scale + dy1 if has_x else dy1.clone()) if has_o else None  # outputs may not alias each other
    if not has_h:  # the end of a block: dX and dY are the incoming gradient's halves, handed on as they are
        dx1, dy1 = None, None
    return dx1, dy1, do, grads


def _triton_backward(xs, y1, dxa, dy1, dh, weights, scale, x_norm, in_norm, has_h, has_o, has_x, eps,
                     x_dtype=torch.float32, o_dtype=torch.float32, has_dy1=True, has_dxa=True, stacked=False):
    """The kernel computes in fp32 and writes dX, dY in ``x_dtype`` and dO in ``o_dtype`` (the dtypes the caller
    returns: no fp32 buffer and cast after it); the weights' partial sums stay fp32 until summed. Without
    ``has_dy1`` (Y passed through: no gradient of Y1) ``dy1`` is empty and the kernel reads none; ``has_dxa`` the
    same for XA (X passed through). ``stacked``: dX and dY written side by side, the stacked state's gradient (returned
    as dY, (rows, 2d)). Without ``has_h`` (the end of a block) only dO is written."""
    d = (dy1 if has_dy1 else y1).shape[-1]
    y1, y1_stride = _rows(y1, d) if y1.numel() else (None, 0)
    dy1, dy1_stride = _rows(dy1, d) if has_dy1 else (y1, 0)
    rows = dy1.shape[0]
    dxa, dxa_stride = _rows(dxa, d) if has_x and has_dxa else (dy1, 0)
    xs, xs_stride = _rows(xs, d) if xs.numel() else (dy1, 0)
    y1 = dy1 if y1 is None else y1
    dh = dh.reshape(rows, d).contiguous() if dh.numel() else dy1
    new = functools.partial(torch.empty, dtype=x_dtype, device=dy1.device)
    if stacked:
        dxy = new((rows, 2 * d))
        dx, dy, dxy_stride = dxy[:, :d], dxy[:, d:], 2 * d
    else:
        dy = new((rows, d)) if has_h else dy1  # the end of a block writes dO only
        dx, dxy_stride = new((rows, d)) if has_x and has_h else dy, d
    do = torch.empty((rows, d), dtype=o_dtype, device=dy1.device) if has_o else dy
    per = min(_ROWS_PER_PROGRAM, rows)  # rows per program: 16 at training sizes; a small call, one program
    programs = triton.cdiv(rows, per)
    partials = [torch.empty((programs, d), dtype=torch.float32, device=dy.device) if w is not None else dy
                for w in weights]
    _backward_kernel[(programs,)](xs, y1, dxa, dy1, dh, dx, dy, do, *(w if w is not None else dy for w in weights),
                                  *partials, xs_stride, y1_stride, dxa_stride, dy1_stride, dxy_stride, rows, d, scale,
                                  eps, ROWS_PER_PROGRAM=per, BLOCK=triton.next_power_of_2(d), num_warps=_warps(d), HAS_DY1=bool(has_dy1),
                                  HAS_DXA=bool(has_x and has_dxa),
                                  **_flags(dx if has_x else None, do if has_o else None, weights, x_norm, in_norm,
                                           has_h))
    grads = [p.sum(0) if w is not None else None for p, w in zip(partials, weights)]
    if stacked:
        return None, dxy, (do if has_o else None), grads
    if not has_h:
        return None, None, (do if has_o else None), grads
    return (dx if has_x else None), dy, (do if has_o else None), grads


def _use_triton(t: Tensor) -> bool:
    return triton is not None and (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


Opt = Optional[Tensor]
#: The ops' namespace: ``siamesenorm`` in the package. An export carries a copy of this file (siamesenorm/export/remote/),
#: which transformers loads as a module of its own, perhaps beside the package or another export's copy in one
#: process; an op name registers once per process, so a copy registers under its own module's name.
NAMESPACE = "siamesenorm" if __name__ == "siamesenorm.nn.fused" else "siamesenorm_" + re.sub(r"\W", "_", __name__)


@torch.library.custom_op(f"{NAMESPACE}::stream_forward", mutates_args=())
def _stream_forward(x: Opt, y: Tensor, o: Opt, x_weight: Opt, y_weight: Opt, gamma: Opt, in_weight: Opt,
                    scale: float, x_norm: bool, in_norm: bool, has_h: bool, stacked: bool, copy: bool,
                    eps: float) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(XA, Y1, H, X1), each empty where not written (X, Y passing through unchanged, or no X; X1 only with LN^X
    after an add); without ``has_h``, (the stacked streams, empty, empty, empty). ``stacked``: ``x`` None and ``y``
    the stacked state (X, Y), (..., 2d). ``copy``: XA and Y1 written even where the stream passes through."""
    run = _triton_forward if _use_triton(y) else _torch_forward
    out = run(x, y, o, (x_weight, y_weight, gamma, in_weight), scale, x_norm, in_norm, has_h, eps, stacked, copy)
    return tuple(t.reshape(*y.shape[:-1], t.shape[-1]) if t is not None else _empty(y) for t in out)


@_stream_forward.register_fake
def _(x, y, o, x_weight, y_weight, gamma, in_weight, scale, x_norm, in_norm, has_h, stacked, copy, eps):
    if not has_h:
        return y.new_empty(*y.shape[:-1], 2 * y.shape[-1]), _empty(y), _empty(y), _empty(y)
    has_x = x is not None or stacked
    shape = (*y.shape[:-1], y.shape[-1] // 2) if stacked else y.shape
    return (y.new_empty(shape) if has_x and (o is not None or x_norm or copy) else _empty(y),
            y.new_empty(shape) if o is not None or copy else _empty(y), y.new_empty(shape),
            y.new_empty(shape) if has_x and x_norm and o is not None else _empty(y))


@torch.library.custom_op(f"{NAMESPACE}::stream_backward", mutates_args=())
def _stream_backward(xs: Tensor, y1: Tensor, dxa: Tensor, dy1: Tensor, dh: Tensor, x_weight: Opt, y_weight: Opt,
                     gamma: Opt, in_weight: Opt, scale: float, x_norm: bool, in_norm: bool, has_h: bool, has_o: bool,
                     has_x: bool, stacked: bool, eps: float, x_dtype: torch.dtype,
                     o_dtype: torch.dtype) -> List[Tensor]:
    """(dX, dY, dO, dW^X, dW^Y, dgamma, dW^in), each empty where absent; ``dy1`` or ``dxa`` empty where no gradient
    arrived for Y1 or XA (a stream that passed through: the kernel reads none). ``stacked``: dY is the stacked
    state's gradient (..., 2d) and dX empty. Without ``has_h`` (the end of a block): dO only."""
    weights = (x_weight, y_weight, gamma, in_weight)
    args = (xs, y1, dxa, dy1, dh, weights, scale, x_norm, in_norm, has_h, has_o, has_x, eps)
    has_dy1, has_dxa = dy1.numel() > 0, has_x and dxa.numel() > 0
    shape = (dy1 if has_dy1 else y1).shape
    if _use_triton(y1 if y1.numel() else dy1):
        dx, dy, do, grads = _triton_backward(*args, x_dtype, o_dtype, has_dy1, has_dxa, stacked)
    else:
        dx, dy, do, grads = _torch_backward(*args, has_dy1, has_dxa)
        if stacked:
            dx, dy = None, torch.cat([dx, dy], -1)
    lead = shape[:-1]
    out = [t.reshape(*lead, t.shape[-1]).to(dtype) if t is not None else _empty(dh)
           for t, dtype in ((dx, x_dtype), (dy, x_dtype), (do, o_dtype))]
    return out + [g.to(w.dtype) if g is not None else _empty(dh) for g, w in zip(grads, weights)]


@_stream_backward.register_fake
def _(xs, y1, dxa, dy1, dh, x_weight, y_weight, gamma, in_weight, scale, x_norm, in_norm, has_h, has_o, has_x,
      stacked, eps, x_dtype, o_dtype):
    shape = (dy1 if dy1.numel() else y1).shape
    wide = (*shape[:-1], 2 * shape[-1])
    out = [dh.new_empty(shape, dtype=x_dtype) if has_x and has_h and not stacked else _empty(dh),
           dh.new_empty(wide if stacked else shape, dtype=x_dtype) if has_h else _empty(dh),
           dh.new_empty(shape, dtype=o_dtype) if has_o else _empty(dh)]
    weights = (x_weight, y_weight, gamma, in_weight)
    return out + [w.new_empty(w.shape) if w is not None else _empty(dh) for w in weights]


def _setup(ctx, inputs, output):
    x, y, o, x_weight, y_weight, gamma, in_weight, scale, x_norm, in_norm, has_h, stacked, _copy, eps = inputs
    a, b, _, x1 = output
    if stacked:  # the two streams are the halves of y, read in place in the backward too
        d = y.shape[-1] // 2
        x, y = y[..., :d], y[..., d:]
    has_x = x is not None
    keep_x, keep_y = _empty(y), _empty(y)  # the end-of-block add recomputes nothing
    if has_h:  # the streams after the add (the inputs where no O is added), X1 before LN^X
        if has_x:
            keep_x = (x1 if x_norm else a) if o is not None else x
        keep_y = b if o is not None else y
    ctx.save_for_backward(keep_x, keep_y, x_weight, y_weight, gamma, in_weight)
    # an output nothing downstream uses (X1, kept for the backward only; XA or Y1 where a stream passed through)
    # gets None, not a materialised zero tensor of its shape that the backward would then read
    ctx.set_materialize_grads(False)
    ctx.args = (scale, x_norm, in_norm, has_h, o is not None, has_x, stacked, eps, y.dtype,
                o.dtype if o is not None else y.dtype)
    ctx.shape = y.shape


def _backward(ctx, da, db, dh, _dx1):
    keep_x, keep_y, *weights = ctx.saved_tensors
    scale, x_norm, in_norm, has_h, has_o, has_x, stacked, eps, x_dtype, o_dtype = ctx.args
    if not has_h:  # the end of a block: dX and dY are the stacked gradient's halves, as they are; one kernel for dO
        if da is None:  # the stacked state unused downstream: no gradient to pass on
            return (None,) * 14
        d = ctx.shape[-1]
        dxa, dy1 = da[..., :d], da[..., d:]
        do = _stream_backward(_empty(da), _empty(da), dxa, dy1, _empty(da), *weights, scale, x_norm, in_norm, has_h,
                              has_o, has_x, False, eps, x_dtype, o_dtype)[2]
        return (dxa, dy1, do, *(None,) * 11)
    # no gradient where a stream passed through (Y without O, X without O or LN^X): nothing to read
    dxa = da if has_x and da is not None and da.numel() else _empty(keep_y)
    dy1 = db if db is not None and db.numel() else _empty(keep_y)
    dh = dh if dh is not None else torch.zeros(ctx.shape, dtype=x_dtype, device=keep_y.device)
    dx, dy, do, *dw = _stream_backward(keep_x, keep_y, dxa, dy1, dh, *weights, scale, x_norm, in_norm, has_h, has_o,
                                       has_x, stacked, eps, x_dtype, o_dtype)
    grads = [g if g.numel() else None for g in dw]
    return (dx if has_x and not stacked else None, dy, do if has_o else None, *grads, *(None,) * 7)


_stream_forward.register_autograd(_backward, setup_context=_setup)


def available(t: Tensor) -> bool:
    """Whether the Triton kernels run for tensors like ``t`` (else the same op runs in plain torch): CUDA with Triton
    installed, or any device under Triton's interpreter (``TRITON_INTERPRET=1``, how the tests run them on CPU)."""
    return _use_triton(t)


def stream_input(x: Optional[Tensor], y: Tensor, o: Optional[Tensor] = None, *, scale: float = 1.0,
                 x_norm: bool = False, x_weight: Optional[Tensor] = None, y_weight: Optional[Tensor] = None,
                 gamma: Optional[Tensor] = None, in_norm: bool = False, in_weight: Optional[Tensor] = None,
                 eps: float = 1e-5, copy: bool = False) -> Tuple[Optional[Tensor], Tensor, Tensor]:
    """(XA, Y1, H) as in the module docstring, one op each way (``siamesenorm::stream_forward`` / ``_backward``).
    ``x`` None: one stream, H = LN^in(LN^Y(Y1)) (Pre-Norm's add and norm; XA comes back None). ``copy``: a stream
    that passes through (no O, no LN^X) comes back as a tensor of its own, one write, so that where the caller uses
    it again its gradient comes back into this op's backward (one read) instead of being summed with this op's own
    by autograd (an add: read 2, write 1)."""
    a, b, h, _ = _stream_forward(x, y, o, x_weight, y_weight, gamma, in_weight, float(scale), bool(x_norm),
                                 bool(in_norm), True, False, bool(copy), float(eps))
    return (None if x is None else a if a.numel() else x), (b if b.numel() else y), h


def block_input(state: Tensor, o: Optional[Tensor] = None, *, scale: float = 1.0, x_norm: bool = False,
                x_weight: Optional[Tensor] = None, y_weight: Optional[Tensor] = None, gamma: Optional[Tensor] = None,
                in_norm: bool = False, in_weight: Optional[Tensor] = None,
                eps: float = 1e-5) -> Tuple[Tensor, Tensor, Tensor]:
    """``stream_input`` on the stacked state (X, Y), (..., 2d), the tensor OLMo's loop hands a block: (XA, Y1, H) with
    X and Y its halves, read in place. XA and Y1 come back as tensors of their own even where a stream passes through
    (one write each, so that their gradients come back to this op), and the backward writes the state's gradient
    itself, dX and dY side by side: no ``cat`` joining two halves' gradients, no sum of two uses of a half."""
    a, b, h, _ = _stream_forward(None, state, o, x_weight, y_weight, gamma, in_weight, float(scale), bool(x_norm),
                                 bool(in_norm), True, True, True, float(eps))
    return a, b, h


def stream_add(x: Tensor, y: Tensor, o: Tensor, *, scale: float = 1.0) -> Tensor:
    """The end of a block: (X + O * s, Y + O) stacked on the feature axis, (..., 2d), the state OLMo's loop carries.
    Backward: the stacked gradient's halves are dX and dY as they are (views, no copy); one kernel writes dO."""
    return _stream_forward(x, y, o, None, None, None, None, float(scale), False, False, False, False, False,
                           1e-5)[0]


# ---- HybridNorm's per-head Q/K/V norms (and RoPE) in one pass over the attention projection's output --------------
def head_reference(qkv: Tensor, q_weight: Optional[Tensor], k_weight: Optional[Tensor], v_weight: Optional[Tensor],
                   *, n_q: int, n_kv: int, head_dim: int, eps: float = 1e-5,
                   rope: Optional[Tuple[Tensor, Tensor]] = None, normalise: bool = True) -> Tuple[Tensor, Tensor, Tensor]:
    """``qkv`` (..., T, (n_q + 2 n_kv) head_dim), the fused projection's output: every head of every token
    RMS-normalised over head_dim and scaled by its group's weight (the first n_q heads q's, then n_kv k's, then n_kv
    v's), then, with ``rope`` = (sin, cos), each (T, head_dim), the q and k heads rotated at their token's position
    (``rotate_half``'s pairs (c, c + head_dim / 2), OLMo's RoPE, positions 0..T-1); fp32 inside, (q, k, v) in qkv's
    dtype, rounded once; without ``normalise`` RoPE alone (``qkv_rope``'s). Written with plain torch ops (autograd
    differentiates it), independent of the op."""
    slots = n_q + 2 * n_kv
    u = qkv.float().unflatten(-1, (slots, head_dim))
    y = _rms(u, _head_table(q_weight, k_weight, v_weight, n_q, n_kv), eps) if normalise else u
    if rope is not None:
        sin, cos = (t.float()[:, None, :] for t in rope)  # (T, 1, head_dim): every slot of a token alike
        half = head_dim // 2
        turned = torch.cat([-y[..., half:], y[..., :half]], -1)
        rotated = y * cos + turned * sin
        y = torch.cat([rotated[..., :n_q + n_kv, :], y[..., n_q + n_kv:, :]], -2)
    out = y.flatten(-2).to(qkv.dtype)
    return out.split([n_q * head_dim, n_kv * head_dim, n_kv * head_dim], -1)


def _head_table(wq, wk, wv, n_q, n_kv) -> Optional[Tensor]:
    """The weight of every head slot, (n_q + 2 n_kv, head_dim) fp32; None without weights (no affine)."""
    if wq is None:
        return None
    return torch.cat([wq.float().expand(n_q, -1), wk.float().expand(n_kv, -1), wv.float().expand(n_kv, -1)])


def _turn(t: Tensor, rope: Tuple[Tensor, Tensor], n_rot: int, back: bool) -> Tensor:
    """t (..., T, slots, head_dim) fp32 with its first ``n_rot`` slots rotated by RoPE at their token's position
    (``back``: the inverse rotation, which is also the rotation's transpose: what a gradient goes through)."""
    sin, cos = (x.float()[:, None, :] for x in rope)
    half = t.shape[-1] // 2
    head = t[..., :n_rot, :]
    turned = torch.cat([-head[..., half:], head[..., :half]], -1)
    head = head * cos + turned * (-sin if back else sin)
    return torch.cat([head, t[..., n_rot:, :]], -2)


def _head_forward_torch(qkv, table, rope, n_q, n_kv, head_dim, eps,
                        normalise=True) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The kernel's forward in plain torch: (q, k, v) each a tensor of its own, and rstd (..., slots) in fp32
    (without ``normalise``: q, k, v as they come, RoPE only, and rstd empty)."""
    u = qkv.float().unflatten(-1, (n_q + 2 * n_kv, head_dim))
    if not normalise:
        y, r = u, u.new_empty(0)
    else:
        r = torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + eps)
        y = u * r * table if table is not None else u * r
    if rope is not None:
        y = _turn(y, rope, n_q + n_kv, back=False)
    q, k, v = (t.contiguous() for t in y.flatten(-2).to(qkv.dtype).split([n_q * head_dim, n_kv * head_dim,
                                                                          n_kv * head_dim], -1))
    return q, k, v, (r.squeeze(-1) if normalise else r)


def _head_backward_torch(outs, grads, rstd, table, rope, n_q, n_kv, head_dim) -> Tuple[Tensor, Optional[Tensor]]:
    """The kernel's backward in plain torch (not autograd), from the op's outputs: (d qkv fp32, d table fp32);
    ``outs`` None: no norm (RoPE only), d qkv is the gradient turned back."""
    slots = n_q + 2 * n_kv
    g = torch.cat([t.float() for t in grads], -1).unflatten(-1, (slots, head_dim))
    if rope is not None:  # the gradient through the rotation's transpose
        g = _turn(g, rope, n_q + n_kv, back=True)
    if outs is None:
        return g.flatten(-2), None
    o = torch.cat([t.float() for t in outs], -1).unflatten(-1, (slots, head_dim))
    if rope is not None:  # back to the norm's output
        o = _turn(o, rope, n_q + n_kv, back=True)
    u_hat = torch.where(table != 0, o / table, 0.0) if table is not None else o
    gw = g * table if table is not None else g
    du = rstd.unsqueeze(-1) * (gw - u_hat * (gw * u_hat).mean(-1, keepdim=True))
    dtable = (g * u_hat).reshape(-1, slots, head_dim).sum(0) if table is not None else None
    return du.flatten(-2), dtable


if triton is not None:

    @triton.jit
    def _slot_load(Q, K, V, row, s, c, n_q, n_kv, hd, m):
        """Slot s of a token's heads, (SLOTS, BLOCK) fp32, from q's, k's or v's tensor (contiguous rows)."""
        return tl.load(Q + row * n_q * hd + s * hd + c, mask=m & (s < n_q), other=0.0).to(tl.float32) \
            + tl.load(K + row * n_kv * hd + (s - n_q) * hd + c, mask=m & (s >= n_q) & (s < n_q + n_kv),
                      other=0.0).to(tl.float32) \
            + tl.load(V + row * n_kv * hd + (s - n_q - n_kv) * hd + c, mask=m & (s >= n_q + n_kv),
                      other=0.0).to(tl.float32)

    @triton.jit
    def _head_forward_kernel(T, Q, K, V, R, W, SIN, COS, t_stride, seq, n_q, n_kv, hd, eps, HAS_W: tl.constexpr,
                             ROPE: tl.constexpr, NORM: tl.constexpr, SLOTS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        slots = n_q + 2 * n_kv
        s = tl.arange(0, SLOTS)[:, None]
        c = tl.arange(0, BLOCK)[None, :]
        mask = (s < slots) & (c < hd)
        u = tl.load(T + row * t_stride + s * hd + c, mask=mask, other=0.0).to(tl.float32)
        if NORM:
            r = 1.0 / tl.sqrt(tl.sum(u * u, axis=1) / hd + eps)
            tl.store(R + row * slots + tl.arange(0, SLOTS), r, mask=tl.arange(0, SLOTS) < slots)
        else:
            r = tl.full([SLOTS], 1.0, tl.float32)
        out = u * r[:, None]
        if HAS_W:
            out = out * tl.load(W + s * hd + c, mask=mask, other=0.0)
        if ROPE:  # q and k turned at the token's position: rotate_half's partner column read again, normalised alike
            half = hd // 2
            p = tl.where(c < half, c + half, c - half)
            partner = tl.load(T + row * t_stride + s * hd + p, mask=mask, other=0.0).to(tl.float32) * r[:, None]
            if HAS_W:
                partner = partner * tl.load(W + s * hd + p, mask=mask, other=0.0)
            pos = row % seq
            sn = tl.load(SIN + pos * hd + c, mask=c < hd, other=0.0)
            cs = tl.load(COS + pos * hd + c, mask=c < hd, other=0.0)
            out = tl.where(s < n_q + n_kv, out * cs + tl.where(c < half, -1.0, 1.0) * partner * sn, out)
        # q, k and v each to a tensor of its own: attention keeps them, and the backward reads them back
        tl.store(Q + row * n_q * hd + s * hd + c, out.to(Q.dtype.element_ty), mask=mask & (s < n_q))
        tl.store(K + row * n_kv * hd + (s - n_q) * hd + c, out.to(K.dtype.element_ty),
                 mask=mask & (s >= n_q) & (s < n_q + n_kv))
        tl.store(V + row * n_kv * hd + (s - n_q - n_kv) * hd + c, out.to(V.dtype.element_ty),
                 mask=mask & (s >= n_q + n_kv))

    @triton.jit
    def _head_backward_kernel(Q, K, V, R, DQ, DK, DV, DT, W, PW, SIN, COS, seq, rows, n_q, n_kv, hd,
                              HAS_W: tl.constexpr, ROPE: tl.constexpr, NORM: tl.constexpr,
                              ROWS_PER_PROGRAM: tl.constexpr, SLOTS: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        slots = n_q + 2 * n_kv
        s = tl.arange(0, SLOTS)[:, None]
        c = tl.arange(0, BLOCK)[None, :]
        mask = (s < slots) & (c < hd)
        half = hd // 2
        p = tl.where(c < half, c + half, c - half)
        sign = tl.where(c < half, -1.0, 1.0)
        w = tl.load(W + s * hd + c, mask=mask, other=0.0) if HAS_W else tl.zeros([SLOTS, BLOCK], tl.float32)
        acc = tl.zeros([SLOTS, BLOCK], tl.float32)
        for i in range(ROWS_PER_PROGRAM):
            row = (pid * ROWS_PER_PROGRAM + i).to(tl.int64)
            m = mask & (row < rows)
            g = _slot_load(DQ, DK, DV, row, s, c, n_q, n_kv, hd, m)
            if ROPE:  # the gradient through the rotation's transpose
                pos = row % seq
                sn = tl.load(SIN + pos * hd + c, mask=c < hd, other=0.0)
                cs = tl.load(COS + pos * hd + c, mask=c < hd, other=0.0)
                turned = s < n_q + n_kv
                g = tl.where(turned, g * cs - sign * _slot_load(DQ, DK, DV, row, s, p, n_q, n_kv, hd, m) * sn, g)
            if NORM:  # the output turned back too (the norm's output), then the norm's backward
                o = _slot_load(Q, K, V, row, s, c, n_q, n_kv, hd, m)
                if ROPE:
                    o = tl.where(turned, o * cs - sign * _slot_load(Q, K, V, row, s, p, n_q, n_kv, hd, m) * sn, o)
                r = tl.load(R + row * slots + s, mask=(s < slots) & (row < rows), other=0.0)
                if HAS_W:
                    u_hat = tl.where(w != 0.0, o / w, 0.0)
                    gw = g * w
                    acc += g * u_hat
                else:
                    u_hat = o
                    gw = g
                du = r * (gw - u_hat * (tl.sum(gw * u_hat, axis=1) / hd)[:, None])
            else:
                du = g
            tl.store(DT + row * slots * hd + s * hd + c, du.to(DT.dtype.element_ty), mask=m)
        if HAS_W:
            tl.store(PW + pid * slots * hd + s * hd + c, acc, mask=mask)


def _head_forward_impl(qkv, table, rope, n_q, n_kv, head_dim, eps,
                       normalise=True) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    if not _use_triton(qkv):
        return _head_forward_torch(qkv, table, rope, n_q, n_kv, head_dim, eps, normalise)
    slots = n_q + 2 * n_kv
    rows_t, stride = _rows(qkv, slots * head_dim)
    rows = rows_t.shape[0]
    q = torch.empty((rows, n_q * head_dim), dtype=qkv.dtype, device=qkv.device)
    k, v = (torch.empty((rows, n_kv * head_dim), dtype=qkv.dtype, device=qkv.device) for _ in range(2))
    rstd = torch.empty((rows, slots) if normalise else (0,), dtype=torch.float32, device=qkv.device)
    sin, cos = (t.float().contiguous() for t in rope) if rope is not None else (q, q)
    _head_forward_kernel[(rows,)](rows_t, q, k, v, rstd if normalise else q, table if table is not None else q, sin,
                                  cos, stride, qkv.shape[-2] if qkv.dim() > 1 else 1, n_q, n_kv, head_dim, float(eps),
                                  HAS_W=table is not None, ROPE=rope is not None, NORM=normalise,
                                  SLOTS=triton.next_power_of_2(slots), BLOCK=triton.next_power_of_2(head_dim))
    lead = qkv.shape[:-1]
    return q.view(*lead, -1), k.view(*lead, -1), v.view(*lead, -1), (rstd.view(*lead, slots) if normalise else rstd)


def _head_backward_impl(outs, grads, rstd, table, rope, n_q, n_kv, head_dim) -> Tuple[Tensor, Optional[Tensor]]:
    """(d qkv, d table) from the op's outputs (q, k, v), rstd and their gradients (``outs`` None: RoPE only, no
    norm): d qkv in fp32 on the torch path, in the gradients' dtype from the kernel (computed in fp32, written once);
    d table's partial sums in fp32."""
    if not _use_triton(grads[0]):
        return _head_backward_torch(outs, grads, rstd, table, rope, n_q, n_kv, head_dim)
    slots = n_q + 2 * n_kv
    lead = grads[0].shape[:-1]
    dq, dk, dv = (t.reshape(-1, t.shape[-1]).contiguous() for t in grads)
    q, k, v = (t.reshape(-1, t.shape[-1]).contiguous() for t in outs) if outs is not None else (dq, dk, dv)
    rows = dq.shape[0]
    dt = torch.empty((rows, slots * head_dim), dtype=dq.dtype, device=dq.device)
    per = min(_ROWS_PER_PROGRAM, rows)
    programs = triton.cdiv(rows, per)
    partial = torch.empty((programs, slots, head_dim), dtype=torch.float32, device=dq.device) \
        if table is not None else dt
    sin, cos = (t.float().contiguous() for t in rope) if rope is not None else (dt, dt)
    _head_backward_kernel[(programs,)](q, k, v, rstd.contiguous() if outs is not None else dt, dq, dk, dv, dt,
                                       table if table is not None else dt, partial, sin, cos,
                                       lead[-1] if lead else 1, rows, n_q, n_kv, head_dim, HAS_W=table is not None,
                                       ROPE=rope is not None, NORM=outs is not None, ROWS_PER_PROGRAM=per,
                                       SLOTS=triton.next_power_of_2(slots), BLOCK=triton.next_power_of_2(head_dim),
                                       num_warps=_HEAD_WARPS)
    return dt.view(*lead, slots * head_dim), (partial.sum(0) if table is not None else None)


@torch.library.custom_op(f"{NAMESPACE}::head_norm_forward", mutates_args=())
def _head_norm_forward(qkv: Tensor, q_weight: Opt, k_weight: Opt, v_weight: Opt, sin: Opt, cos: Opt, n_q: int,
                       n_kv: int, head_dim: int, eps: float, normalise: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(q, k, v, rstd): rstd (..., slots) fp32, what the backward needs beside the outputs (empty without
    ``normalise``: RoPE only)."""
    table = _head_table(q_weight, k_weight, v_weight, n_q, n_kv)
    return _head_forward_impl(qkv, table, (sin, cos) if sin is not None else None, n_q, n_kv, head_dim, eps,
                              normalise)


@_head_norm_forward.register_fake
def _(qkv, q_weight, k_weight, v_weight, sin, cos, n_q, n_kv, head_dim, eps, normalise):
    lead = qkv.shape[:-1]
    return qkv.new_empty(*lead, n_q * head_dim), qkv.new_empty(*lead, n_kv * head_dim), \
        qkv.new_empty(*lead, n_kv * head_dim), \
        (qkv.new_empty(*lead, n_q + 2 * n_kv, dtype=torch.float32) if normalise else _empty(qkv).float())


@torch.library.custom_op(f"{NAMESPACE}::head_norm_backward", mutates_args=())
def _head_norm_backward(q: Opt, k: Opt, v: Opt, rstd: Opt, dq: Tensor, dk: Tensor, dv: Tensor, q_weight: Opt,
                        k_weight: Opt, v_weight: Opt, sin: Opt, cos: Opt, n_q: int, n_kv: int,
                        head_dim: int) -> List[Tensor]:
    """(d qkv, d q_weight, d k_weight, d v_weight) from the forward's outputs (None: RoPE only, no norm); the
    weights' empty without weights."""
    weights = (q_weight, k_weight, v_weight)
    dqkv, dtable = _head_backward_impl((q, k, v) if q is not None else None, (dq, dk, dv), rstd,
                                       _head_table(*weights, n_q, n_kv), (sin, cos) if sin is not None else None,
                                       n_q, n_kv, head_dim)
    if dtable is None:
        return [dqkv.to(dq.dtype), _empty(dq), _empty(dq), _empty(dq)]
    grads = [part.sum(0) for part in dtable.split([n_q, n_kv, n_kv])]  # each slot's into its group's weight
    return [dqkv.to(dq.dtype)] + [g.to(w.dtype) for g, w in zip(grads, weights)]


@_head_norm_backward.register_fake
def _(q, k, v, rstd, dq, dk, dv, q_weight, k_weight, v_weight, sin, cos, n_q, n_kv, head_dim):
    weights = (q_weight, k_weight, v_weight)
    return [dq.new_empty(*dq.shape[:-1], (n_q + 2 * n_kv) * head_dim)] + \
        [w.new_empty(w.shape) if w is not None else _empty(dq) for w in weights]


def _head_setup(ctx, inputs, output):
    _, q_weight, k_weight, v_weight, sin, cos, n_q, n_kv, head_dim, _, normalise = inputs
    # the outputs, not qkv: attention keeps q, k and v itself, so the norm keeps nothing of its own but rstd (RoPE
    # alone needs neither)
    ctx.save_for_backward(*(output if normalise else (None,) * 4), q_weight, k_weight, v_weight, sin, cos)
    ctx.args = (n_q, n_kv, head_dim)
    ctx.set_materialize_grads(False)  # rstd gets no gradient: no zeros written for it


def _head_backward(ctx, dq, dk, dv, _drstd):
    q, k, v, rstd, *rest = ctx.saved_tensors
    n_q, n_kv, head_dim = ctx.args
    given = next(g for g in (dq, dk, dv) if g is not None)
    dq, dk, dv = (g if g is not None else given.new_zeros(*given.shape[:-1], n * head_dim)
                  for g, n in ((dq, n_q), (dk, n_kv), (dv, n_kv)))
    dqkv, *dw = _head_norm_backward(q, k, v, rstd, dq, dk, dv, *rest, n_q, n_kv, head_dim)
    return (dqkv, *(g if g.numel() else None for g in dw), None, None, None, None, None, None, None)


_head_norm_forward.register_autograd(_head_backward, setup_context=_head_setup)


def head_norm(qkv: Tensor, q_weight: Optional[Tensor], k_weight: Optional[Tensor], v_weight: Optional[Tensor], *,
              n_q: int, n_kv: int, head_dim: int, eps: float = 1e-5,
              rope: Optional[Tuple[Tensor, Tensor]] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """HybridNorm's per-head Q/K/V norms over the fused projection's output as one op each way
    (``siamesenorm::head_norm_forward`` / ``_backward``): ``head_reference``'s arithmetic, (q, k, v) each a tensor
    of its own; the weights all given or all None; ``rope`` = (sin, cos), each (T, head_dim) for qkv's T positions:
    q and k come back rotated too (one rounding to qkv's dtype, after the rotation).

    The backward recomputes from the outputs, not from qkv: attention keeps q, k and v for its own backward, so
    the op keeps only rstd (fp32, one number a head) beside them. It turns q and k back by RoPE's inverse and
    divides by the weight to recover the normalised input, u_hat = y / w: in bf16 that is u_hat to bf16's 8 bits
    (a relative error below 2^-8, which a quotient keeps), against fp32 when recomputed from qkv; the gradient it
    enters is written in bf16 anyway. Where a weight is exactly 0 its channel's u_hat is lost (y = 0): it is taken
    as 0, so that channel's weight gradient is 0 (a weight trained to exactly 0.0 in fp32 stays there)."""
    if (q_weight is None) != (k_weight is None) or (q_weight is None) != (v_weight is None):
        raise ValueError("head_norm takes the q, k and v weights all together or none of them")
    sin, cos = _rope_tables(qkv, rope, head_dim, "head_norm") if rope is not None else (None, None)
    return _head_norm_forward(qkv, q_weight, k_weight, v_weight, sin, cos, int(n_q), int(n_kv), int(head_dim),
                              float(eps), True)[:3]


def _rope_tables(qkv: Tensor, rope: Tuple[Tensor, Tensor], head_dim: int, who: str) -> Tuple[Tensor, Tensor]:
    """``rope`` as the op takes it, (sin, cos) each (T, head_dim) for qkv's T positions, or one line saying why not."""
    sin, cos = rope
    if qkv.dim() < 2 or sin.shape != (qkv.shape[-2], head_dim) or cos.shape != sin.shape or head_dim % 2:
        raise ValueError(f"{who}'s rope takes (sin, cos), each (T, head_dim) = ({qkv.shape[-2]}, {head_dim}) "
                         f"with head_dim even; got {tuple(sin.shape)} and {tuple(cos.shape)}")
    return sin, cos


def qkv_rope(qkv: Tensor, *, n_q: int, n_kv: int, head_dim: int,
             rope: Tuple[Tensor, Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
    """RoPE on the q and k heads of the fused projection's output, v copied, one op each way (``head_norm``'s op
    without the norm): (q, k, v) each a tensor of its own, so attention keeps those three and not qkv (which a v
    split off as a view would keep whole); the backward keeps nothing (it turns the gradients back by RoPE's
    transpose and writes d qkv whole). ``rope`` = (sin, cos), each (T, head_dim); fp32 inside, one rounding."""
    sin, cos = _rope_tables(qkv, rope, head_dim, "qkv_rope")
    return _head_norm_forward(qkv, None, None, None, sin, cos, int(n_q), int(n_kv), int(head_dim), 1e-5, False)[:3]


# ---- mHC's Sinkhorn-Knopp iterations in one kernel each way -----------------------------------------------------
def sinkhorn_reference(logits: Tensor, iterations: int, order: str = "columns_first") -> Tensor:
    """A doubly stochastic matrix from (..., n, n) logits: Sinkhorn-Knopp on exp(logits), log domain, fp32 (mHC's
    eager Sinkhorn, siamesenorm.nn.sinkhorn; autograd keeps every iterate).

    "columns_first" (the mHC paper's T_r(T_c(M)) per iteration): columns are normalised, then rows, so rows sum
    to 1 exactly and columns to within the iteration's tolerance. "rows_first" is the transpose of that order
    (columns end exact)."""
    first, second = (-2, -1) if order == "columns_first" else (-1, -2)
    log_p = logits.float()
    for _ in range(iterations):
        log_p = log_p - log_p.logsumexp(dim=first, keepdim=True)
        log_p = log_p - log_p.logsumexp(dim=second, keepdim=True)
    return log_p.exp()


def _sinkhorn_axes(columns_first: bool) -> Tuple[int, int]:
    """The dims normalised first and second in an iteration (siamesenorm.nn.sinkhorn's order)."""
    return (-2, -1) if columns_first else (-1, -2)


def _sinkhorn_steps(logits: Tensor, iterations: int, columns_first: bool) -> List[Tensor]:
    """Every half-step's iterate y_0 = logits (fp32), y_t = y_(t-1) - logsumexp(y_(t-1)) over the t-th dim."""
    axes = _sinkhorn_axes(columns_first)
    ys = [logits.float()]
    for t in range(2 * iterations):
        ys.append(ys[-1] - ys[-1].logsumexp(dim=axes[t % 2], keepdim=True))
    return ys


def _sinkhorn_grad(ys: List[Tensor], dp: Tensor, columns_first: bool) -> Tensor:
    """d logits from d P through the recorded iterates: d y_last = dP * P, then back through each half-step,
    d y_(t-1) = d y_t - exp(y_t) * sum(d y_t) over the dim that step normalised (softmax's Jacobian)."""
    axes = _sinkhorn_axes(columns_first)
    p = ys[-1].exp()
    dy = dp.float() * p
    for t in range(len(ys) - 1, 0, -1):
        dy = dy - ys[t].exp() * dy.sum(dim=axes[(t - 1) % 2], keepdim=True)
    return dy


if triton is not None:

    @triton.jit
    def _sinkhorn_half(y, valid, step, COLUMNS_FIRST: tl.constexpr):
        """One half-step on a (tokens, n, n) block: columns (axis 1) on even steps when COLUMNS_FIRST, else rows."""
        if (step % 2 == 0) == COLUMNS_FIRST:
            m = tl.max(y, axis=1)
            y = y - (m + tl.log(tl.sum(tl.exp(y - m[:, None, :]), axis=1)))[:, None, :]
        else:
            m = tl.max(y, axis=2)
            y = y - (m + tl.log(tl.sum(tl.exp(y - m[:, :, None]), axis=2)))[:, :, None]
        return tl.where(valid, y, -1.0e30)  # padding (n not a power of 2) stays out of every sum

    @triton.jit
    def _sinkhorn_load(L, tokens, n, BLOCK_T: tl.constexpr, N: tl.constexpr):
        tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None, None]
        i = tl.arange(0, N)[None, :, None]
        j = tl.arange(0, N)[None, None, :]
        valid = (tok < tokens) & (i < n) & (j < n)
        offs = tok * n * n + i * n + j
        return tl.load(L + offs, mask=valid, other=-1.0e30).to(tl.float32), valid, offs

    @triton.jit
    def _sinkhorn_forward_kernel(L, P, tokens, n, steps, COLUMNS_FIRST: tl.constexpr, BLOCK_T: tl.constexpr,
                                 N: tl.constexpr):
        y, valid, offs = _sinkhorn_load(L, tokens, n, BLOCK_T, N)
        for step in range(steps):
            y = _sinkhorn_half(y, valid, step, COLUMNS_FIRST)
        tl.store(P + offs, tl.exp(y), mask=valid)

    @triton.jit
    def _sinkhorn_backward_kernel(L, DP, DL, tokens, n, steps, COLUMNS_FIRST: tl.constexpr, BLOCK_T: tl.constexpr,
                                  N: tl.constexpr, SEGMENT: tl.constexpr):
        """Back through the half-steps from the last, in segments of SEGMENT half-steps from the last segment: a
        segment's first iterate is replayed from the logits, then each of its iterates from that one, all in
        registers (no memory traffic beyond logits, dP and d logits). At 40 half-steps and segments of 8 that is
        260 half-steps replayed, where replaying each iterate from the logits was 820 (on an H100 481 us a call at
        8,192 tokens of 4 streams: compute, for 2 MB)."""
        y0, valid, offs = _sinkhorn_load(L, tokens, n, BLOCK_T, N)
        dy = tl.load(DP + offs, mask=valid, other=0.0).to(tl.float32)
        segments = (steps + SEGMENT - 1) // SEGMENT
        for back_segment in range(segments):
            start = (segments - 1 - back_segment) * SEGMENT
            first = y0
            for step in range(start):
                first = _sinkhorn_half(first, valid, step, COLUMNS_FIRST)
            for back in range(tl.minimum(steps, start + SEGMENT) - start):
                t = tl.minimum(steps, start + SEGMENT) - back  # the iterate y_t, then the gradient through step t
                y = first
                for step in range(start, t):
                    y = _sinkhorn_half(y, valid, step, COLUMNS_FIRST)
                e = tl.where(valid, tl.exp(y), 0.0)
                if t == steps:
                    dy = dy * e  # d y_last = dP * P
                if ((t - 1) % 2 == 0) == COLUMNS_FIRST:
                    dy = dy - e * tl.sum(dy, axis=1)[:, None, :]
                else:
                    dy = dy - e * tl.sum(dy, axis=2)[:, :, None]
        tl.store(DL + offs, dy, mask=valid)


_SINKHORN_BLOCK_T = 64  # tokens a program
_SINKHORN_WARPS = 4
_SINKHORN_SEGMENT = 8  # the backward's replay segments, in half-steps


def _sinkhorn_launch(kernel, logits: Tensor, *tensors: Tensor, iterations: int, columns_first: bool,
                     **constants) -> None:
    n = logits.shape[-1]
    tokens = logits.numel() // (n * n)
    kernel[(triton.cdiv(tokens, _SINKHORN_BLOCK_T),)](logits, *tensors, tokens, n, 2 * iterations,
                                                     COLUMNS_FIRST=bool(columns_first), BLOCK_T=_SINKHORN_BLOCK_T,
                                                     N=triton.next_power_of_2(n), num_warps=_SINKHORN_WARPS,
                                                     **constants)


@torch.library.custom_op(f"{NAMESPACE}::sinkhorn_forward", mutates_args=())
def _sinkhorn_forward(logits: Tensor, iterations: int, columns_first: bool) -> Tensor:
    logits = logits.float().contiguous()
    if not _use_triton(logits):  # no autograd inside the op: the reference keeps no iterates here
        return sinkhorn_reference(logits, iterations, "columns_first" if columns_first else "rows_first")
    p = torch.empty_like(logits)
    _sinkhorn_launch(_sinkhorn_forward_kernel, logits, p, iterations=iterations, columns_first=columns_first)
    return p


@_sinkhorn_forward.register_fake
def _(logits, iterations, columns_first):
    return logits.new_empty(logits.shape, dtype=torch.float32)


@torch.library.custom_op(f"{NAMESPACE}::sinkhorn_backward", mutates_args=())
def _sinkhorn_backward(logits: Tensor, dp: Tensor, iterations: int, columns_first: bool) -> Tensor:
    logits, dp = logits.float().contiguous(), dp.float().contiguous()
    if not _use_triton(logits):
        return _sinkhorn_grad(_sinkhorn_steps(logits, iterations, columns_first), dp, columns_first)
    dl = torch.empty_like(logits)
    _sinkhorn_launch(_sinkhorn_backward_kernel, logits, dp, dl, iterations=iterations, columns_first=columns_first,
                     SEGMENT=_SINKHORN_SEGMENT)
    return dl


@_sinkhorn_backward.register_fake
def _(logits, dp, iterations, columns_first):
    return logits.new_empty(logits.shape, dtype=torch.float32)


def _sinkhorn_setup(ctx, inputs, output):
    logits, iterations, columns_first = inputs
    ctx.save_for_backward(logits)  # backward replays the iterations: nothing of them is kept
    ctx.args = (iterations, columns_first, logits.dtype)


def _sinkhorn_backward_autograd(ctx, dp):
    (logits,) = ctx.saved_tensors
    iterations, columns_first, dtype = ctx.args
    return _sinkhorn_backward(logits, dp, iterations, columns_first).to(dtype), None, None


_sinkhorn_forward.register_autograd(_sinkhorn_backward_autograd, setup_context=_sinkhorn_setup)


def sinkhorn(logits: Tensor, iterations: int, columns_first: bool = True) -> Tensor:
    """mHC's Sinkhorn-Knopp (siamesenorm.nn.sinkhorn's arithmetic: log domain, fp32) as one op each way
    (``siamesenorm::sinkhorn_forward`` / ``_backward``): (..., n, n) logits -> a doubly stochastic (..., n, n),
    fp32. Eager runs each of the 2 x ``iterations`` normalisations as several kernels and keeps every iterate
    for backward; the kernel keeps the whole iteration of a token in registers and backward keeps only the
    logits, replaying the iterations from them."""
    return _sinkhorn_forward(logits, int(iterations), bool(columns_first))


# ---- hc's and mHC's depth connection with the stream mixing, one pass over the streams -------------------------
def mix_reference(h: Tensor, m: Tensor, b: Tensor, f: Tensor) -> Tensor:
    """The streams after a sublayer of hc / mHC: out_j = sum_s m[..., j, s] h_s + b_j f, for ``h`` (..., n, d), the
    mixing ``m`` (..., n, n) (mHC's H_res; hc's A[s, 1+j] as m[j, s]), the output weights ``b`` (..., n) and the
    sublayer's output ``f`` (..., d); fp32 inside, out in h's dtype."""
    mixed = torch.einsum("...js,...sd->...jd", m.float(), h.float())
    return (mixed + b.float()[..., None] * f.float()[..., None, :]).to(h.dtype)


def _mix_grads(h: Tensor, m: Tensor, b: Tensor, f: Tensor, g: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dh, dm, db, df) of ``mix_reference`` given d out = g, written out (fp32): dh_s = sum_j m[j, s] g_j,
    dm[j, s] = <g_j, h_s>, db_j = <g_j, f>, df = sum_j b_j g_j."""
    g, m, b = g.float(), m.float(), b.float()
    return (torch.einsum("...js,...jd->...sd", m, g), torch.einsum("...jd,...sd->...js", g, h.float()),
            torch.einsum("...jd,...d->...j", g, f.float()), torch.einsum("...j,...jd->...d", b, g))


if triton is not None:

    @triton.jit
    def _mix_forward_kernel(H, M, B, F, OUT, tokens, n, d, h_tok, h_str, f_tok, BLOCK_T: tl.constexpr,
                            N: tl.constexpr, BLOCK_D: tl.constexpr):
        """A (tokens, streams, features) tile: out_j = sum_s m[j, s] h_s + b_j f, each h_s and f read once."""
        tok = (tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T))[:, None, None]
        j = tl.arange(0, N)[None, :, None]
        c = (tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D))[None, None, :]
        tj, tc = (tok < tokens) & (j < n), (tok < tokens) & (c < d)
        f = tl.load(F + tok * f_tok + c, mask=tc, other=0.0).to(tl.float32)
        acc = tl.load(B + tok * n + j, mask=tj, other=0.0).to(tl.float32) * f
        for s in tl.static_range(N):
            m_s = tl.load(M + tok * n * n + j * n + s, mask=tj & (s < n), other=0.0).to(tl.float32)  # m[:, s]
            h_s = tl.load(H + tok * h_tok + s * h_str + c, mask=tc & (s < n), other=0.0).to(tl.float32)
            acc += m_s * h_s
        tl.store(OUT + tok * n * d + j * d + c, acc.to(OUT.dtype.element_ty), mask=tj & tc)

    @triton.jit
    def _mix_backward_kernel(H, M, B, F, G, DH, DM, DB, DF, tokens, n, d, h_tok, h_str, f_tok, g_tok,
                             BLOCK_T: tl.constexpr, N: tl.constexpr, BLOCK_D: tl.constexpr):
        """A block of tokens over all their features: dh and df written chunk by chunk, dm and db (sums over the
        features) kept in registers and written once."""
        tok = (tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T))[:, None, None]
        j = tl.arange(0, N)[None, :, None]
        k = tl.arange(0, N)[None, None, :]
        tj = (tok < tokens) & (j < n)
        b = tl.load(B + tok * n + j, mask=tj, other=0.0).to(tl.float32)
        dm = tl.zeros([BLOCK_T, N, N], tl.float32)
        db = tl.zeros([BLOCK_T, N, 1], tl.float32)
        for c0 in range(0, d, BLOCK_D):
            c = c0 + tl.arange(0, BLOCK_D)[None, None, :]
            tc = (tok < tokens) & (c < d)
            g = tl.load(G + tok * g_tok + j * d + c, mask=tj & tc, other=0.0).to(tl.float32)
            f = tl.load(F + tok * f_tok + c, mask=tc, other=0.0).to(tl.float32)
            tl.store(DF + tok * d + c, tl.sum(b * g, axis=1)[:, None, :].to(DF.dtype.element_ty), mask=tc)
            db += tl.sum(g * f, axis=2)[:, :, None]
            for s in tl.static_range(N):
                m_s = tl.load(M + tok * n * n + j * n + s, mask=tj & (s < n), other=0.0).to(tl.float32)
                h_s = tl.load(H + tok * h_tok + s * h_str + c, mask=tc & (s < n), other=0.0).to(tl.float32)
                tl.store(DH + tok * n * d + s * d + c, tl.sum(m_s * g, axis=1)[:, None, :].to(DH.dtype.element_ty),
                         mask=tc & (s < n))
                dm += tl.where(k == s, tl.sum(g * h_s, axis=2)[:, :, None], 0.0)
        tl.store(DM + tok * n * n + j * n + k, dm, mask=tj & (k < n))
        tl.store(DB + tok * n + j, db, mask=tj)


_MIX_BLOCK_T = 16  # tokens a program


def _streams_view(h: Tensor) -> Tuple[Tensor, int, int]:
    """(h as (tokens, n, d), token stride, stream stride): read in place when its features are contiguous and its
    token dims collapse to one stride (a stacked state, or block 0's embedding widened with stream stride 0)."""
    lead, strides = h.shape[:-2], h.stride()[:-2]
    n, d = h.shape[-2:]
    if h.stride(-1) == 1 and lead and all(strides[i] == strides[i + 1] * lead[i + 1] for i in range(len(lead) - 1)):
        return h.as_strided((h.numel() // (n * d), n, d), (strides[-1], h.stride(-2), 1)), strides[-1], h.stride(-2)
    h = h.contiguous().view(-1, n, d)
    return h, n * d, d


def _mix_forward_impl(h: Tensor, m: Tensor, b: Tensor, f: Tensor) -> Tensor:
    if not _use_triton(h):
        return mix_reference(h, m, b, f)
    n, d = h.shape[-2:]
    hv, h_tok, h_str = _streams_view(h)
    tokens = hv.shape[0]
    fv, f_tok = _rows(f, d)
    out = torch.empty((tokens, n, d), dtype=h.dtype, device=h.device)
    block_d = min(128, triton.next_power_of_2(d))
    grid = (triton.cdiv(tokens, _MIX_BLOCK_T), triton.cdiv(d, block_d))
    _mix_forward_kernel[grid](hv, m.float().contiguous(), b.float().contiguous(), fv, out, tokens, n, d, h_tok, h_str,
                              f_tok, BLOCK_T=_MIX_BLOCK_T, N=triton.next_power_of_2(n), BLOCK_D=block_d)
    return out.view(h.shape)


def _mix_backward_impl(h: Tensor, m: Tensor, b: Tensor, f: Tensor, g: Tensor):
    if not _use_triton(h):
        return _mix_grads(h, m, b, f, g)
    n, d = h.shape[-2:]
    hv, h_tok, h_str = _streams_view(h)
    tokens = hv.shape[0]
    fv, f_tok = _rows(f, d)
    gv, g_tok, _ = _streams_view(g.contiguous())
    dh = torch.empty((tokens, n, d), dtype=h.dtype, device=h.device)  # written in the dtypes returned: no cast
    df = torch.empty((tokens, d), dtype=f.dtype, device=h.device)
    dm = torch.empty((tokens, n, n), dtype=torch.float32, device=h.device)
    db = torch.empty((tokens, n), dtype=torch.float32, device=h.device)
    _mix_backward_kernel[(triton.cdiv(tokens, _MIX_BLOCK_T),)](
        hv, m.float().contiguous(), b.float().contiguous(), fv, gv, dh, dm, db, df, tokens, n, d, h_tok, h_str, f_tok,
        g_tok, BLOCK_T=_MIX_BLOCK_T, N=triton.next_power_of_2(n), BLOCK_D=min(64, triton.next_power_of_2(d)))
    return dh.view(h.shape), dm.view(m.shape), db.view(b.shape), df.view(f.shape)


@torch.library.custom_op(f"{NAMESPACE}::stream_mix_forward", mutates_args=())
def _stream_mix_forward(h: Tensor, m: Tensor, b: Tensor, f: Tensor) -> Tensor:
    return _mix_forward_impl(h, m, b, f)


@_stream_mix_forward.register_fake
def _(h, m, b, f):
    return h.new_empty(h.shape)


@torch.library.custom_op(f"{NAMESPACE}::stream_mix_backward", mutates_args=())
def _stream_mix_backward(h: Tensor, m: Tensor, b: Tensor, f: Tensor, g: Tensor) -> List[Tensor]:
    """(dh, dm, db, df), each in its input's dtype."""
    grads = _mix_backward_impl(h, m, b, f, g)
    return [grad.to(t.dtype) for grad, t in zip(grads, (h, m, b, f))]


@_stream_mix_backward.register_fake
def _(h, m, b, f, g):
    return [t.new_empty(t.shape) for t in (h, m, b, f)]


def _mix_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)  # the carried streams, the coefficients and the sublayer's output: no new tensor


def _mix_backward(ctx, g):
    return tuple(_stream_mix_backward(*ctx.saved_tensors, g))


_stream_mix_forward.register_autograd(_mix_backward, setup_context=_mix_setup)


def stream_mix(h: Tensor, m: Tensor, b: Tensor, f: Tensor) -> Tensor:
    """hc's and mHC's depth connection with the stream mixing as one op each way (``siamesenorm::stream_mix_forward``
    / ``_backward``; ``mix_reference``'s arithmetic): out_j = sum_s m[..., j, s] h_s + b_j f. Eager mixes the streams
    into a tensor of their own, scales f into n copies and adds the two (three (..., n, d) tensors written); the
    kernel reads h and f once and writes out once, and backward keeps only its inputs."""
    if h.shape[:-1] != b.shape or m.shape != (*b.shape, b.shape[-1]) or f.shape != (*h.shape[:-2], h.shape[-1]):
        raise ValueError(f"stream_mix takes h (..., n, d), m (..., n, n), b (..., n), f (..., d); got "
                         f"{tuple(h.shape)}, {tuple(m.shape)}, {tuple(b.shape)}, {tuple(f.shape)}")
    return _stream_mix_forward(h, m, b, f)


# ---- hc's and mHC's coefficient projection: RMSNorm(x) @ P with the norm's division after the product ----------
def project_reference(x: Tensor, wp: Tensor, eps: float = 1e-5) -> Tensor:
    """The coefficient logits of hc / mHC: RMSNorm(x) @ wp for rows ``x`` (..., N) and ``wp`` (N, K) (the norm's
    weight already folded in, w[:, None] * P), fp32 inside and out: (x @ wp) * rstd(x), rstd = (mean(x^2) + eps)^-1/2
    over each row."""
    xf = x.float()
    return (xf @ wp.float()) * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


if triton is not None:

    @triton.jit
    def _project_forward_kernel(X, W, LOG, RSTD, rows, n, k, x_row, eps, BLOCK_R: tl.constexpr,
                                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
        """BLOCK_R rows over all their N features in chunks: the product with W (fp32, accumulated in fp32 from x
        in its own dtype) and the sum of squares in one read of x; the logits scaled by rstd once, at the end."""
        r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        kk = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_R, BLOCK_K], tl.float32)
        ss = tl.zeros([BLOCK_R], tl.float32)
        for c0 in range(0, n, BLOCK_N):
            c = c0 + tl.arange(0, BLOCK_N)
            x = tl.load(X + r[:, None] * x_row + c[None, :], mask=(r[:, None] < rows) & (c[None, :] < n),
                        other=0.0).to(tl.float32)
            w = tl.load(W + c[:, None] * k + kk[None, :], mask=(c[:, None] < n) & (kk[None, :] < k),
                        other=0.0).to(tl.float32)
            acc += tl.dot(x, w, input_precision=PRECISION)
            ss += tl.sum(x * x, axis=1)
        rstd = 1.0 / tl.sqrt(ss / n + eps)
        tl.store(LOG + r[:, None] * k + kk[None, :], acc * rstd[:, None], mask=(r[:, None] < rows) & (kk[None, :] < k))
        tl.store(RSTD + r, rstd, mask=r < rows)

    @triton.jit
    def _project_dx_kernel(X, W, LOG, RSTD, DLOG, DX, rows, n, k, x_row, BLOCK_R: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                           CHUNKS: tl.constexpr):
        """dx = (dlog rstd) @ W^T - rstd^2 <dlog, logits> x / N, BLOCK_R rows by CHUNKS x BLOCK_N features, x read
        once and dx written once in x's dtype (computed in fp32). Each row's dlog, logits and rstd (K + 1 values,
        in L2 at every size) are read by each of its feature programs: the rows' features need no reduction, so
        they spread over programs (a whole row a program left an H100's memory system mostly idle)."""
        r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        first = tl.program_id(1) * (CHUNKS * BLOCK_N)
        kk = tl.arange(0, BLOCK_K)
        rk = (r[:, None] < rows) & (kk[None, :] < k)
        rstd = tl.load(RSTD + r, mask=r < rows, other=0.0)
        dlog = tl.load(DLOG + r[:, None] * k + kk[None, :], mask=rk, other=0.0).to(tl.float32)
        logits = tl.load(LOG + r[:, None] * k + kk[None, :], mask=rk, other=0.0)
        g = dlog * rstd[:, None]
        coef = tl.sum(dlog * logits, axis=1) * rstd * rstd / n
        for j in range(0, CHUNKS):
            c = first + j * BLOCK_N + tl.arange(0, BLOCK_N)
            m = (r[:, None] < rows) & (c[None, :] < n)
            x = tl.load(X + r[:, None] * x_row + c[None, :], mask=m, other=0.0).to(tl.float32)
            wt = tl.load(W + c[None, :] * k + kk[:, None], mask=(c[None, :] < n) & (kk[:, None] < k),
                         other=0.0).to(tl.float32)  # W^T chunk (BLOCK_K, BLOCK_N)
            dx = tl.dot(g, wt, input_precision=PRECISION) - coef[:, None] * x
            tl.store(DX + r[:, None] * n + c[None, :], dx.to(DX.dtype.element_ty), mask=m)

    @triton.jit
    def _project_dw_kernel(X, RSTD, DLOG, PW, rows, n, k, x_row, rows_per_split, BLOCK_R: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
        """dW's partial sum over one split of the rows for BLOCK_N features: sum_r x[r]^T (dlog[r] rstd[r]), fp32;
        the splits' partials are summed after (a few MB)."""
        c = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        split = tl.program_id(1)
        kk = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for r0 in range(0, rows_per_split, BLOCK_R):
            i = r0 + tl.arange(0, BLOCK_R)
            r = split.to(tl.int64) * rows_per_split + i
            live = (r < rows) & (i < rows_per_split)
            xt = tl.load(X + r[None, :] * x_row + c[:, None], mask=live[None, :] & (c[:, None] < n),
                         other=0.0).to(tl.float32)  # x^T chunk (BLOCK_N, BLOCK_R)
            rstd = tl.load(RSTD + r, mask=live, other=0.0)
            g = tl.load(DLOG + r[:, None] * k + kk[None, :], mask=live[:, None] & (kk[None, :] < k),
                        other=0.0).to(tl.float32) * rstd[:, None]
            acc += tl.dot(xt, g, input_precision=PRECISION)
        tl.store(PW + split * n * k + c[:, None] * k + kk[None, :], acc, mask=(c[:, None] < n) & (kk[None, :] < k))


_PROJECT_BLOCK_R, _PROJECT_BLOCK_N = 32, 64  # rows a program; features a chunk
_PROJECT_DX_CHUNKS = 4  # dx: feature chunks a program (256 features)
_PROJECT_DW_PROGRAMS = 256  # dW: about this many (feature chunk, row split) programs

#: The launch sizes a GPU can tune (``scripts/benchmark.py --tune-kernels`` times the kernels with each changed;
#: the values set here, with _ROWS_PER_PROGRAM, _HEAD_WARPS, _SINKHORN_* and _MIX_BLOCK_T above, are what every
#: check and count uses).
TUNABLES = ("_ROWS_PER_PROGRAM", "_HEAD_WARPS", "_PROJECT_BLOCK_R", "_PROJECT_BLOCK_N", "_PROJECT_DX_CHUNKS",
            "_PROJECT_DW_PROGRAMS", "_SINKHORN_BLOCK_T", "_SINKHORN_WARPS", "_SINKHORN_SEGMENT", "_MIX_BLOCK_T",
            "_WIDTH_BLOCK_T", "_WIDTH_BLOCK_D")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _project_splits(rows: int, n: int) -> Tuple[int, int]:
    """(splits, rows a split) of dW's row loop: enough (feature chunk, split) programs to fill a GPU (about 256)
    when the features are few (hc's rows are d wide; at most 64 splits), each split a whole number of row blocks.
    The number of splits depends on N only, so that dW's partial sums are the same size at every token count (the
    compiled cost model carries two small samples linearly to the recipe's)."""
    splits = min(64, max(1, _cdiv(_PROJECT_DW_PROGRAMS, _cdiv(n, _PROJECT_BLOCK_N))))
    return splits, _cdiv(_cdiv(rows, _PROJECT_BLOCK_R), splits) * _PROJECT_BLOCK_R


def _project_sizes(k: int, x: Tensor) -> dict:
    """Block sizes, and the products' precision: for bf16 / fp16 rows (the streams under the recipes' autocast)
    TF32x3, three TF32 tensor-core products that carry fp32's accuracy (the rows are exact in TF32; W and dlog rstd
    split into two TF32 parts): at 2 K FLOPs a 2-byte element (24 a byte for mHC) fp32 FMAs would make the kernel
    compute-bound on an H100 (about 67 TFLOP/s against 3.35 TB/s: 20 a byte); IEEE fp32 for fp32 / fp64 rows (12
    FLOPs a byte or fewer: memory-bound either way; the fp64 check's 2e-5)."""
    precision = "tf32x3" if x.dtype in (torch.bfloat16, torch.float16) else "ieee"
    return dict(BLOCK_R=_PROJECT_BLOCK_R, BLOCK_N=_PROJECT_BLOCK_N, BLOCK_K=max(16, triton.next_power_of_2(k)),
                PRECISION=precision)


def _project_forward_impl(x: Tensor, wp: Tensor, eps: float) -> Tuple[Tensor, Tensor]:
    n, k = wp.shape
    if not _use_triton(x):
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
        return (xf @ wp.float()) * rstd[..., None], rstd
    xv, x_row = _rows(x, n)
    rows = xv.shape[0]
    logits = torch.empty((rows, k), dtype=torch.float32, device=x.device)
    rstd = torch.empty((rows,), dtype=torch.float32, device=x.device)
    _project_forward_kernel[(triton.cdiv(rows, _PROJECT_BLOCK_R),)](
        xv, wp.float().contiguous(), logits, rstd, rows, n, k, x_row, eps, **_project_sizes(k, x))
    return logits.view(*x.shape[:-1], k), rstd.view(x.shape[:-1])


def _project_dx_impl(x: Tensor, wp: Tensor, logits: Tensor, rstd: Tensor, dlog: Tensor) -> Tensor:
    n, k = wp.shape
    if not _use_triton(x):
        xf, dlog = x.float().reshape(-1, n), dlog.float().reshape(-1, k)
        rstd = rstd.reshape(-1, 1)
        coef = (dlog * logits.reshape(-1, k)).sum(-1, keepdim=True) * rstd.square() / n
        return ((dlog * rstd) @ wp.float().t() - coef * xf).view(x.shape)
    xv, x_row = _rows(x, n)
    rows = xv.shape[0]
    dlog, logits, rstd = (t.float().contiguous().view(rows, -1) for t in (dlog, logits, rstd))
    dx = torch.empty((rows, n), dtype=x.dtype, device=x.device)  # written in x's dtype: no cast
    grid = (triton.cdiv(rows, _PROJECT_BLOCK_R), triton.cdiv(n, _PROJECT_DX_CHUNKS * _PROJECT_BLOCK_N))
    _project_dx_kernel[grid](xv, wp.float().contiguous(), logits, rstd, dlog, dx, rows, n, k, x_row,
                             CHUNKS=_PROJECT_DX_CHUNKS, **_project_sizes(k, x))
    return dx.view(x.shape)


def _project_dw_impl(x: Tensor, rstd: Tensor, dlog: Tensor) -> Tensor:
    k = dlog.shape[-1]
    n = x.shape[-1]
    rows = x.numel() // n
    splits, per_split = _project_splits(rows, n)
    if not _use_triton(x):  # the whole sum in the first split's place, zeros in the others'
        xf, g = x.float().reshape(rows, n), dlog.float().reshape(rows, k) * rstd.reshape(rows, 1)
        return torch.cat([(xf.t() @ g)[None], xf.new_zeros(splits - 1, n, k)])
    xv, x_row = _rows(x, n)
    partial = torch.empty((splits, n, k), dtype=torch.float32, device=x.device)
    _project_dw_kernel[(triton.cdiv(n, _PROJECT_BLOCK_N), splits)](
        xv, rstd.float().contiguous().view(rows), dlog.float().contiguous().view(rows, k), partial, rows, n, k, x_row,
        per_split, **_project_sizes(k, x))
    return partial


@torch.library.custom_op(f"{NAMESPACE}::project_forward", mutates_args=())
def _project_forward(x: Tensor, wp: Tensor, eps: float) -> Tuple[Tensor, Tensor]:
    """(logits (..., K) fp32, rstd (...) fp32)."""
    return _project_forward_impl(x, wp, eps)


@_project_forward.register_fake
def _(x, wp, eps):
    return (x.new_empty((*x.shape[:-1], wp.shape[-1]), dtype=torch.float32),
            x.new_empty(x.shape[:-1], dtype=torch.float32))


@torch.library.custom_op(f"{NAMESPACE}::project_backward_x", mutates_args=())
def _project_backward_x(x: Tensor, wp: Tensor, logits: Tensor, rstd: Tensor, dlog: Tensor) -> Tensor:
    """dx in x's dtype (one kernel)."""
    return _project_dx_impl(x, wp, logits, rstd, dlog).to(x.dtype)


@_project_backward_x.register_fake
def _(x, wp, logits, rstd, dlog):
    return x.new_empty(x.shape)


@torch.library.custom_op(f"{NAMESPACE}::project_backward_w", mutates_args=())
def _project_backward_w(x: Tensor, rstd: Tensor, dlog: Tensor) -> Tensor:
    """dW's fp32 partial sums over the row splits, (splits, N, K) (one kernel; the caller sums them)."""
    return _project_dw_impl(x, rstd, dlog)


@_project_backward_w.register_fake
def _(x, rstd, dlog):
    splits, _ = _project_splits(x.numel() // x.shape[-1], x.shape[-1])
    return x.new_empty((splits, x.shape[-1], dlog.shape[-1]), dtype=torch.float32)


def _project_setup(ctx, inputs, output):
    x, wp, _eps = inputs
    ctx.save_for_backward(x, wp, *output)  # x (the caller keeps it anyway), and the logits and rstd: no recompute
    ctx.set_materialize_grads(False)


def _project_backward_autograd(ctx, dlog, _drstd):
    x, wp, logits, rstd = ctx.saved_tensors
    if dlog is None:
        return None, None, None
    dx = _project_backward_x(x, wp, logits, rstd, dlog) if ctx.needs_input_grad[0] else None
    dw = _project_backward_w(x, rstd, dlog).sum(0).to(wp.dtype) if ctx.needs_input_grad[1] else None
    return dx, dw, None


_project_forward.register_autograd(_project_backward_autograd, setup_context=_project_setup)


def rms_project(x: Tensor, wp: Tensor, eps: float = 1e-5) -> Tensor:
    """``project_reference``'s logits, RMSNorm(x) @ wp = (x @ wp) * rstd(x), fp32, as one op each way
    (``siamesenorm::project_forward`` / ``_backward_x`` / ``_backward_w``): one kernel reads x once in its own dtype
    (no fp32 copy of it written) for the product, accumulated in fp32 against fp32 ``wp`` (on a GPU in TF32 for
    bf16 rows, ``_project_sizes``), and the sum of squares; backward one kernel
    for dx (x read once, dx written once in x's dtype) and one for dW (x read once more, fp32 partial sums over
    row splits, summed after: a few MB). Eager writes x's fp32 copy, reads it for the product, and reads x again for rstd (and
    backward the same again); hc's and mHC's coefficients (``rstd`` the rows' own: hc's per stream, mHC's over the
    flattened streams)."""
    if wp.dim() != 2 or x.shape[-1] != wp.shape[0]:
        raise ValueError(f"rms_project takes x (..., N) and wp (N, K); got {tuple(x.shape)} and {tuple(wp.shape)}")
    return _project_forward(x, wp, float(eps))[0]


# ---- hc's and mHC's width connection: coefficients, branch input and the branch's Pre-Norm, one pass over the streams
def _input_coefficients(logits: Tensor, a_static: Tensor, a_scale: Tensor, flat: bool) -> Tensor:
    """The input coefficients a (..., n) from the logits, fp32: hc (per stream, ``flat`` False) a_s = a_static[s] +
    a_scale tanh(L[s, 0]); mHC (over the flattened streams) a_s = sigmoid(a_scale L[s] + a_static[s])."""
    n = a_static.shape[0]
    if flat:
        return torch.sigmoid(a_scale.float() * logits[..., :n] + a_static.float())
    return a_static.float() + a_scale.float() * torch.tanh(logits[..., 0])


def _folded(proj: Tensor, proj_weight: Optional[Tensor]) -> Tensor:
    """The projection with the coefficient norm's weight folded in, w[:, None] * P, fp32 (a temporary of the
    parameters' size, never kept: the ops take P and w and fold them in each pass)."""
    return proj.float() if proj_weight is None else proj_weight.float()[:, None] * proj.float()


def width_reference(h: Tensor, proj: Tensor, a_static: Tensor, a_scale: Tensor, in_weight: Optional[Tensor] = None,
                    eps: float = 1e-5, in_eps: float = 1e-5, flat: bool = False,
                    proj_weight: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """A width connection with its branch's Pre-Norm, for the streams ``h`` (..., n, d): the coefficient logits, the
    input coefficients a (``_input_coefficients``) and the sublayer's input RMSNorm(sum_s a_s h_s) (times
    ``in_weight``). hc (``flat`` False): L = RMSNorm(h_s) @ wp per stream, (..., n, k), wp (d, k); mHC (``flat``):
    L = RMSNorm(flatten(h)) @ wp per token, (..., k), wp (n d, k); ``project_reference``'s logits, wp = the norm's
    weight ``proj_weight`` (or none) folded into ``proj``. Returns (L fp32, input in h's dtype); fp32 inside. The
    other coefficients (mixing, output weights) are small functions of L the caller computes."""
    logits = project_reference(h.flatten(-2) if flat else h, _folded(proj, proj_weight), eps)
    a0 = _input_coefficients(logits, a_static, a_scale, flat)
    inp = (a0[..., None] * h.float()).sum(-2)
    out = inp * torch.rsqrt(inp.pow(2).mean(-1, keepdim=True) + in_eps)
    return logits, (out if in_weight is None else out * in_weight.float()).to(h.dtype)


def _width_grads_torch(h, wp, a_static, a_scale, in_weight, logits, rstd, rin, dlog, dinp, flat):
    """The width op's backward in plain torch, the kernel's arithmetic (fp32): (dh, the logits' whole gradient, d a
    per token (..., n), the input norm's weight gradient (1, d) or None)."""
    n, d = h.shape[-2:]
    hf, logits, rstd, rin = h.float(), logits.float(), rstd.float(), rin.float()
    a0 = _input_coefficients(logits, a_static, a_scale, flat)
    inp = (a0[..., None] * hf).sum(-2)
    g = dinp.float() if in_weight is None else dinp.float() * in_weight.float()
    cf = rin.square() * (g * inp).sum(-1) / d
    d_inp = rin[..., None] * (g - inp * cf[..., None])
    da0 = (d_inp[..., None, :] * hf).sum(-1)
    dlt = dlog.float().clone()
    if flat:
        dlt[..., :n] += da0 * a0 * (1 - a0) * a_scale.float()
        coef = (dlt * logits).sum(-1) * rstd.square() / (n * d)
        dproj = ((dlt * rstd[..., None]) @ wp.float().t()).unflatten(-1, (n, d))
        dh = a0[..., None] * d_inp[..., None, :] + dproj - coef[..., None, None] * hf
    else:
        dlt[..., 0] += da0 * a_scale.float() * (1 - torch.tanh(logits[..., 0]).square())
        coef = (dlt * logits).sum(-1) * rstd.square() / d
        dh = a0[..., None] * d_inp[..., None, :] + (dlt * rstd[..., None]) @ wp.float().t() - coef[..., None] * hf
    dwin = None if in_weight is None else (dinp.float() * inp * rin[..., None]).reshape(-1, d).sum(0, keepdim=True)
    return dh, dlt, da0, dwin


if triton is not None:

    @triton.jit
    def _tanh(x):
        return 2.0 * tl.sigmoid(2.0 * x) - 1.0

    @triton.jit
    def _width_rows(pid, tokens, n, h_tok, h_str, BLOCK_T: tl.constexpr, N: tl.constexpr):
        """A program's (token, stream) rows, BLOCK_T tokens of N (padded) streams: token, stream, live, offset."""
        r = tl.arange(0, BLOCK_T * N)
        t = pid.to(tl.int64) * BLOCK_T + r // N
        s = r % N
        live = (t < tokens) & (s < n)
        return t, s, live, t * h_tok + s * h_str

    @triton.jit
    def _per_token(v, BLOCK_T: tl.constexpr, N: tl.constexpr, BLOCK_D: tl.constexpr):
        """Rows' chunks (BLOCK_T * N, BLOCK_D) summed over each token's streams -> (BLOCK_T, BLOCK_D)."""
        return tl.sum(tl.reshape(v, [BLOCK_T, N, BLOCK_D]), axis=1)

    @triton.jit
    def _per_row(v, BLOCK_T: tl.constexpr, N: tl.constexpr, BLOCK_D: tl.constexpr):
        """A token's (BLOCK_T, BLOCK_D) values repeated for each of its streams -> (BLOCK_T * N, BLOCK_D)."""
        return tl.reshape(tl.broadcast_to(v[:, None, :], [BLOCK_T, N, BLOCK_D]), [BLOCK_T * N, BLOCK_D])

    @triton.jit
    def _in_weighted(dy, WIN, c, d, HAS_WIN: tl.constexpr):
        if HAS_WIN:
            return dy * tl.load(WIN + c, mask=c < d, other=0.0).to(tl.float32)[None, :]
        return dy

    @triton.jit
    def _width_forward_kernel(H, HC, W, AS, ASC, WIN, LOG, RSTD, INP, RIN, tokens, n, d, k, h_tok, h_str, eps,
                              in_eps, HAS_WIN: tl.constexpr, BLOCK_T: tl.constexpr, N: tl.constexpr, BLOCK_D: tl.constexpr,
                              BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
        """hc, BLOCK_T tokens as (token, stream) rows: their logits and rstd, and the streams' copy HC (one pass over
        the features), the input coefficients, then the input's sum of squares and the normalised input (two more
        passes over the same rows, which the program has just read: from cache, not HBM)."""
        pid = tl.program_id(0)
        t, s, live, off = _width_rows(pid, tokens, n, h_tok, h_str, BLOCK_T, N)
        tok = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        kk = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_T * N, BLOCK_K], tl.float32)
        ss = tl.zeros([BLOCK_T * N], tl.float32)
        for c0 in range(0, d, BLOCK_D):
            c = c0 + tl.arange(0, BLOCK_D)
            xh = tl.load(H + off[:, None] + c[None, :], mask=live[:, None] & (c[None, :] < d), other=0.0)
            tl.store(HC + (t * n + s)[:, None] * d + c[None, :], xh, mask=live[:, None] & (c[None, :] < d))
            x = xh.to(tl.float32)
            w = tl.load(W + c[:, None] * k + kk[None, :], mask=(c[:, None] < d) & (kk[None, :] < k), other=0.0)
            acc += tl.dot(x, w.to(tl.float32), input_precision=PRECISION)
            ss += tl.sum(x * x, axis=1)
        rstd = 1.0 / tl.sqrt(ss / d + eps)
        logits = acc * rstd[:, None]
        tl.store(LOG + (t * n + s)[:, None] * k + kk[None, :], logits, mask=live[:, None] & (kk[None, :] < k))
        tl.store(RSTD + t * n + s, rstd, mask=live)
        l0 = tl.sum(tl.where(kk[None, :] == 0, logits, 0.0), axis=1)
        a0 = tl.where(live, tl.load(AS + s, mask=s < n, other=0.0) + tl.load(ASC) * _tanh(l0), 0.0)
        ss_in = tl.zeros([BLOCK_T], tl.float32)
        for c0 in range(0, d, BLOCK_D):
            c = c0 + tl.arange(0, BLOCK_D)
            x = tl.load(H + off[:, None] + c[None, :], mask=live[:, None] & (c[None, :] < d), other=0.0).to(tl.float32)
            inp = _per_token(a0[:, None] * x, BLOCK_T, N, BLOCK_D)
            ss_in += tl.sum(inp * inp, axis=1)
        rin = 1.0 / tl.sqrt(ss_in / d + in_eps)
        tl.store(RIN + tok, rin, mask=tok < tokens)
        for c0 in range(0, d, BLOCK_D):
            c = c0 + tl.arange(0, BLOCK_D)
            x = tl.load(H + off[:, None] + c[None, :], mask=live[:, None] & (c[None, :] < d), other=0.0).to(tl.float32)
            out = _in_weighted(_per_token(a0[:, None] * x, BLOCK_T, N, BLOCK_D) * rin[:, None], WIN, c, d, HAS_WIN)
            tl.store(INP + tok[:, None] * d + c[None, :], out.to(INP.dtype.element_ty),
                     mask=(tok[:, None] < tokens) & (c[None, :] < d))

    @triton.jit
    def _width_chunk(H, DINP, off, live, tok, tokens, c, d, a0, BLOCK_T: tl.constexpr, N: tl.constexpr,
                     BLOCK_D: tl.constexpr):
        """hc's backward, one chunk of features: the rows' h, the tokens' d input and input (fp32)."""
        x = tl.load(H + off[:, None] + c[None, :], mask=live[:, None] & (c[None, :] < d), other=0.0).to(tl.float32)
        dy = tl.load(DINP + tok[:, None] * d + c[None, :], mask=(tok[:, None] < tokens) & (c[None, :] < d),
                     other=0.0).to(tl.float32)
        return x, dy, _per_token(a0[:, None] * x, BLOCK_T, N, BLOCK_D)

    @triton.jit
    def _width_backward_kernel(H, W, AS, ASC, WIN, LOG, RSTD, RIN, DLOG, DINP, DHC, DH, DLT, DA, PWIN, tokens, n, d,
                               k, h_tok, h_str, HAS_WIN: tl.constexpr, HAS_DHC: tl.constexpr, BLOCK_T: tl.constexpr, N: tl.constexpr,
                               BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
        """hc, BLOCK_T tokens: one pass over the features for the input norm's sum <g, input> (g = d input x the
        norm's weight) and the weight's partial gradient, one for the input coefficients' gradients <d input, h_s>;
        then the logits' whole gradient (written for dW's kernel); then a pass that writes dh once (the passes after
        the first read a program's rows from cache)."""
        pid = tl.program_id(0)
        t, s, live, off = _width_rows(pid, tokens, n, h_tok, h_str, BLOCK_T, N)
        tok = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        kk = tl.arange(0, BLOCK_K)
        rk = live[:, None] & (kk[None, :] < k)
        logits = tl.load(LOG + (t * n + s)[:, None] * k + kk[None, :], mask=rk, other=0.0)
        th = _tanh(tl.sum(tl.where(kk[None, :] == 0, logits, 0.0), axis=1))
        asc = tl.load(ASC)
        a0 = tl.where(live, tl.load(AS + s, mask=s < n, other=0.0) + asc * th, 0.0)
        rin = tl.load(RIN + tok, mask=tok < tokens, other=0.0)
        s1 = tl.zeros([BLOCK_T], tl.float32)
        for c0 in range(0, d, BLOCK_D):
            c = c0 + tl.arange(0, BLOCK_D)
            x, dy, inp = _width_chunk(H, DINP, off, live, tok, tokens, c, d, a0, BLOCK_T, N, BLOCK_D)
            if HAS_WIN:
                tl.store(PWIN + pid * d + c, tl.sum(dy * inp * rin[:, None], axis=0), mask=c < d)
            s1 += tl.sum(_in_weighted(dy, WIN, c, d, HAS_WIN) * inp, axis=1)
        cf = rin * rin * s1 / d  # d input = rin (g - input cf)
        # d a_s = <d input, h_s>, summed from d input itself (as autograd does): rin (<g, h_s> - cf <input, h_s>)
        # would subtract two sums of nearly equal size and lose their common digits
        da = tl.zeros([BLOCK_T * N], tl.float32)
        for c0 in range(0, d, BLOCK_D):
            c = c0 + tl.arange(0, BLOCK_D)
            x, dy, inp = _width_chunk(H, DINP, off, live, tok, tokens, c, d, a0, BLOCK_T, N, BLOCK_D)
            d_inp = rin[:, None] * (_in_weighted(dy, WIN, c, d, HAS_WIN) - inp * cf[:, None])
            da += tl.sum(_per_row(d_inp, BLOCK_T, N, BLOCK_D) * x, axis=1)
        da = tl.where(live, da, 0.0)
        tl.store(DA + t * n + s, da, mask=live)
        dlt = tl.load(DLOG + (t * n + s)[:, None] * k + kk[None, :], mask=rk, other=0.0).to(tl.float32)
        dlt += tl.where(kk[None, :] == 0, (da * asc * (1.0 - th * th))[:, None], 0.0)
        tl.store(DLT + (t * n + s)[:, None] * k + kk[None, :], dlt, mask=rk)
        rstd = tl.load(RSTD + t * n + s, mask=live, other=0.0)
        coef = tl.sum(dlt * logits, axis=1) * rstd * rstd / d
        gl = dlt * rstd[:, None]
        for c0 in range(0, d, BLOCK_D):
            c = c0 + tl.arange(0, BLOCK_D)
            x, dy, inp = _width_chunk(H, DINP, off, live, tok, tokens, c, d, a0, BLOCK_T, N, BLOCK_D)
            g = _in_weighted(dy, WIN, c, d, HAS_WIN)
            d_inp = _per_row(rin[:, None] * (g - inp * cf[:, None]), BLOCK_T, N, BLOCK_D)
            wt = tl.load(W + c[None, :] * k + kk[:, None], mask=(c[None, :] < d) & (kk[:, None] < k), other=0.0)
            dh = a0[:, None] * d_inp + tl.dot(gl, wt.to(tl.float32), input_precision=PRECISION) - coef[:, None] * x
            if HAS_DHC:  # the copy's gradient (the depth connection's): added here, not by autograd
                dh += tl.load(DHC + (t * n + s)[:, None] * d + c[None, :], mask=live[:, None] & (c[None, :] < d),
                              other=0.0).to(tl.float32)
            tl.store(DH + (t * n + s)[:, None] * d + c[None, :], dh.to(DH.dtype.element_ty),
                     mask=live[:, None] & (c[None, :] < d))

    @triton.jit
    def _flat_coefficients(logits, AS, ASC, n, kk, jj, live):
        """mHC's a (BLOCK_T, N) = sigmoid(a_scale L[:, s] + a_static[s]) from the tokens' logits (BLOCK_T, BLOCK_K)."""
        l0 = tl.sum(tl.where(kk[None, None, :] == jj[None, :, None], logits[:, None, :], 0.0), axis=2)
        a = tl.sigmoid(tl.load(ASC) * l0 + tl.load(AS + jj, mask=jj < n, other=0.0)[None, :])
        return tl.where(live[:, None] & (jj[None, :] < n), a, 0.0)

    @triton.jit
    def _flat_input(H, a, tok, live, c, n, d, h_tok, h_str, jj, BLOCK_T: tl.constexpr, N: tl.constexpr,
                    BLOCK_D: tl.constexpr):
        """sum_s a[:, s] h_s over one chunk of features, (BLOCK_T, BLOCK_D), fp32."""
        inp = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
        for s in tl.static_range(N):
            x = tl.load(H + tok[:, None] * h_tok + s * h_str + c[None, :],
                        mask=live[:, None] & (c[None, :] < d) & (s < n), other=0.0).to(tl.float32)
            inp += tl.sum(tl.where(jj[None, :] == s, a, 0.0), axis=1)[:, None] * x
        return inp

    @triton.jit
    def _flat_width_forward_kernel(H, HC, W, AS, ASC, WIN, LOG, RSTD, INP, RIN, tokens, n, d, k, h_tok, h_str, eps,
                                   in_eps, HAS_WIN: tl.constexpr, BLOCK_T: tl.constexpr, N: tl.constexpr,
                                   BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
        """mHC, BLOCK_T tokens: the logits over the flattened streams (one pass, stream by stream against W's rows
        for that stream) and rstd, the input gates, then the input's norm (two passes from cache)."""
        pid = tl.program_id(0)
        tok = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        live = tok < tokens
        kk = tl.arange(0, BLOCK_K)
        jj = tl.arange(0, N)
        acc = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
        ss = tl.zeros([BLOCK_T], tl.float32)
        for s in tl.static_range(N):
            for c0 in range(0, d, BLOCK_D):
                c = c0 + tl.arange(0, BLOCK_D)
                m = live[:, None] & (c[None, :] < d) & (s < n)
                xh = tl.load(H + tok[:, None] * h_tok + s * h_str + c[None, :], mask=m, other=0.0)
                tl.store(HC + (tok[:, None] * n + s) * d + c[None, :], xh, mask=m)
                x = xh.to(tl.float32)
                w = tl.load(W + (s * d + c)[:, None] * k + kk[None, :],
                            mask=(c[:, None] < d) & (kk[None, :] < k) & (s < n), other=0.0)
                acc += tl.dot(x, w.to(tl.float32), input_precision=PRECISION)
                ss += tl.sum(x * x, axis=1)
        rstd = 1.0 / tl.sqrt(ss / (n * d) + eps)
        logits = acc * rstd[:, None]
        tl.store(LOG + tok[:, None] * k + kk[None, :], logits, mask=live[:, None] & (kk[None, :] < k))
        tl.store(RSTD + tok, rstd, mask=live)
        a = _flat_coefficients(logits, AS, ASC, n, kk, jj, live)
        ss_in = tl.zeros([BLOCK_T], tl.float32)
        for c0 in range(0, d, BLOCK_D):
            c = c0 + tl.arange(0, BLOCK_D)
            inp = _flat_input(H, a, tok, live, c, n, d, h_tok, h_str, jj, BLOCK_T, N, BLOCK_D)
            ss_in += tl.sum(inp * inp, axis=1)
        rin = 1.0 / tl.sqrt(ss_in / d + in_eps)
        tl.store(RIN + tok, rin, mask=live)
        for c0 in range(0, d, BLOCK_D):
            c = c0 + tl.arange(0, BLOCK_D)
            inp = _flat_input(H, a, tok, live, c, n, d, h_tok, h_str, jj, BLOCK_T, N, BLOCK_D)
            out = _in_weighted(inp * rin[:, None], WIN, c, d, HAS_WIN)
            tl.store(INP + tok[:, None] * d + c[None, :], out.to(INP.dtype.element_ty),
                     mask=live[:, None] & (c[None, :] < d))

    @triton.jit
    def _flat_width_backward_kernel(H, W, AS, ASC, WIN, LOG, RSTD, RIN, DLOG, DINP, DHC, DH, DLT, DA, PWIN, tokens, n,
                                    d, k, h_tok, h_str, HAS_WIN: tl.constexpr, HAS_DHC: tl.constexpr, BLOCK_T: tl.constexpr, N: tl.constexpr,
                                    BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
        """mHC, BLOCK_T tokens: ``_width_backward_kernel``'s three steps with the logits per token, the gates'
        sigmoid, and each stream's dh against W's rows for that stream."""
        pid = tl.program_id(0)
        tok = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        live = tok < tokens
        kk = tl.arange(0, BLOCK_K)
        jj = tl.arange(0, N)
        rk = live[:, None] & (kk[None, :] < k)
        logits = tl.load(LOG + tok[:, None] * k + kk[None, :], mask=rk, other=0.0)
        a = _flat_coefficients(logits, AS, ASC, n, kk, jj, live)
        rin = tl.load(RIN + tok, mask=live, other=0.0)
        s1 = tl.zeros([BLOCK_T], tl.float32)
        for c0 in range(0, d, BLOCK_D):
            c = c0 + tl.arange(0, BLOCK_D)
            dy = tl.load(DINP + tok[:, None] * d + c[None, :], mask=live[:, None] & (c[None, :] < d),
                         other=0.0).to(tl.float32)
            inp = _flat_input(H, a, tok, live, c, n, d, h_tok, h_str, jj, BLOCK_T, N, BLOCK_D)
            if HAS_WIN:
                tl.store(PWIN + pid * d + c, tl.sum(dy * inp * rin[:, None], axis=0), mask=c < d)
            s1 += tl.sum(_in_weighted(dy, WIN, c, d, HAS_WIN) * inp, axis=1)
        cf = rin * rin * s1 / d
        da = tl.zeros([BLOCK_T, N], tl.float32)  # from d input itself, as in ``_width_backward_kernel``
        for c0 in range(0, d, BLOCK_D):
            c = c0 + tl.arange(0, BLOCK_D)
            dy = tl.load(DINP + tok[:, None] * d + c[None, :], mask=live[:, None] & (c[None, :] < d),
                         other=0.0).to(tl.float32)
            inp = _flat_input(H, a, tok, live, c, n, d, h_tok, h_str, jj, BLOCK_T, N, BLOCK_D)
            d_inp = rin[:, None] * (_in_weighted(dy, WIN, c, d, HAS_WIN) - inp * cf[:, None])
            for s in tl.static_range(N):
                x = tl.load(H + tok[:, None] * h_tok + s * h_str + c[None, :],
                            mask=live[:, None] & (c[None, :] < d) & (s < n), other=0.0).to(tl.float32)
                da += tl.where(jj[None, :] == s, tl.sum(d_inp * x, axis=1)[:, None], 0.0)
        da = tl.where(live[:, None] & (jj[None, :] < n), da, 0.0)
        tl.store(DA + tok[:, None] * n + jj[None, :], da, mask=live[:, None] & (jj[None, :] < n))
        dz = da * a * (1.0 - a) * tl.load(ASC)
        dlt = tl.load(DLOG + tok[:, None] * k + kk[None, :], mask=rk, other=0.0).to(tl.float32)
        dlt += tl.sum(tl.where(kk[None, None, :] == jj[None, :, None], dz[:, :, None], 0.0), axis=1)
        tl.store(DLT + tok[:, None] * k + kk[None, :], dlt, mask=rk)
        rstd = tl.load(RSTD + tok, mask=live, other=0.0)
        coef = tl.sum(dlt * logits, axis=1) * rstd * rstd / (n * d)
        gl = dlt * rstd[:, None]
        for c0 in range(0, d, BLOCK_D):
            c = c0 + tl.arange(0, BLOCK_D)
            dy = tl.load(DINP + tok[:, None] * d + c[None, :], mask=live[:, None] & (c[None, :] < d),
                         other=0.0).to(tl.float32)
            g = _in_weighted(dy, WIN, c, d, HAS_WIN)
            inp = _flat_input(H, a, tok, live, c, n, d, h_tok, h_str, jj, BLOCK_T, N, BLOCK_D)
            d_inp = rin[:, None] * (g - inp * cf[:, None])
            for s in tl.static_range(N):
                m = live[:, None] & (c[None, :] < d) & (s < n)
                x = tl.load(H + tok[:, None] * h_tok + s * h_str + c[None, :], mask=m, other=0.0).to(tl.float32)
                wt = tl.load(W + (s * d + c)[None, :] * k + kk[:, None],
                             mask=(c[None, :] < d) & (kk[:, None] < k) & (s < n), other=0.0)
                a_s = tl.sum(tl.where(jj[None, :] == s, a, 0.0), axis=1)
                dh = a_s[:, None] * d_inp + tl.dot(gl, wt.to(tl.float32), input_precision=PRECISION) \
                    - coef[:, None] * x
                if HAS_DHC:
                    dh += tl.load(DHC + (tok[:, None] * n + s) * d + c[None, :], mask=m, other=0.0).to(tl.float32)
                tl.store(DH + (tok[:, None] * n + s) * d + c[None, :], dh.to(DH.dtype.element_ty), mask=m)


#: The width ops' tokens a program (with all their streams; at least 16, mHC's products' smallest side) and features
#: a chunk; tunable (``TUNABLES``).
_WIDTH_BLOCK_T, _WIDTH_BLOCK_D = 16, 64


def _width_sizes(k: int, n: int, h: Tensor) -> dict:
    return dict(BLOCK_T=_WIDTH_BLOCK_T, N=triton.next_power_of_2(n), BLOCK_D=_WIDTH_BLOCK_D,
                BLOCK_K=max(16, triton.next_power_of_2(k)), PRECISION=_project_sizes(k, h)["PRECISION"])


def _width_programs(h: Tensor, in_weight: Optional[Tensor]) -> int:
    """Rows of the input norm weight's partial gradient: one a program (0 without the weight)."""
    return _cdiv(h.numel() // (h.shape[-2] * h.shape[-1]), _WIDTH_BLOCK_T) if in_weight is not None else 0


def _width_params(wp, a_static, a_scale, in_weight):
    return (wp.float().contiguous(), a_static.float().contiguous(), a_scale.float().contiguous(),
            None if in_weight is None else in_weight.contiguous())


def _width_shapes(h: Tensor, k: int, flat: bool) -> Tuple[tuple, tuple]:
    """(the logits' shape, rstd's): per stream for hc, per token for mHC."""
    lead, n = h.shape[:-2], h.shape[-2]
    return ((*lead, k), lead) if flat else ((*lead, n, k), (*lead, n))


def _width_forward_impl(h, proj, proj_weight, a_static, a_scale, in_weight, eps, in_eps, flat):
    """(logits fp32, rstd fp32, input (..., d) in h's dtype, the input's rstd (...) fp32, h's contiguous copy)."""
    n, d = h.shape[-2:]
    wp = _folded(proj, proj_weight)
    k = wp.shape[-1]
    if not _use_triton(h):
        x = h.flatten(-2).float() if flat else h.float()
        rstd = torch.rsqrt(x.pow(2).mean(-1) + eps)
        logits = (x @ wp.float()) * rstd[..., None]
        a0 = _input_coefficients(logits, a_static, a_scale, flat)
        inp = (a0[..., None] * h.float()).sum(-2)
        rin = torch.rsqrt(inp.pow(2).mean(-1) + in_eps)
        out = inp * rin[..., None]
        return (logits, rstd, (out if in_weight is None else out * in_weight.float()).to(h.dtype), rin,
                h.clone(memory_format=torch.contiguous_format))
    hv, h_tok, h_str = _streams_view(h)
    tokens = hv.shape[0]
    wp, a_static, a_scale, in_weight = _width_params(wp, a_static, a_scale, in_weight)
    log_shape, rstd_shape = _width_shapes(h, k, flat)
    logits = torch.empty(log_shape, dtype=torch.float32, device=h.device)
    rstd = torch.empty(rstd_shape, dtype=torch.float32, device=h.device)
    inp = torch.empty((*h.shape[:-2], d), dtype=h.dtype, device=h.device)
    rin = torch.empty(h.shape[:-2], dtype=torch.float32, device=h.device)
    copy = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    kernel = _flat_width_forward_kernel if flat else _width_forward_kernel
    kernel[(triton.cdiv(tokens, _WIDTH_BLOCK_T),)](
        hv, copy, wp, a_static, a_scale, in_weight if in_weight is not None else rin, logits, rstd, inp, rin, tokens,
        n, d, k, h_tok, h_str, eps, in_eps, HAS_WIN=in_weight is not None, **_width_sizes(k, n, h))
    return logits, rstd, inp, rin, copy


def _width_backward_impl(h, proj, proj_weight, a_static, a_scale, in_weight, logits, rstd, rin, dlog, dinp, dcopy,
                         flat):
    """(dh in h's dtype, with the copy's gradient ``dcopy`` (or None) added, the logits' whole gradient fp32, d a
    (..., n) fp32, the input norm's weight gradient as fp32 partial sums (programs, d), or (0, d) without the
    weight)."""
    n, d = h.shape[-2:]
    wp = _folded(proj, proj_weight)
    k = wp.shape[-1]
    if not _use_triton(h):
        dh, dlt, da0, dwin = _width_grads_torch(h, wp, a_static, a_scale, in_weight, logits, rstd, rin, dlog, dinp,
                                                flat)
        pwin = h.new_zeros((_width_programs(h, in_weight), d), dtype=torch.float32)
        if dwin is not None:  # the whole sum in the first program's place, zeros in the others' (the kernel's shape)
            pwin[:1] = dwin
        return (dh if dcopy is None else dh + dcopy.float()).to(h.dtype), dlt, da0, pwin
    hv, h_tok, h_str = _streams_view(h)
    tokens = hv.shape[0]
    programs = triton.cdiv(tokens, _WIDTH_BLOCK_T)
    wp, a_static, a_scale, in_weight = _width_params(wp, a_static, a_scale, in_weight)
    dh = torch.empty((tokens, n, d), dtype=h.dtype, device=h.device)  # written in h's dtype: no cast
    dlt = torch.empty(logits.shape, dtype=torch.float32, device=h.device)
    da0 = torch.empty((*h.shape[:-2], n), dtype=torch.float32, device=h.device)
    pwin = torch.empty((programs if in_weight is not None else 0, d), dtype=torch.float32, device=h.device)
    kernel = _flat_width_backward_kernel if flat else _width_backward_kernel
    kernel[(programs,)](
        hv, wp, a_static, a_scale, in_weight if in_weight is not None else rin, logits.contiguous(),
        rstd.contiguous(), rin.contiguous(), dlog.float().contiguous(), dinp.contiguous(),
        dcopy.contiguous() if dcopy is not None else rin, dh, dlt, da0, pwin if in_weight is not None else rin, tokens,
        n, d, k, h_tok, h_str, HAS_WIN=in_weight is not None, HAS_DHC=dcopy is not None, **_width_sizes(k, n, h))
    return dh.view(h.shape), dlt, da0, pwin


@torch.library.custom_op(f"{NAMESPACE}::width_forward", mutates_args=())
def _width_forward(h: Tensor, proj: Tensor, proj_weight: Opt, a_static: Tensor, a_scale: Tensor, in_weight: Opt,
                   eps: float, in_eps: float, flat: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(logits fp32, rstd fp32, input (..., d) in h's dtype, the input's rstd (...) fp32, h's copy)."""
    return _width_forward_impl(h, proj, proj_weight, a_static, a_scale, in_weight, eps, in_eps, flat)


@_width_forward.register_fake
def _(h, proj, proj_weight, a_static, a_scale, in_weight, eps, in_eps, flat):
    log_shape, rstd_shape = _width_shapes(h, proj.shape[-1], flat)
    f32 = torch.float32
    return (h.new_empty(log_shape, dtype=f32), h.new_empty(rstd_shape, dtype=f32),
            h.new_empty((*h.shape[:-2], h.shape[-1])), h.new_empty(h.shape[:-2], dtype=f32), h.new_empty(h.shape))


@torch.library.custom_op(f"{NAMESPACE}::width_backward", mutates_args=())
def _width_backward(h: Tensor, proj: Tensor, proj_weight: Opt, a_static: Tensor, a_scale: Tensor, in_weight: Opt,
                    logits: Tensor, rstd: Tensor, rin: Tensor, dlog: Tensor, dinp: Tensor, dcopy: Opt,
                    flat: bool) -> List[Tensor]:
    """(dh, the logits' whole gradient, d a per token, the input norm weight's partial sums) (one kernel)."""
    return list(_width_backward_impl(h, proj, proj_weight, a_static, a_scale, in_weight, logits, rstd, rin, dlog,
                                     dinp, dcopy, flat))


@_width_backward.register_fake
def _(h, proj, proj_weight, a_static, a_scale, in_weight, logits, rstd, rin, dlog, dinp, dcopy, flat):
    return [h.new_empty(h.shape), logits.new_empty(logits.shape), rin.new_empty((*h.shape[:-2], h.shape[-2])),
            rin.new_empty((_width_programs(h, in_weight), h.shape[-1]))]


def _width_setup(ctx, inputs, output):
    _h, proj, proj_weight, a_static, a_scale, in_weight, _eps, _in_eps, flat = inputs
    logits, rstd, _inp, rin, copy = output
    # h's copy (which the depth connection keeps: h itself is kept by nobody), the parameters, a few fp32 a token
    ctx.save_for_backward(copy, proj, proj_weight, a_static, a_scale, in_weight, logits, rstd, rin)
    ctx.flat = flat
    ctx.set_materialize_grads(False)


def _width_backward_autograd(ctx, dlog, _drstd, dinp, _drin, dcopy):
    h, proj, proj_weight, a_static, a_scale, in_weight, logits, rstd, rin = ctx.saved_tensors
    flat = ctx.flat
    if dinp is None:
        dinp = torch.zeros((*h.shape[:-2], h.shape[-1]), dtype=h.dtype, device=h.device)
    if dlog is None:
        dlog = torch.zeros_like(logits)
    dh, dlt, da0, pwin = _width_backward(h, proj, proj_weight, a_static, a_scale, in_weight, logits, rstd, rin, dlog,
                                         dinp, dcopy, flat)
    n = h.shape[-2]
    dproj = dpw = None
    if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:  # d(w P) summed over the rows, then to P and w
        dwp = _project_backward_w(h.flatten(-2) if flat else h, rstd, dlt).sum(0)
        dproj = (dwp if proj_weight is None else dwp * proj_weight.float()[:, None]).to(proj.dtype)
        dpw = None if proj_weight is None else (dwp * proj.float()).sum(-1).to(proj_weight.dtype)
    if flat:  # a = sigmoid(z), z = a_scale L[s] + a_static[s]
        a0 = _input_coefficients(logits, a_static, a_scale, True)
        dz = da0 * a0 * (1 - a0)
        da_static, da_scale = dz.reshape(-1, n).sum(0), (dz * logits[..., :n]).sum()
    else:  # a = a_static[s] + a_scale tanh(L[s, 0])
        da_static, da_scale = da0.reshape(-1, n).sum(0), (da0 * torch.tanh(logits[..., 0])).sum()
    dwin = pwin.sum(0).to(in_weight.dtype) if in_weight is not None else None
    return (dh, dproj, dpw, da_static.to(a_static.dtype), da_scale.reshape(a_scale.shape).to(a_scale.dtype), dwin,
            None, None, None)


_width_forward.register_autograd(_width_backward_autograd, setup_context=_width_setup)


def _width_call(h, proj, a_static, a_scale, in_weight, proj_weight, eps, in_eps, flat, who):
    n, d = h.shape[-2:]
    rows = n * d if flat else d
    if proj.dim() != 2 or proj.shape[0] != rows or a_static.shape != (n,) or a_scale.numel() != 1 or (
            in_weight is not None and in_weight.shape != (d,)) or (flat and proj.shape[1] < n) or (
            proj_weight is not None and proj_weight.shape != (rows,)):
        raise ValueError(f"{who} takes h (..., n, d), proj ({'n d' if flat else 'd'}, k), a_static (n,), a_scale (1,), "
                         f"in_weight (d,), proj_weight ({'n d' if flat else 'd'},); got {tuple(h.shape)}, "
                         f"{tuple(proj.shape)}, {tuple(a_static.shape)}, {tuple(a_scale.shape)}, "
                         f"{None if in_weight is None else tuple(in_weight.shape)}, "
                         f"{None if proj_weight is None else tuple(proj_weight.shape)}")
    logits, _rstd, inp, _rin, copy = _width_forward(h, proj, proj_weight, a_static, a_scale.reshape(1), in_weight,
                                                    float(eps), float(in_eps), flat)
    return logits, inp, copy


def hc_width(h: Tensor, proj: Tensor, a_static: Tensor, a_scale: Tensor, in_weight: Optional[Tensor] = None, *,
             proj_weight: Optional[Tensor] = None, eps: float = 1e-5, in_eps: float = 1e-5
             ) -> Tuple[Tensor, Tensor, Tensor]:
    """``width_reference`` for hc as one op each way (``siamesenorm::width_forward`` / ``_backward``): (the logits
    (..., n, k), the sublayer's normalised input, a copy of h). One kernel reads the streams once (its passes over
    a program's rows after the first come from cache) for the logits, the input coefficients, the input and its
    norm, and writes the input once, where the projection, the input's sum and its norm were three kernels that
    read the streams twice and wrote the unnormalised input; backward one kernel writes dh once (reading h, d input
    and the logits' gradient from the caller's own small ops) and dW's kernel (``rms_project``'s) reads h once more.

    The copy, written in the same pass, is for the depth connection to read in h's place: then h has one consumer,
    this op, whose backward adds the copy's gradient (the depth connection's) into dh in its own kernel, where
    autograd would sum two gradients of h in a kernel of its own (read 2n passes, write n; the copy costs n forward
    and n read backward). Autograd keeps the copy in h's place (h itself is then kept by nobody: no more memory),
    the parameters and a few fp32 numbers a stream and token: the input is never kept or recomputed, nor w P (the
    ops fold the norm's weight into the projection themselves)."""
    return _width_call(h, proj, a_static, a_scale, in_weight, proj_weight, eps, in_eps, False, "hc_width")


def mhc_width(h: Tensor, proj: Tensor, a_static: Tensor, a_scale: Tensor, in_weight: Optional[Tensor] = None, *,
              proj_weight: Optional[Tensor] = None, eps: float = 1e-5, in_eps: float = 1e-5
              ) -> Tuple[Tensor, Tensor, Tensor]:
    """``width_reference`` for mHC (``flat``: the logits (..., k) over the flattened streams, the input gates
    sigmoid(a_scale L[s] + a_static[s]) from the first n) as ``hc_width``'s one op each way."""
    return _width_call(h, proj, a_static, a_scale, in_weight, proj_weight, eps, in_eps, True, "mhc_width")


# ---- SiameseNorm's stream mixing (siamese_mixing) with the residual add before it, one pass over the streams ------
def pair_mix_reference(x: Tensor, y: Tensor, o: Optional[Tensor] = None, *, scale: float = 1.0, bias: Tensor,
                       gate: Optional[Tensor] = None, proj: Optional[Tensor] = None,
                       norm_weight: Optional[Tensor] = None, eps: float = 1e-5) -> Tuple[Tensor, Tensor]:
    """SiameseNorm's two streams mixed by H = [[p, 1 - p], [1 - p, p]] (siamesenorm.nn.StreamMixing), after the
    previous sublayer's output O is added (X1 = X + O * s, Y1 = Y + O; without O, X1 = X, Y1 = Y):

        p = sigmoid(b)                                          (static: ``proj`` None)
        p = sigmoid(b + a * (RMSNorm_w([X1, Y1]) . phi))       (dynamic, per token; a = ``gate``, phi = ``proj``)
        XM = p X1 + (1 - p) Y1 = Y1 + p (X1 - Y1),   YM = X1 - p (X1 - Y1)

    fp32 inside (p too), outputs in the streams' dtype."""
    dtype = x.dtype
    x1 = x.float() + o.float() * scale if o is not None else x.float()
    y1 = y.float() + o.float() if o is not None else y.float()
    z = bias.float()
    if proj is not None:
        h = _rms(torch.cat([x1, y1], -1), norm_weight, eps)
        z = z + gate.float() * (h @ proj.float()).unsqueeze(-1)
    p = torch.sigmoid(z)
    diff = x1 - y1
    return (y1 + p * diff).to(dtype), (x1 - p * diff).to(dtype)


if triton is not None:

    @triton.jit
    def _pair_coefficient(x1, y1, b, a, px, py, wx, wy, d, eps, DYNAMIC: tl.constexpr, HAS_W: tl.constexpr):
        """(p, r, t): the mix's share, the rstd of [X1, Y1] and the projection t = RMSNorm_w([X1, Y1]) . phi."""
        z = b
        r = 0.0
        t = 0.0
        if DYNAMIC:
            r = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=0) + tl.sum(y1 * y1, axis=0)) / (2 * d) + eps)
            if HAS_W:
                t = (tl.sum(x1 * wx * px, axis=0) + tl.sum(y1 * wy * py, axis=0)) * r
            else:
                t = (tl.sum(x1 * px, axis=0) + tl.sum(y1 * py, axis=0)) * r
            z = z + a * t
        return 1.0 / (1.0 + tl.exp(-z)), r, t

    @triton.jit
    def _pair_load(X, Y, O, row, x_stride, y_stride, o_stride, cols, m, scale, HAS_O: tl.constexpr):
        x1 = tl.load(X + row * x_stride + cols, mask=m, other=0.0).to(tl.float32)
        y1 = tl.load(Y + row * y_stride + cols, mask=m, other=0.0).to(tl.float32)
        if HAS_O:
            o = tl.load(O + row * o_stride + cols, mask=m, other=0.0).to(tl.float32)
            x1 = x1 + o * scale
            y1 = y1 + o
        return x1, y1

    @triton.jit
    def _pair_params(B, A, P, W, cols, mask, d, DYNAMIC: tl.constexpr, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
        b = tl.load(B).to(tl.float32)
        a = 0.0
        zero = tl.zeros([BLOCK], tl.float32)
        px, py, wx, wy = zero, zero, zero, zero
        if DYNAMIC:
            a = tl.load(A).to(tl.float32)
            px = tl.load(P + cols, mask=mask, other=0.0).to(tl.float32)
            py = tl.load(P + d + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_W:
                wx = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
                wy = tl.load(W + d + cols, mask=mask, other=0.0).to(tl.float32)
        return b, a, px, py, wx, wy

    @triton.jit
    def _pair_forward_kernel(X, Y, O, XM, YM, B, A, P, W, x_stride, y_stride, o_stride, d, scale, eps,
                             HAS_O: tl.constexpr, DYNAMIC: tl.constexpr, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
        """One row: X1, Y1 (with O), p from them in registers, XM and YM written once each."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < d
        b, a, px, py, wx, wy = _pair_params(B, A, P, W, cols, mask, d, DYNAMIC, HAS_W, BLOCK)
        x1, y1 = _pair_load(X, Y, O, row, x_stride, y_stride, o_stride, cols, mask, scale, HAS_O)
        p, _r, _t = _pair_coefficient(x1, y1, b, a, px, py, wx, wy, d, eps, DYNAMIC, HAS_W)
        diff = x1 - y1
        tl.store(XM + row * d + cols, (y1 + p * diff).to(XM.dtype.element_ty), mask=mask)
        tl.store(YM + row * d + cols, (x1 - p * diff).to(YM.dtype.element_ty), mask=mask)

    @triton.jit
    def _pair_backward_kernel(X, Y, O, DXM, DYM, DX, DY, DO, B, A, P, W, PB, PA, PP, PW, x_stride, y_stride,
                              o_stride, dxy_stride, rows, d, scale, eps, HAS_O: tl.constexpr, DYNAMIC: tl.constexpr,
                              HAS_W: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr, BLOCK: tl.constexpr):
        """Rows of a program: X1, Y1 and p recomputed from the op's inputs; dX, dY (and dO) written once; the
        parameters' gradients summed over the program's rows (b, a: scalars; phi, w: 2d wide)."""
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < d
        b, a, px, py, wx, wy = _pair_params(B, A, P, W, cols, mask, d, DYNAMIC, HAS_W, BLOCK)
        acc_b = 0.0
        acc_a = 0.0
        acc_px = tl.zeros([BLOCK], tl.float32)
        acc_py = tl.zeros([BLOCK], tl.float32)
        acc_wx = tl.zeros([BLOCK], tl.float32)
        acc_wy = tl.zeros([BLOCK], tl.float32)
        for i in range(ROWS_PER_PROGRAM):
            row = (pid * ROWS_PER_PROGRAM + i).to(tl.int64)
            m = mask & (row < rows)
            x1, y1 = _pair_load(X, Y, O, row, x_stride, y_stride, o_stride, cols, m, scale, HAS_O)
            dxm = tl.load(DXM + row * d + cols, mask=m, other=0.0).to(tl.float32)
            dym = tl.load(DYM + row * d + cols, mask=m, other=0.0).to(tl.float32)
            p, r, t = _pair_coefficient(x1, y1, b, a, px, py, wx, wy, d, eps, DYNAMIC, HAS_W)
            dz = tl.sum((x1 - y1) * (dxm - dym), axis=0) * p * (1.0 - p)  # 0 past the last row: its loads are 0
            dx1 = p * dxm + (1.0 - p) * dym
            dy1 = (1.0 - p) * dxm + p * dym
            acc_b += dz
            if DYNAMIC:
                acc_a += dz * t
                dt = a * dz
                xh, yh = x1 * r, y1 * r
                gx, gy = dt * px, dt * py
                if HAS_W:
                    acc_px += dt * xh * wx
                    acc_py += dt * yh * wy
                    acc_wx += gx * xh
                    acc_wy += gy * yh
                    gx, gy = gx * wx, gy * wy
                else:
                    acc_px += dt * xh
                    acc_py += dt * yh
                mean = (tl.sum(gx * xh, axis=0) + tl.sum(gy * yh, axis=0)) / (2 * d)
                dx1 += r * (gx - xh * mean)
                dy1 += r * (gy - yh * mean)
            tl.store(DX + row * dxy_stride + cols, dx1.to(DX.dtype.element_ty), mask=m)
            tl.store(DY + row * dxy_stride + cols, dy1.to(DY.dtype.element_ty), mask=m)
            if HAS_O:
                tl.store(DO + row * d + cols, (dx1 * scale + dy1).to(DO.dtype.element_ty), mask=m)
        tl.store(PB + pid, acc_b)
        if DYNAMIC:
            tl.store(PA + pid, acc_a)
            tl.store(PP + pid * 2 * d + cols, acc_px, mask=mask)
            tl.store(PP + pid * 2 * d + d + cols, acc_py, mask=mask)
            if HAS_W:
                tl.store(PW + pid * 2 * d + cols, acc_wx, mask=mask)
                tl.store(PW + pid * 2 * d + d + cols, acc_wy, mask=mask)


def _pair_streams(x: Optional[Tensor], y: Tensor, stacked: bool) -> Tuple[Tensor, Tensor, int]:
    """(X, Y, d): the two streams, the halves of ``y`` when ``stacked``."""
    if stacked:
        d = y.shape[-1] // 2
        return y[..., :d], y[..., d:], d
    return x, y, y.shape[-1]


def _pair_forward_impl(x, y, o, bias, gate, proj, norm_weight, scale, stacked, eps):
    x, y, d = _pair_streams(x, y, stacked)
    if not _use_triton(y):
        return pair_mix_reference(x, y, o, scale=scale, bias=bias, gate=gate, proj=proj, norm_weight=norm_weight,
                                  eps=eps)
    xr, xs = _rows(x, d)
    yr, ys = _rows(y, d)
    orows, o_stride = _rows(o, d) if o is not None else (yr, 0)
    rows = yr.shape[0]
    xm, ym = (torch.empty((rows, d), dtype=y.dtype, device=y.device) for _ in range(2))
    dynamic = proj is not None
    _pair_forward_kernel[(rows,)](xr, yr, orows, xm, ym, bias, gate if dynamic else bias, proj if dynamic else bias,
                                  norm_weight if norm_weight is not None else bias, xs, ys, o_stride, d, float(scale),
                                  float(eps), HAS_O=o is not None, DYNAMIC=dynamic, HAS_W=norm_weight is not None,
                                  BLOCK=triton.next_power_of_2(d), num_warps=_warps(d))
    return xm.view(y.shape), ym.view(y.shape)


def _pair_backward_torch(x, y, o, dxm, dym, bias, gate, proj, norm_weight, scale, eps):
    """The kernel's backward in plain torch, written out: (dX, dY, dO, db, da, dphi, dw), fp32."""
    x1 = x.float() + o.float() * scale if o is not None else x.float()
    y1 = y.float() + o.float() if o is not None else y.float()
    dxm, dym = dxm.float(), dym.float()
    z = bias.float()
    grads = [None, None, None]
    if proj is not None:
        u = torch.cat([x1, y1], -1)
        r = torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + eps)
        u_hat = u * r
        w = norm_weight.float() if norm_weight is not None else None
        phi = proj.float()
        t = ((u_hat * w if w is not None else u_hat) @ phi).unsqueeze(-1)
        z = z + gate.float() * t
    p = torch.sigmoid(z)
    dz = ((x1 - y1) * (dxm - dym)).sum(-1, keepdim=True) * p * (1 - p)
    dx1, dy1 = p * dxm + (1 - p) * dym, (1 - p) * dxm + p * dym
    if proj is not None:
        grads[0] = (dz * t).sum()
        dt = gate.float() * dz
        g = dt * phi
        grads[1] = (dt * (u_hat * w if w is not None else u_hat)).reshape(-1, phi.shape[0]).sum(0)
        if w is not None:
            grads[2] = (g * u_hat).reshape(-1, phi.shape[0]).sum(0)
            g = g * w
        du = r * (g - u_hat * (g * u_hat).mean(-1, keepdim=True))
        d = x1.shape[-1]
        dx1, dy1 = dx1 + du[..., :d], dy1 + du[..., d:]
    do = dx1 * scale + dy1 if o is not None else None
    return dx1, dy1, do, dz.sum(), *grads


def _pair_backward_impl(x, y, o, dxm, dym, bias, gate, proj, norm_weight, scale, stacked, eps):
    """(dX, dY, dO, db, da, dphi, dw): dX, dY in the streams' dtype (``stacked``: the state's gradient as dY, dX
    None), dO in O's, the parameters' in fp32."""
    x, y, d = _pair_streams(x, y, stacked)
    if not _use_triton(y):
        dx, dy, do, *grads = _pair_backward_torch(x, y, o, dxm, dym, bias, gate, proj, norm_weight, scale, eps)
        if stacked:
            dx, dy = None, torch.cat([dx, dy], -1)
        return dx, dy, do, *grads
    xr, xs = _rows(x, d)
    yr, ys = _rows(y, d)
    orows, o_stride = _rows(o, d) if o is not None else (yr, 0)
    rows = yr.shape[0]
    dxm, dym = dxm.reshape(rows, d).contiguous(), dym.reshape(rows, d).contiguous()
    new = functools.partial(torch.empty, dtype=y.dtype, device=y.device)
    if stacked:
        dxy = new((rows, 2 * d))
        dx, dy, dxy_stride = dxy[:, :d], dxy[:, d:], 2 * d
    else:
        dx, dy, dxy_stride = new((rows, d)), new((rows, d)), d
    do = torch.empty((rows, d), dtype=o.dtype, device=y.device) if o is not None else dx
    per = min(_ROWS_PER_PROGRAM, rows)
    programs = triton.cdiv(rows, per)
    dynamic = proj is not None
    f32 = functools.partial(torch.empty, dtype=torch.float32, device=y.device)
    pb, pa = f32(programs), f32(programs)
    pp = f32((programs, 2 * d)) if dynamic else pb
    pw = f32((programs, 2 * d)) if dynamic and norm_weight is not None else pb
    _pair_backward_kernel[(programs,)](
        xr, yr, orows, dxm, dym, dx, dy, do, bias, gate if dynamic else bias, proj if dynamic else bias,
        norm_weight if norm_weight is not None else bias, pb, pa, pp, pw, xs, ys, o_stride, dxy_stride, rows, d,
        float(scale), float(eps), HAS_O=o is not None, DYNAMIC=dynamic, HAS_W=norm_weight is not None,
        ROWS_PER_PROGRAM=per, BLOCK=triton.next_power_of_2(d), num_warps=_warps(d))
    grads = (pa.sum(), pp.sum(0), pw.sum(0) if norm_weight is not None else None) if dynamic else (None,) * 3
    do = do.view(o.shape) if o is not None else None
    if stacked:
        return None, dxy.view(*y.shape[:-1], 2 * d), do, pb.sum(), *grads
    return dx.view(x.shape), dy.view(y.shape), do, pb.sum(), *grads


@torch.library.custom_op(f"{NAMESPACE}::pair_mix_forward", mutates_args=())
def _pair_mix_forward(x: Opt, y: Tensor, o: Opt, bias: Tensor, gate: Opt, proj: Opt, norm_weight: Opt, scale: float,
                      stacked: bool, eps: float) -> Tuple[Tensor, Tensor]:
    """(XM, YM); ``stacked``: ``x`` None and ``y`` the stacked state (X, Y), (..., 2d)."""
    xm, ym = _pair_forward_impl(x, y, o, bias, gate, proj, norm_weight, scale, stacked, eps)
    return xm.contiguous(), ym.contiguous()


@_pair_mix_forward.register_fake
def _(x, y, o, bias, gate, proj, norm_weight, scale, stacked, eps):
    shape = (*y.shape[:-1], y.shape[-1] // 2) if stacked else y.shape
    return y.new_empty(shape), y.new_empty(shape)


@torch.library.custom_op(f"{NAMESPACE}::pair_mix_backward", mutates_args=())
def _pair_mix_backward(x: Opt, y: Tensor, o: Opt, dxm: Tensor, dym: Tensor, bias: Tensor, gate: Opt, proj: Opt,
                       norm_weight: Opt, scale: float, stacked: bool, eps: float) -> List[Tensor]:
    """(dX, dY, dO, db, da, dphi, dw), each in its input's dtype and empty where absent; ``stacked``: dY is the
    state's gradient (..., 2d) and dX empty."""
    out = _pair_backward_impl(x, y, o, dxm, dym, bias, gate, proj, norm_weight, scale, stacked, eps)
    like = (x, y, o, bias, gate, proj, norm_weight)
    return [g.to(t.dtype).contiguous() if g is not None else _empty(y) for g, t in zip(out, like)]


@_pair_mix_backward.register_fake
def _(x, y, o, dxm, dym, bias, gate, proj, norm_weight, scale, stacked, eps):
    return [t.new_empty(t.shape) if t is not None else _empty(y) for t in (x, y, o, bias, gate, proj, norm_weight)]


def _pair_setup(ctx, inputs, output):
    x, y, o, bias, gate, proj, norm_weight, scale, stacked, eps = inputs
    ctx.save_for_backward(x, y, o, bias, gate, proj, norm_weight)  # the inputs only: X1, Y1, p recomputed
    ctx.args = (scale, stacked, eps)


def _pair_backward(ctx, dxm, dym):
    x, y, o, bias, gate, proj, norm_weight = ctx.saved_tensors
    scale, stacked, eps = ctx.args  # autograd materialises a missing output's gradient (zeros) here
    grads = _pair_mix_backward(x, y, o, dxm, dym, bias, gate, proj, norm_weight, scale, stacked, eps)
    grads = [g if g.numel() else None for g in grads]
    return (*grads, None, None, None)


_pair_mix_forward.register_autograd(_pair_backward, setup_context=_pair_setup)


def pair_mix(x: Optional[Tensor], y: Tensor, o: Optional[Tensor] = None, *, scale: float = 1.0, bias: Tensor,
             gate: Optional[Tensor] = None, proj: Optional[Tensor] = None, norm_weight: Optional[Tensor] = None,
             eps: float = 1e-5, stacked: bool = False) -> Tuple[Tensor, Tensor]:
    """SiameseNorm's stream mixing with the residual add before it (``pair_mix_reference``'s arithmetic) as one op
    each way (``siamesenorm::pair_mix_forward`` / ``_backward``): one kernel reads X, Y (and O) once, computes p in
    registers and writes the mixed streams once; backward keeps only the op's inputs and recomputes X1, Y1 and p.
    Eager, StreamMixing writes the concatenated streams, their norm, the products p X, (1 - p) Y and their sums.
    ``stacked``: ``x`` None and ``y`` the stacked state (X, Y) a block receives (halves read in place, its
    gradient written whole). Static mixing: ``proj`` None (only ``bias``)."""
    if (proj is None) != (gate is None):
        raise ValueError("pair_mix: the dynamic form takes both gate and proj, the static form neither.")
    return _pair_mix_forward(x, y, o, bias, gate, proj, norm_weight, float(scale), bool(stacked), float(eps))


# ---- the check the tests and the GPU check run ---------------------------------------------------------------------
def _used_again(outputs):
    """(XA, Y1, H) with XA and Y1 each multiplied by 1.5 where they are the streams passed through: a second use,
    whose gradient reaches the op's backward as dXA / dY1 (the reference's are the inputs themselves)."""
    xa, y1, h = outputs
    return (xa * 1.5 if xa is not None else None), y1 * 1.5, h


#: The fp64 check's tolerance at the recipes' sizes (``check(d=2040, ..., tol=AT_SIZE_FP64_TOL)``, of each tensor's
#: largest value): the kernels sum in fp32, and a gradient summed over 130 rows x 4,080 features differs from the
#: reference's other order by up to 6e-5 of its largest value (SiameseNorm's dynamic mixing gate, d 2048, in
#: Triton's interpreter); the small check keeps 2e-5.
AT_SIZE_FP64_TOL = 1e-4


def SIZE_CASES(case: dict) -> bool:
    """The combinations a check at the recipes' sizes runs (``check(select=SIZE_CASES)``): each op once with every part
    on (two streams, O, LN^X, gamma, LN^in, weights; stacked and separate), the one-stream op, ``copy``,
    ``block_input``, ``stream_add``, the head norms (fewer k/v heads, strided, RoPE), ``qkv_rope``, Sinkhorn (4 streams, 20 iterations),
    ``stream_mix`` (4 streams), ``pair_mix`` (dynamic with the norm's weight, with O; and on the stacked state),
    ``rms_project`` (both cases) and the width ops (hc's and mHC's: 4 streams read in place, with the input norm's
    weight): 18 of the 392 (the two-stream op with and without gamma, on separate and stacked streams)."""
    full = dict(two=True, has_o=True, x_norm=True, wx=True, wy=True, in_norm=True, win=True)
    if "two" in case and len(case) == 9:  # the stream op's 256 + 32
        return all(case[k] == v for k, v in full.items()) or (
            not case["two"] and case["has_o"] and case["in_norm"] and case["win"] and case["wy"] and not case["stacked"])
    return case in (dict(stream_add=True, stacked=True),
                    dict(head_norm=True, affine=True, n_q=4, n_kv=2, strided=True, rope=True),
                    dict(qkv_rope=True, n_q=4, n_kv=2, strided=True),
                    dict(sinkhorn=True, n=4, order="columns_first", iterations=20),
                    dict(stream_mix=True, n=4, widened=False),
                    dict(copy=True, two=True, x_norm=True, in_norm=True),
                    dict(block_input=True, has_o=True, x_norm=True, g=True, in_norm=True, weights=True),
                    dict(pair_mix=True, has_o=True, form="dynamic+w", stacked=False),
                    dict(pair_mix=True, has_o=False, form="dynamic+w", stacked=True),
                    dict(project=True, k=24, strided=False), dict(project=True, k=6, strided=True),
                    dict(width="hc", n=4, win=True, strided=True), dict(width="mhc", n=4, win=True, strided=True))


def check(device: str = "cpu", d: int = 48, rows: Tuple[int, int] = (2, 5), tol: float = 2e-5,
          seen: Optional[list] = None, dtype: torch.dtype = torch.float64,
          select: Optional[Callable[[dict], bool]] = None) -> List[dict]:
    """Every flag combination of ``stream_input`` (two streams: 256; one stream: 32; with ``copy``, O absent: one
    and two streams, LN^X, LN^in: 6), of ``block_input`` (O, LN^X, gamma, LN^in, weights or none: 32) and of
    ``stream_add``, on separate and stacked streams, of ``head_norm`` (with and without weights, as many k/v heads as
    q heads and fewer, contiguous and strided, with and without RoPE: 16), of ``qkv_rope`` (as many k/v heads and
    fewer, contiguous and strided: 4), of ``pair_mix`` (with and without O, static and dynamic with and
    without the norm's weight, separate and stacked streams: 12), of ``sinkhorn`` (4 and 3 streams, both orders, 1 and 20 iterations: 8), of
    ``stream_mix`` (4, 3 and 2 streams, stacked and widened from one stream: 6), of ``rms_project`` (mHC's 24
    columns over 4 d features; hc's 6 over d, rows read in place: 2) and of ``hc_width`` and ``mhc_width`` (2 and 4
    streams, with and without the input norm's weight, contiguous and read in place: 16), forward and backward (a random
    projection of the outputs), against autograd of ``reference`` / ``head_reference`` / siamesenorm.nn.sinkhorn /
    ``mix_reference`` / ``project_reference`` / ``width_reference``, fp64 inputs on ``device`` (fp32 inside all; within ``tol`` elementwise,
    relative and absolute, the absolute part scaled by each tensor's largest value where that exceeds 1; the head
    norms with head size 8, or the recipes' 128 from d 1024 on); returns the combinations that
    disagree, and appends every combination it ran to ``seen`` (if given). On CUDA with Triton (or under
    ``TRITON_INTERPRET=1``) it checks the kernels, elsewhere the torch path. ``dtype=torch.bfloat16`` (with a
    ``tol`` of a few bf16 steps, 3e-2, of each tensor's largest magnitude): bf16 inputs, as the recipes' autocast
    gives them, against the references,
    which compute in fp32 from the same inputs and round their outputs (and autograd its gradients) to bf16 once, as
    the kernels do; Sinkhorn's logits stay fp32, as the model computes them. ``select``: run only the combinations
    it accepts (``SIZE_CASES``: one of each op with every part on, for a check at sizes where each combination costs
    the interpreter far more); every input is drawn as in the full run, so a selected case sees the same numbers."""
    gen = torch.Generator().manual_seed(0)
    shape = (*rows, d)
    seen = [] if seen is None else seen

    def randn(*size, grad=True, as_dtype=None):
        return torch.randn(*size, generator=gen, dtype=torch.float64).to(device, as_dtype or dtype) \
            .requires_grad_(grad)

    def weight(on):
        return (1 + 0.3 * randn(d, grad=False)).requires_grad_() if on else None

    def streams(stacked):
        if stacked:  # the two halves of one stacked state: strided rows, read in place
            state = randn(*rows, 2 * d)
            return [state], *state.chunk(2, -1)
        x, y = randn(*shape), randn(*shape)
        return [x, y], x, y

    def agree(expected, got, leaves, widths):
        probes = [randn(*rows, w, grad=False) for w in widths]
        results = []
        for fn in (expected, got):
            out = fn()
            out = out if isinstance(out, tuple) else (out,)
            loss = sum((a * b).sum() for a, b in zip(out, probes) if a is not None)
            results.append((out, torch.autograd.grad(loss, leaves, allow_unused=True)))

        def close(a, b):
            if a is None or b is None:
                return a is None and b is None
            if dtype == torch.float64:  # fp32 inside: a sum's rounding grows with the magnitudes it sums, so the
                # absolute tolerance is tol of the tensor's largest value (tol itself below 1)
                return torch.allclose(a, b, atol=tol * max(1.0, float(b.detach().abs().max())), rtol=tol)
            # bf16: within tol of the tensor's largest magnitude (a sum of a few rounded terms can cancel to a
            # small value that one ulp of a term moves by far more than tol of itself)
            return bool((a.float() - b.float()).abs().max() <= tol * b.float().abs().max().clamp_min(1e-6))

        return all(map(close, results[0][0], results[1][0])) and all(map(close, results[0][1], results[1][1]))

    bad = []
    for two, has_o, x_norm, wx, wy, g, in_norm, win, stacked in itertools.product([True, False], repeat=9):
        if not two and (x_norm or wx or g):
            continue  # one stream: no X, no LN^X, no gamma
        leaves, x, y = streams(stacked)
        x = x if two else None
        o = randn(*shape) if has_o else None
        kw = dict(scale=0.37, x_norm=x_norm, x_weight=weight(wx and x_norm), y_weight=weight(wy), gamma=weight(g),
                  in_norm=in_norm, in_weight=weight(win and in_norm))
        leaves = leaves + [t for t in (o, *kw.values()) if isinstance(t, Tensor)]
        case = dict(two=two, has_o=has_o, x_norm=x_norm, wx=wx, wy=wy, g=g, in_norm=in_norm, win=win, stacked=stacked)
        if select is not None and not select(case):
            continue
        seen.append(case)
        if not agree(lambda: reference(x, y, o, **kw), lambda: stream_input(x, y, o, **kw), leaves, (d, d, d)):
            bad.append(case)
    for stacked in (False, True):
        leaves, x, y = streams(stacked)
        o = randn(*shape)
        if select is not None and not select(dict(stream_add=True, stacked=stacked)):
            continue
        seen.append(dict(stream_add=True, stacked=stacked))
        if not agree(lambda: torch.cat([x + o * 0.37, y + o], -1), lambda: stream_add(x, y, o, scale=0.37),
                     leaves + [o], (2 * d,)):
            bad.append(dict(stream_add=True, stacked=stacked))
    hd = 128 if d >= 1024 else 8  # at the recipes' width, their head size (d_model 2048 / 16 heads)
    angles = torch.arange(rows[-1], dtype=torch.float64)[:, None] * 0.7 ** torch.arange(hd // 2)
    tables = tuple(f(torch.cat([angles, angles], -1)).float().to(device) for f in (torch.sin, torch.cos))

    def heads(n_q, n_kv, strided):  # (leaf, qkv): strided, rows read in place, width + 5 apart
        width = (n_q + 2 * n_kv) * hd
        base = randn(*rows, width + 5 if strided else width)
        return base, (base[..., 2:2 + width] if strided else base)

    for affine, (n_q, n_kv), strided, rope in itertools.product([True, False], [(3, 3), (4, 2)], [False, True],
                                                               [False, True]):
        base, qkv = heads(n_q, n_kv, strided)
        ws = [(1 + 0.3 * randn(hd, grad=False)).requires_grad_() if affine else None for _ in range(3)]
        kw = dict(n_q=n_q, n_kv=n_kv, head_dim=hd, rope=tables if rope else None)
        case = dict(head_norm=True, affine=affine, n_q=n_q, n_kv=n_kv, strided=strided, rope=rope)
        if select is not None and not select(case):
            continue
        seen.append(case)
        if not agree(lambda: head_reference(qkv, *ws, **kw), lambda: head_norm(qkv, *ws, **kw),
                     [base] + [w for w in ws if w is not None], (n_q * hd, n_kv * hd, n_kv * hd)):
            bad.append(case)
    for (n_q, n_kv), strided in itertools.product([(3, 3), (4, 2)], [False, True]):
        base, qkv = heads(n_q, n_kv, strided)
        kw = dict(n_q=n_q, n_kv=n_kv, head_dim=hd, rope=tables)
        case = dict(qkv_rope=True, n_q=n_q, n_kv=n_kv, strided=strided)
        if select is not None and not select(case):
            continue
        seen.append(case)
        if not agree(lambda: head_reference(qkv, None, None, None, normalise=False, **kw), lambda: qkv_rope(qkv, **kw),
                     [base], (n_q * hd, n_kv * hd, n_kv * hd)):
            bad.append(case)
    for n, columns_first, iterations in itertools.product([4, 3], [True, False], [1, 20]):
        logits = (2 * randn(*rows, n * n, grad=False, as_dtype=torch.float64 if dtype == torch.float64
                            else torch.float32)).unflatten(-1, (n, n)).requires_grad_()  # far from uniform
        order = "columns_first" if columns_first else "rows_first"
        case = dict(sinkhorn=True, n=n, order=order, iterations=iterations)
        if select is not None and not select(case):
            continue
        seen.append(case)
        if not agree(lambda: sinkhorn_reference(logits, iterations, order).flatten(-2),
                     lambda: sinkhorn(logits, iterations, columns_first).flatten(-2), [logits], (n * n,)):
            bad.append(case)
    for n, widened in itertools.product([4, 3, 2], [False, True]):
        base = randn(*rows, d) if widened else randn(*rows, n * d)
        h = base.unsqueeze(-2).expand(*rows, n, d) if widened else base.unflatten(-1, (n, d))  # block 0 / stacked
        m, b, f = randn(*rows, n, n), randn(*rows, n), randn(*shape)
        case = dict(stream_mix=True, n=n, widened=widened)
        if select is not None and not select(case):
            continue
        seen.append(case)
        if not agree(lambda: mix_reference(h, m, b, f).flatten(-2), lambda: stream_mix(h, m, b, f).flatten(-2),
                     [base, m, b, f], (n * d,)):
            bad.append(case)
    # last, so that the cases above draw the inputs they always drew
    for two, x_norm, in_norm in itertools.product([True, False], repeat=3):
        if not two and x_norm:
            continue
        leaves, x, y = streams(False)
        x = x if two else None
        kw = dict(x_norm=x_norm, x_weight=weight(x_norm), y_weight=weight(True), in_norm=in_norm,
                  in_weight=weight(in_norm))
        leaves = (leaves if two else leaves[1:]) + [t for t in kw.values() if isinstance(t, Tensor)]
        case = dict(copy=True, two=two, x_norm=x_norm, in_norm=in_norm)
        if select is not None and not select(case):
            continue
        seen.append(case)
        # the copies used again downstream (their gradients return into the op's backward), as pre uses Y
        if not agree(lambda: _used_again(reference(x, y, None, **kw)),
                     lambda: _used_again(stream_input(x, y, None, copy=True, **kw)), leaves, (d, d, d)):
            bad.append(case)
    for has_o, x_norm, g, in_norm, w in itertools.product([True, False], repeat=5):
        (state,), x, y = streams(True)
        o = randn(*shape) if has_o else None
        kw = dict(scale=0.37, x_norm=x_norm, x_weight=weight(w and x_norm), y_weight=weight(w), gamma=weight(g),
                  in_norm=in_norm, in_weight=weight(w and in_norm))
        leaves = [state] + [t for t in (o, *kw.values()) if isinstance(t, Tensor)]
        case = dict(block_input=True, has_o=has_o, x_norm=x_norm, g=g, in_norm=in_norm, weights=w)
        if select is not None and not select(case):
            continue
        seen.append(case)
        if not agree(lambda: reference(x, y, o, **kw), lambda: block_input(state, o, **kw), leaves, (d, d, d)):
            bad.append(case)
    for has_o, form, stacked in itertools.product([True, False], ["static", "dynamic", "dynamic+w"], [False, True]):
        leaves, x, y = streams(stacked)
        o = randn(*shape) if has_o else None
        kw = dict(scale=0.37, bias=(0.8 + randn((), grad=False)).requires_grad_())
        if form != "static":  # a gate far above its init, so that the projection's gradients are not tiny
            kw.update(gate=(0.5 * randn((), grad=False)).requires_grad_(), proj=randn(2 * d),
                      norm_weight=(1 + 0.3 * randn(2 * d, grad=False)).requires_grad_() if form == "dynamic+w" else None)
        leaves = leaves + [t for t in (o, *kw.values()) if isinstance(t, Tensor)]
        case = dict(pair_mix=True, has_o=has_o, form=form, stacked=stacked)
        if select is not None and not select(case):
            continue
        seen.append(case)
        fused_call = (lambda: pair_mix(None, leaves[0], o, stacked=True, **kw)) if stacked else \
            (lambda: pair_mix(x, y, o, **kw))
        if not agree(lambda: pair_mix_reference(x, y, o, **kw), fused_call, leaves, (d, d)):
            bad.append(case)
    for k, strided in ((24, False), (6, True)):  # mHC's n = 4 over the flattened streams; hc's per stream, in place
        width = 4 * d if k == 24 else d
        base = randn(*rows, width + 7 if strided else width)
        x = base[..., 3:3 + width] if strided else base  # strided: rows read in place, width + 7 apart
        wp = randn(width, k, as_dtype=torch.float64 if dtype == torch.float64 else torch.float32)  # fp32, as the model
        case = dict(project=True, k=k, strided=strided)
        if select is not None and not select(case):
            continue
        seen.append(case)
        if not agree(lambda: project_reference(x, wp), lambda: rms_project(x, wp), [base, wp], (k,)):
            bad.append(case)
    for form, n, win, strided in itertools.product(["hc", "mhc"], [2, 4], [True, False], [False, True]):  # width ops
        flat = form == "mhc"
        k = n * n + 2 * n if flat else n + 2
        base = randn(*rows, n * d + 5 if strided else n * d)
        h = (base[..., 2:2 + n * d] if strided else base).unflatten(-1, (n, d))  # strided: tokens read in place
        fp = torch.float64 if dtype == torch.float64 else torch.float32  # the parameters' dtype: fp32, as the model's
        # logits of a few units, as the model's init gives (P ~ N(0, 1/N)): with N(0, 1) entries over mHC's 8,160
        # features they reach hundreds, and a_scale's gradient, a sum of d a x L over every token, cancels to
        # fp32's rounding of terms that large (measured 4e-4 of itself at d 2040 against the reference's order)
        proj = (3 * randn(n * d if flat else d, k, grad=False, as_dtype=fp) / (n * d if flat else d) ** 0.5) \
            .requires_grad_()
        a_static = (0.3 + randn(n, grad=False, as_dtype=torch.float64).abs()).requires_grad_()  # away from a sum of 0
        a_scale = (0.5 * randn(1, grad=False, as_dtype=torch.float64)).requires_grad_()
        in_weight = weight(win)
        kw = dict(proj_weight=(1 + 0.3 * randn(n * d if flat else d, grad=False, as_dtype=fp)).requires_grad_()
                  if win else None)  # the coefficient norm's weight, with the input norm's
        case = dict(width=form, n=n, win=win, strided=strided)
        if select is not None and not select(case):
            continue
        seen.append(case)
        # the caller reads the logits' other columns (hc: after each stream's first; mHC: after the n gates)
        # the copy read downstream, as the depth connection reads it: its gradient returns into the op's backward
        if not agree(lambda: _width_probe((*width_reference(h, proj, a_static, a_scale, in_weight, 1e-5, 1e-6, flat,
                                                            **kw), h), n, flat),
                     lambda: _width_probe((mhc_width if flat else hc_width)(h, proj, a_static, a_scale, in_weight,
                                                                            eps=1e-5, in_eps=1e-6, **kw), n, flat),
                     [t for t in (base, proj, kw["proj_weight"], a_static, a_scale, in_weight) if t is not None],
                     (k - n if flat else n * (k - 1), d, n * d)):
            bad.append(case)
    return bad


def _width_probe(outputs, n, flat):
    """(the logits' columns the caller reads, flattened per token; the input; the streams' copy, flattened)."""
    logits, inp, copy = outputs
    return (logits[..., n:] if flat else logits[..., 1:].flatten(-2)), inp, copy.flatten(-2)
