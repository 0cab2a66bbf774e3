"""siamesenorm.nn, the plain-PyTorch core: importable without ai2-olmo, and each topology, wrapped around an OLMo
model's own attention and MLP with its norm weights copied in, gives that model's logits."""

import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from conftest import tiny_config
from test_variants import ids, randomize

from siamesenorm import build_model
from siamesenorm import nn as snn


def test_core_imports_with_torch_alone():
    code = ("import sys; sys.modules['olmo'] = None; "
            "from siamesenorm.nn import SiameseNorm, SiameseFusion, PreNorm, PostNorm, HybridNorm, HyperConnections, "
            "ManifoldHyperConnections; "
            "assert not any(m.startswith('olmo.') for m in sys.modules); print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def rms(dim, source):
    """torch's RMSNorm holding an OLMo norm's weight (same formula: x / sqrt(mean(x^2) + eps) * w)."""
    norm = nn.RMSNorm(dim, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(source.weight)
    return norm


def attn(block, pre_norm=None):
    def branch(h):
        return block.attention_branch(h if pre_norm is None else pre_norm(h), None, None, False, None, None)[0]
    return branch


def mlp(block, pre_norm=None):
    return lambda h: block.mlp_branch(h if pre_norm is None else pre_norm(h))


def core_chain(model, model_type, cfg):
    """(expand, per-sublayer wrappers, reduce) built from siamesenorm.nn around the model's blocks."""
    d, blocks = cfg.d_model, list(model.transformer.blocks)
    wrappers = []
    for i, b in enumerate(blocks):
        if model_type == "post":
            pos = cfg.post_norm_position
            for branch, norm in ((attn(b), b.attn_norm), (mlp(b), b.ff_norm)):
                w = snn.PostNorm(d, branch, norm=lambda dim, n=norm: rms(dim, n), position=pos)
                wrappers.append(w)
        elif model_type == "hybrid":
            wrappers.append(snn.HybridNorm(d, attn(b), "attention"))
            wrappers.append(snn.HybridNorm(d, mlp(b), "mlp", norm=lambda dim, n=b.ff_norm: rms(dim, n)))
        elif model_type in ("post_pre", "hybrid_pre"):
            bounded = "post" if model_type == "post_pre" else "hybrid"
            knobs = dict(layer=i, bounded=bounded, x_norm_position=cfg.post_pre_x_norm_position,
                         depth_scaling_form=cfg.siamese_depth_scaling_form,
                         normalized_input=cfg.siamese_normalized_input)
            for sub, branch in (("attention", attn(b)), ("mlp", mlp(b))):
                w = snn.SiameseNorm(d, branch, sublayer=sub, norm=lambda dim: nn.RMSNorm(dim, eps=1e-5), **knobs)
                prefix = "attn" if sub == "attention" else "ff"
                with torch.no_grad():
                    w.y_norm.weight.copy_(getattr(b, f"{prefix}_norm_y").weight)
                    if w.x_norm is not None:
                        w.x_norm.weight.copy_(getattr(b, f"{prefix}_norm_x").weight)
                    if w.in_norm is not None:
                        w.in_norm.weight.copy_(getattr(b, f"{prefix}_norm").weight)
                    if w.gamma is not None:
                        w.gamma.copy_(b.gamma)
                wrappers.append(w)
        elif model_type in ("hc", "mhc"):
            n = cfg.hc_expansion_rate if model_type == "hc" else cfg.mhc_expansion_rate
            for sub, make in (("attn", attn), ("ff", mlp)):
                source = getattr(b, f"{sub}_{model_type}")
                branch = make(b, getattr(b, f"{sub}_norm"))
                if model_type == "hc":
                    w = snn.HyperConnections(n, d, branch, layer=i, norm=lambda dim: nn.RMSNorm(dim, eps=1e-5))
                else:
                    w = snn.ManifoldHyperConnections(n, d, branch, norm=lambda dim: nn.RMSNorm(dim, eps=1e-5),
                                                     iterations=cfg.mhc_sinkhorn_iterations,
                                                     order=cfg.mhc_sinkhorn_order)
                w_params = dict(w.named_parameters())
                with torch.no_grad():
                    for name, p in source.named_parameters():
                        w_params[name].copy_(p)
                wrappers.append(w)
    if model_type in ("post_pre", "hybrid_pre"):
        last = blocks[-1]
        fusion = snn.SiameseFusion(d, norm=lambda dim: nn.RMSNorm(dim, eps=1e-5))
        with torch.no_grad():
            fusion.x_norm.weight.copy_(last.out_norm_x.weight)
            fusion.y_norm.weight.copy_(last.out_norm_y.weight)
        return snn.SiameseNorm.expand, wrappers, fusion
    if model_type == "hc":
        return (lambda x: snn.HyperConnections.expand(x, cfg.hc_expansion_rate)), wrappers, snn.HyperConnections.reduce
    if model_type == "mhc":
        return ((lambda x: snn.ManifoldHyperConnections.expand(x, cfg.mhc_expansion_rate)), wrappers,
                snn.ManifoldHyperConnections.reduce)
    return (lambda x: x), wrappers, (lambda x: x)


CASES = [
    ("post", {}), ("post", {"post_norm_position": "before_sublayer"}), ("hybrid", {}),
    ("post_pre", {}), ("post_pre", {"post_pre_x_norm_position": "after_addition",
                                    "siamese_depth_scaling_form": "inv_sqrt_layer"}),
    ("post_pre", {"siamese_normalized_input": False}),
    ("hybrid_pre", {}), ("hybrid_pre", {"siamese_normalized_input": False}),
    ("hc", {}), ("hc", {"hc_expansion_rate": 3}), ("mhc", {"mhc_expansion_rate": 2, "mhc_sinkhorn_iterations": 5}),
]


@pytest.mark.parametrize("model_type,overrides", CASES, ids=[m + "".join(f"-{v}" for v in o.values()) for m, o in CASES])
def test_core_gives_the_olmo_models_logits(model_type, overrides):
    cfg = tiny_config(**overrides)
    model = randomize(build_model(cfg, model_type)).eval()
    tokens = ids()
    expand, wrappers, reduce = core_chain(model, model_type, model.config)
    with torch.no_grad():
        state = expand(model.transformer.wte(tokens))
        for w in wrappers:
            state = w(state)
        h = model.transformer.ln_f(reduce(state))
        want = h @ model.transformer.wte.weight.T
        torch.testing.assert_close(model(tokens).logits, want, rtol=1e-4, atol=1e-4)


def test_wrappers_register_module_branches_and_train():
    """A module branch is a submodule (its weights are in the wrapper's parameters) and gradients reach it."""
    mlp_branch = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    w = snn.SiameseNorm(8, mlp_branch, layer=0, sublayer="mlp")
    assert any(p is mlp_branch[0].weight for p in w.parameters())
    x, y = w(snn.SiameseNorm.expand(torch.randn(2, 5, 8)))
    (x.sum() + y.sum()).backward()
    assert mlp_branch[0].weight.grad is not None and mlp_branch[0].weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="norm position"):
        snn.SiameseNorm(8, mlp_branch, layer=0, x_norm_position="middle")


@pytest.mark.slow
def test_vit_example_learns_digits_with_pre_norm_and_siamese_norm():
    """examples/vit_digits.py, briefly: well above the 10% of chance on held-out digits."""
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "examples"))
    import vit_digits

    for topology in ("pre", "siamese"):
        acc = vit_digits.train(topology, steps=120, depth=2, lr=3e-3)
        assert acc > 0.6, (topology, acc)


