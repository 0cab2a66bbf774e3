"""Every MODEL_TYPE over OLMo-core's MoE block: the feed-forward F of the update rules is OLMo-core's MoE (its
router, experts and auxiliary losses), the topology around it ours.

- an MoE of one expert, routed with weight 1, is the dense SwiGLU: with the dense weights moved into that expert,
  every MODEL_TYPE gives the dense OLMo-core model's logits (observed difference 0.0);
- the PyTorch permutation kernels (siamesenorm/olmo_core/moe_kernels.py, CPU stand-ins for OLMo-core's Triton
  ones) against a loop over tokens that follows the contract written in that module, forward and backward,
  with and without capacity drops;
- a recipe's ``moe:`` maps to OLMo-core's MoE config; the ai2-olmo path refuses it in one line; the v2-shaped MoE
  recipe has the sizes it states, counted by OLMo-core on the meta device.
"""

import pytest
import torch
from conftest import tiny_config

from siamesenorm.models.config import MODEL_TYPES

olmo_core_config = pytest.importorskip("siamesenorm.olmo_core.config")
from olmo_core.ops import moe as moe_ops  # noqa: E402

from siamesenorm.olmo_core import blocks as core_blocks  # noqa: E402
from siamesenorm.olmo_core import moe_kernels  # noqa: E402
from siamesenorm.run.recipe import MoESettings, RunError, load_config, validate_run  # noqa: E402


def _moved_off_init(model, seed=0):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def _dense_into_one_expert(dense_state, moe_model):
    """The dense model's state with each block's SwiGLU (w1, w2, w3) as the MoE's single expert, in the layout of
    OLMo-core's expert MLP (dropless: (experts * hidden, d) for all three)."""
    state = {}
    for name, value in dense_state.items():
        if ".feed_forward." in name:
            block, rest = name.split(".feed_forward.")
            matrix = rest.split(".")[0]
            state[f"{block}.feed_forward_moe.experts.mlp.{matrix}"] = value.t().contiguous() if matrix == "w2" \
                else value
        else:
            state[name] = value
    for name, value in moe_model.state_dict().items():
        if ".router." in name:
            state[name] = torch.randn_like(value)  # any router: softmax over one expert is 1
    return state


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_one_expert_moe_gives_the_dense_logits(model_type):
    config = tiny_config(weight_tying=False, mixln_post_fraction=0.5)
    dense = _moved_off_init(olmo_core_config.transformer_config(config, model_type=model_type).build())
    hidden = dense.blocks["0"].feed_forward.w1.weight.shape[0]
    moe_settings = MoESettings(num_experts=1, top_k=1, hidden_size=hidden, z_loss_weight=None)
    moe = olmo_core_config.transformer_config(config, model_type=model_type, moe=moe_settings).build()
    assert type(moe).__name__ == "MoETransformer"
    assert all(type(b) is core_blocks.CORE_MOE_BLOCKS[model_type] for b in moe.blocks.values())
    assert all(b.is_moe for b in moe.blocks.values())
    missing, unexpected = moe.load_state_dict(_dense_into_one_expert(dense.state_dict(), moe), strict=False)
    assert (missing, unexpected) == ([], [])
    ids = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = dense.eval()(ids), moe.eval()(ids)
    assert (got - expected).abs().max().item() <= 1e-5


def _routing(tokens, experts, top_k, seed):
    generator = torch.Generator().manual_seed(seed)
    choice = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])
    flat = choice.flatten()
    indices = torch.sort(flat, stable=True).indices.int()
    bins = torch.cumsum(torch.bincount(flat, minlength=experts), 0).int()
    weights = torch.rand(tokens * top_k, generator=generator, dtype=torch.float64)
    return choice, indices, bins, weights


