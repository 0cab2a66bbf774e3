"""Every MODEL_TYPE against its written-out equations, and OLMo's machinery (generate, cache, checkpointing,
block groups) working unchanged on it."""

import pytest
import torch
from conftest import tiny_config
from olmo.config import ActivationCheckpointingStrategy
from reference import Ref

from siamesenorm import MODEL_TYPES, build_model, num_params_from_config
from siamesenorm.variants.prores import set_training_step

# (model_type, config overrides): every type, plus the knob settings that change the wiring.
CASES = [(mt, {}) for mt in MODEL_TYPES] + [
    ("hc", {"hc_expansion_rate": 1}),
    ("hc", {"hc_expansion_rate": 3}),
    ("post_pre", {"siamese_normalized_input": False, "siamese_depth_scaling_form": "inv_sqrt_layer"}),
    ("post_pre", {"post_pre_x_norm_position": "after_addition", "siamese_depth_scaling_form": "inv_sqrt_layer"}),
    ("post_pre", {"post_pre_x_norm_position": "after_addition", "siamese_normalized_input": False}),
    ("post", {"post_norm_position": "before_sublayer"}),
    ("hybrid_pre", {"siamese_depth_scaling_form": "inv_sqrt_layer"}),
    ("hybrid_pre", {"siamese_normalized_input": False}),
    ("hybrid_pre", {"siamese_depth_scaling": False}),
    ("mixln", {"mixln_post_fraction": 0.5}),
    ("mhc", {"mhc_expansion_rate": 2, "mhc_sinkhorn_iterations": 5}),
    ("mhc", {"mhc_expansion_rate": 1}),
    ("mhc", {"mhc_sinkhorn_order": "rows_first", "mhc_sinkhorn_iterations": 2}),
    ("keel", {"keel_alpha": "layers"}),
    ("prores", {"prores_layer_steps": 2}),  # at step 3: layer scales 1, 0.75, 0.5
    ("post_pre", {"siamese_mixing": "static"}),
    ("post_pre", {"siamese_mixing": "dynamic", "post_pre_x_norm_position": "after_addition"}),
    ("hybrid_pre", {"siamese_mixing": "dynamic"}),
    ("hybrid_pre", {"siamese_mixing": "static", "siamese_mixing_init": 0.6}),
    ("attnres", {"attnres_blocks": 1}),  # Block AttnRes, one block: the embedding and the running sum
    ("attnres", {"attnres_blocks": 3}),  # a block a layer
]
#: The optimizer steps taken before the forward these tests check (ProRes's scales depend on it; no other variant).
STEP = 3
IDS = [mt + "".join(f"-{k}={v}" for k, v in o.items()) for mt, o in CASES]