def test_stream_mixing_is_the_sinkhorn_limit_of_a_two_by_two_h_res():
    """SiameseNorm's stream mixing computes mHC's Sinkhorn projection of a 2 x 2 H_res in closed form: for any M,
    Sinkhorn(exp(M)) -> [[p, 1-p], [1-p, p]] with logit p = (M11 + M22 - M12 - M21) / 2. The mix keeps X + Y and,
    at init, keeps siamese_mixing_init of each stream."""
    torch.manual_seed(0)
    M = torch.randn(64, 2, 2)  # Sinkhorn runs in fp32 (and converges slowly for extreme M)
    limit = snn.sinkhorn(M, iterations=500)
    p = torch.sigmoid((M[:, 0, 0] + M[:, 1, 1] - M[:, 0, 1] - M[:, 1, 0]) / 2)
    torch.testing.assert_close(limit[:, 0, 0], p, rtol=0, atol=2e-6)
    torch.testing.assert_close(limit[:, 0, 1], 1 - p, rtol=0, atol=2e-6)
    torch.testing.assert_close(limit[:, 1, 1], p, rtol=0, atol=2e-6)

    x, y = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    for form in ("static", "dynamic"):
        mixing = snn.StreamMixing(16, form, init=0.9)
        with torch.no_grad():
            if form == "dynamic":
                mixing.gate.fill_(1.0)
            mx, my = mixing(x, y)
        torch.testing.assert_close(mx + my, x + y)
        coefficient = mixing.coefficient(x, y)
        if form == "static":
            assert float(coefficient) == pytest.approx(0.9)
        else:  # per token, and not all the same
            assert coefficient.shape == (2, 5, 1) and float(coefficient.std()) > 1e-3
        torch.testing.assert_close(mx, coefficient * x + (1 - coefficient) * y)
    with pytest.raises(ValueError, match="unknown"):
        snn.StreamMixing(16, "learned")