def _reference_binned(x, choice, weights, capacity, expert_fn):
    """Each token's sum over its choices of weight * expert(x), skipping a choice past its expert's capacity
    (an expert takes its slots in slot order)."""
    tokens, top_k = choice.shape
    taken = {}
    out = torch.zeros_like(x)
    for slot in range(tokens * top_k):
        token, expert = slot // top_k, int(choice.flatten()[slot])
        taken[expert] = taken.get(expert, 0) + 1
        if capacity is None or taken[expert] <= capacity:
            out[token] = out[token] + weights[slot] * expert_fn(expert, x[token])
    return out


@pytest.mark.parametrize("capacity", [None, 3])
def test_pytorch_permutation_kernels_follow_the_contract(capacity):
    tokens, experts, top_k, width = 12, 4, 2, 5
    choice, indices, bins, weights = _routing(tokens, experts, top_k, seed=capacity or 0)
    if capacity is not None:
        assert int(torch.diff(bins, prepend=bins.new_zeros(1)).max()) > capacity  # some slots are dropped
    scale = torch.randn(experts, width, dtype=torch.float64)

    def expert_fn(e, row):
        return torch.tanh(row * scale[e])

    x = torch.randn(tokens, width, dtype=torch.float64, requires_grad=True)
    w = weights.clone().requires_grad_(True)
    if capacity is None:  # the dropless ops: no padding, slots in expert order
        sorted_rows = moe_ops.GatherOp.apply(x, indices, None, bins, top_k)
        experts_of = choice.flatten()[indices.long()]
        out_rows = torch.stack([expert_fn(int(e), r) for e, r in zip(experts_of, sorted_rows)])
        got = moe_ops.ScatterOp.apply(out_rows, indices, None, w, bins, top_k)
    else:
        buffer = moe_ops.BinnedGatherOp.apply(x, indices, bins, capacity, top_k)
        assert buffer.shape == (experts, capacity, width)
        out_buffer = torch.stack([expert_fn(e, buffer[e]) for e in range(experts)])
        got = moe_ops.BinnedScatterOp.apply(out_buffer, indices, w, bins, top_k)
    x_ref = x.detach().clone().requires_grad_(True)
    w_ref = weights.clone().requires_grad_(True)
    expected = _reference_binned(x_ref, choice, w_ref, capacity, expert_fn)
    assert torch.allclose(got, expected, atol=1e-12)
    probe = torch.randn_like(expected)
    (got * probe).sum().backward()
    (expected * probe).sum().backward()
    assert torch.allclose(x.grad, x_ref.grad, atol=1e-12)
    assert torch.allclose(w.grad, w_ref.grad, atol=1e-12)
    if capacity is not None:
        assert (w.grad == 0).sum() > 0  # a dropped slot's weight gets no gradient


def test_kernels_are_only_installed_where_olmo_core_has_none(monkeypatch):
    sentinel = object()
    monkeypatch.setattr(moe_ops, "kernels", sentinel)
    assert moe_kernels.install() is False and moe_ops.kernels is sentinel  # Triton's stay
    monkeypatch.setattr(moe_ops, "kernels", None)
    assert moe_kernels.install() is True and moe_ops.kernels.binned_gather is moe_kernels.binned_gather


def test_moe_trains_the_router_and_experts_and_reports_its_losses():
    config = tiny_config(weight_tying=False)
    settings = MoESettings(num_experts=4, top_k=2, hidden_size=24, shared_hidden_size=16)
    model = olmo_core_config.transformer_config(config, model_type="hybrid_pre", moe=settings).build()
    model.init_weights(device=torch.device("cpu"))
    block = model.blocks["1"]
    assert block.feed_forward_moe.shared_mlp is not None and block.top_k == 2
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    logits = model(ids)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
    for name in ("feed_forward_moe.router.weight", "feed_forward_moe.experts.mlp.w1", "gamma", "attn_norm_y.weight"):
        grad = block.get_parameter(name).grad
        assert grad is not None and grad.abs().sum() > 0, name
    metrics = model.compute_auxiliary_metrics()
    assert metrics["load balancing loss"][0] > 0 and metrics["router Z loss"][0] > 0