def randomize(model, scale=0.3):
    """Move every parameter off its initial value, so a swapped or missing weight changes the output."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 or "norm" in name or "gamma" in name or "static" in name or "scale" in name or "bias" in name:
                p.copy_(p + scale * torch.randn_like(p))
            else:
                p.add_(scale * 0.1 * torch.randn_like(p))
    return model


def ids(batch=2, length=12, vocab=96, seed=3):
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("model_type,overrides", CASES, ids=IDS)
def test_equals_its_equations(model_type, overrides):
    model = randomize(build_model(tiny_config(**overrides), model_type))
    assert set_training_step(model, STEP) == (model.config.n_layers if model_type == "prores" else 0)
    x = ids()
    with torch.no_grad():
        got = model(x).logits
        want = Ref(model, t=STEP)(x, model_type)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("model_type,overrides", CASES, ids=IDS)
def test_forward_backward_finite_every_parameter_trained(model_type, overrides):
    model = build_model(tiny_config(**overrides), model_type)
    out = model(ids()).logits
    loss = torch.nn.functional.cross_entropy(out[:, :-1].flatten(0, 1), ids()[:, 1:].flatten())
    loss.backward()
    assert torch.isfinite(out).all() and torch.isfinite(loss)
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"parameters with no gradient (DDP would fail): {missing}"
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("model_type,overrides", CASES, ids=IDS)
def test_parameter_count_from_config(model_type, overrides):
    cfg = tiny_config(**overrides)
    assert num_params_from_config(cfg, model_type) == build_model(cfg, model_type).num_params()
    untied = tiny_config(weight_tying=False, include_bias=True, n_kv_heads=2, **overrides)
    assert num_params_from_config(untied, model_type) == build_model(untied, model_type).num_params()


@pytest.mark.parametrize("model_type,overrides", CASES, ids=IDS)
def test_generate_with_kv_cache_equals_full_recomputation(model_type, overrides):
    model = randomize(build_model(tiny_config(**overrides), model_type)).eval()
    prompt, steps = ids(batch=2, length=5), 8
    generated = model.generate(prompt, max_steps=steps, beam_size=1).token_ids[:, 0]  # (B, steps)
    seq = prompt
    with torch.no_grad():
        for _ in range(steps):
            nxt = model(seq).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    greedy = seq[:, prompt.shape[1] :]
    eos = model.config.eos_token_id
    for row_gen, row_greedy in zip(generated.tolist(), greedy.tolist()):
        stop = row_greedy.index(eos) + 1 if eos in row_greedy else steps  # beam search pads after EOS
        assert row_gen[:stop] == row_greedy[:stop]


@pytest.mark.parametrize("model_type,overrides", CASES, ids=IDS)
def test_last_logits_only(model_type, overrides):
    model = randomize(build_model(tiny_config(**overrides), model_type)).eval()
    x = ids()
    with torch.no_grad():
        full = model(x).logits
        last = model(x, last_logits_only=True).logits
    assert last.shape == (x.shape[0], 1, full.shape[-1])
    torch.testing.assert_close(last[:, 0], full[:, -1], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["whole_layer", "fine_grained", "one_in_two"])
@pytest.mark.parametrize("model_type,overrides", CASES, ids=IDS)
def test_activation_checkpointing_same_loss_and_grads(model_type, overrides, strategy):
    def loss_and_grads(checkpointing):
        torch.manual_seed(0)
        model = randomize(build_model(tiny_config(**overrides), model_type))
        if checkpointing:
            model.set_activation_checkpointing(ActivationCheckpointingStrategy(strategy))
        loss = model(ids()).logits.square().mean()
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    loss_ref, grads_ref = loss_and_grads(False)
    loss_ckpt, grads_ckpt = loss_and_grads(True)
    torch.testing.assert_close(loss_ckpt, loss_ref, rtol=0, atol=0)
    for name in grads_ref:
        torch.testing.assert_close(grads_ckpt[name], grads_ref[name], rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("model_type,overrides", CASES, ids=IDS)
def test_block_groups_keep_every_stream(model_type, overrides):
    """The reference code's block groups dropped the y stream; ours carry the stacked state through groups."""
    flat = randomize(build_model(tiny_config(n_layers=6, **overrides), model_type)).eval()  # 6: attnres's blocks divide it
    grouped = build_model(tiny_config(n_layers=6, block_group_size=2, **overrides), model_type).eval()
    state = {}
    for name, value in flat.state_dict().items():
        if name.startswith("transformer.blocks."):
            i, rest = name[len("transformer.blocks.") :].split(".", 1)
            name = f"transformer.block_groups.{int(i) // 2}.{int(i) % 2}.{rest}"
        state[name] = value
    grouped.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(grouped(ids()).logits, flat(ids()).logits, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("blocks", [0, 1])
def test_attnres_state_is_read_by_the_analyses_as_one_stream(blocks):
    """attnres carries a growing number of sources: the analyses see one stream, the sources' sum (the state a
    Pre-Norm model would hold), and the depth probe's skipped block adds zero outputs, so the logits change but
    every shape holds."""
    from siamesenorm.analysis import probes

    model = randomize(build_model(tiny_config(attnres_blocks=blocks), "attnres")).eval()
    x = ids()
    names, per_layer = probes.layer_streams(model, x)
    assert names == ["residual"] and len(per_layer) == model.config.n_layers + 1
    assert all(len(layer) == 1 and layer[0].shape == (2, 12, 32) for layer in per_layer)
    embedding = model.transformer.wte(x)
    torch.testing.assert_close(per_layer[0][0], embedding)
    block1 = model.transformer.blocks[1]
    assert block1.n_streams == (3 if blocks == 0 else 2)  # Full: emb, attn0, mlp0; one block: emb, partial sum
    with torch.no_grad():
        full = model(x).logits
        with probes.layers_removed(model, [1]):
            skipped = model(x).logits
    assert skipped.shape == full.shape and not torch.allclose(skipped, full)