@pytest.mark.parametrize("compiling", [False, True])
@pytest.mark.parametrize("layout", ["s", "js", "sj"])
def test_the_streams_weighted_sums_agree_in_every_layout_eager_and_compiled(monkeypatch, layout, compiling):
    """hc's and mHC's branch input and stream mix: the eager einsum and the broadcast form inductor fuses (chosen by
    torch.compiler.is_compiling, patched here) both give sum_s m[.., s, ..] h_s, written as a loop over the streams."""
    from siamesenorm.nn.topologies import _mix_streams

    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)
    gen = torch.Generator().manual_seed(0)
    n, k, d = 4, 3, 5
    h = torch.randn(2, 7, n, d, generator=gen, dtype=torch.float64)
    m = torch.randn(2, 7, *{"s": (n,), "js": (k, n), "sj": (n, k)}[layout], generator=gen, dtype=torch.float64)
    weight = {"s": lambda s: m[..., s, None], "js": lambda s: m[..., :, s, None], "sj": lambda s: m[..., s, :, None]}
    expected = sum(weight[layout](s) * (h[..., s, :] if layout == "s" else h[..., None, s, :]) for s in range(n))
    out = _mix_streams(h, m, layout)
    assert out.shape == ((2, 7, d) if layout == "s" else (2, 7, k, d))
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_the_branch_inputs_weight_gradient_is_a_matrix_vector_product():
    """Eager, the weighted sum of the streams for a branch input is H^T m, so that its weights' gradient is H g, an
    (n, d) @ (d, 1) product a token: as g H^T, a (1, d) @ (d, n) product, it went to a tensor-core kernel of 32 x 32
    tiles on an H100 (results/gpu/h100-2026-11-27: 1.25 ms a call)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from siamesenorm.nn.topologies import _mix_streams

    products = []

    class Products(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in (torch.ops.aten.bmm.default, torch.ops.aten.mm.default):
                products.append((tuple(args[0].shape), tuple(args[1].shape)))
            return out

    n, d = 4, 64
    h = torch.randn(3, 5, n, d, dtype=torch.float64, requires_grad=True)
    m = torch.randn(3, 5, n, dtype=torch.float64, requires_grad=True)
    out = _mix_streams(h, m, "s")
    g = torch.randn_like(out)
    with Products():
        out.backward(g)
    # every product's output is a column (n x 1, the weights' gradient) or its reduction is 1 long (the streams'
    # gradient, an outer product); none reduces over d into a 1 x n row
    assert products and all(b[-1] == 1 or a[-1] == 1 for a, b in products), products
    assert not any(a[-2] == 1 and a[-1] == d for a, b in products), products
    torch.testing.assert_close(m.grad, (h * g.unsqueeze(-2)).sum(-1).detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h.grad, m.unsqueeze(-1).detach() * g.unsqueeze(-2), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("norm", ["torch_rms", "olmo_rms", "layer_norm"])
def test_depth_attention_over_a_view_and_the_blocks_outputs_is_its_equation(norm):
    """AttnRes's read h = sum_i softmax_i(w . KeyNorm(v_i)) v_i, sources given as a (..., S, d) view plus loose
    (..., d) tensors: equal, values and every gradient, to the equation on the stacked sources. With an RMSNorm key
    (torch's or OLMo's) the read folds the scale into the query and never normalises a copy; a LayerNorm key takes
    the written path. A zero source (a zero-initialised branch) keeps the gradients finite."""
    from olmo.config import LayerNormType, ModelConfig
    from olmo.model import LayerNorm as OLMoLayerNorm

    from siamesenorm.nn.topologies import _rms_key, depth_attention

    torch.manual_seed(0)
    d = 16
    key = {"torch_rms": lambda: nn.RMSNorm(d, eps=1e-5),
           "olmo_rms": lambda: OLMoLayerNorm.build(ModelConfig(d_model=d, layer_norm_type=LayerNormType.rms,
                                                                      include_bias=False)),
           "layer_norm": lambda: nn.LayerNorm(d)}[norm]()
    with torch.no_grad():
        for p in key.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    assert (_rms_key(key) is None) == (norm == "layer_norm")
    state = torch.randn(2, 5, 4 * d, dtype=torch.float64).float().requires_grad_(True)
    loose = [torch.randn(2, 5, d, requires_grad=True), torch.zeros(2, 5, d, requires_grad=True)]
    query = torch.randn(d, requires_grad=True)
    held = state.unflatten(-1, (4, d))[..., 1:, :]  # a view: no copy of the state
    got = depth_attention(held, query, key, loose)
    everything = torch.cat([held, torch.stack(loose, dim=-2)], dim=-2)
    want = (key(everything) @ query).softmax(-1).unsqueeze(-1).mul(everything).sum(-2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    upstream = torch.randn_like(got)
    leaves = [state, *loose, query, *key.parameters()]
    g_got = torch.autograd.grad(got, leaves, upstream)
    g_want = torch.autograd.grad(want, leaves, upstream)
    for a, b in zip(g_got, g_want):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # a LayerNorm's bias: zero up to rounding
    assert g_got[0][..., :d].abs().max() == 0  # the first source was not read
    assert depth_attention(held[..., :1, :], query, key).equal(held[..., 0, :])  # one source: itself