def test_deepnorm_and_hc_scale_the_experts_at_init():
    from siamesenorm.variants.deepnorm import deepnorm_beta

    config = tiny_config(weight_tying=False)
    settings = MoESettings(num_experts=4, top_k=2, hidden_size=24, shared_hidden_size=16)
    models = {}
    for model_type in ("post", "deepnorm", "hc", "pre"):
        torch.manual_seed(0)
        model = olmo_core_config.transformer_config(config, model_type=model_type, moe=settings).build(
            init_device="meta")
        model.init_weights(device=torch.device("cpu"))
        models[model_type] = model.blocks["1"]
    beta = deepnorm_beta(config.n_layers)
    post, deep = models["post"].feed_forward_moe, models["deepnorm"].feed_forward_moe
    assert torch.allclose(deep.experts.mlp.w2, post.experts.mlp.w2 * beta)
    assert torch.allclose(deep.shared_mlp.w1.weight, post.shared_mlp.w1.weight * beta)
    assert torch.equal(deep.router.weight, post.router.weight)  # the router is not F's matrix
    hc, pre = models["hc"].feed_forward_moe, models["pre"].feed_forward_moe
    assert hc.experts.mlp.w2.std() < 0.8 * pre.experts.mlp.w2.std()
    assert torch.allclose(hc.experts.mlp.w1.std(), pre.experts.mlp.w1.std(), rtol=0.1)  # inputs untouched


def test_recipe_moe_maps_and_bad_values_are_one_line(monkeypatch, tmp_path):
    monkeypatch.delenv("MODEL_TYPE", raising=False)
    base = ["--save_folder=" + str(tmp_path / "run")]
    cfg = load_config("configs/tiny-cpu.yaml", base + ["--moe.num_experts=8", "--moe.top_k=2",
                                                       "--moe.capacity_factor=1.25"])
    moe = olmo_core_config.transformer_config(cfg.model, moe=cfg.moe).block.feed_forward_moe
    assert (moe.num_experts, moe.router.top_k, moe.hidden_size, str(moe.name)) == (8, 2, 64, "default")
    assert (moe.lb_loss_weight, moe.z_loss_weight) == (0.01, 0.001)
    with pytest.raises(RunError, match="train this recipe with scripts/train_olmo_core.py"):
        validate_run(cfg)  # the ai2-olmo path
    validate_run(cfg, olmo_core=True)
    for override, message in (("--moe.top_k=9", "moe.top_k"), ("--moe.capacity_factor=0", "moe.capacity_factor"),
                              ("--moe.lb_loss_weight=-1", "moe.lb_loss_weight")):
        bad = load_config("configs/tiny-cpu.yaml", base + ["--moe.num_experts=8", override])
        with pytest.raises(RunError, match=message) as err:
            validate_run(bad, olmo_core=True)
        assert "\n" not in str(err.value)


def test_the_v2_shaped_moe_recipe_has_the_sizes_it_states(monkeypatch):
    """configs/OLMoE-15B-A2B-1e-3.yaml: about 15B parameters, about 2B active, counted by the config (OLMo-core's
    count plus the variant's own parameters; equal to the model built on the meta device: nothing is allocated)."""
    monkeypatch.setenv("MODEL_TYPE", "hybrid_pre")
    cfg = load_config("configs/OLMoE-15B-A2B-1e-3.yaml", ["--save_folder=/tmp/unused-moe"])
    transformer = olmo_core_config.transformer_config(cfg.model, moe=cfg.moe)
    total, active = transformer.num_params, transformer.num_active_params
    assert 14.5e9 < total < 15.5e9 and 1.8e9 < active < 2.3e9, (total, active)
    model = transformer.build(init_device="meta")
    assert sum(p.numel() for p in model.parameters()) == total  # the variant's norms and gammas counted too
    assert type(model.blocks["0"]) is core_blocks.CORE_MOE_BLOCKS["hybrid_pre"]
    assert (cfg.optimizer.learning_rate, str(cfg.max_duration)) == (1e-3, "100e9T")
