"""model.fused_streams: the fused stream ops (siamesenorm/nn/fused.py) against autograd of their plain-torch reference,
in the torch path here and in the Triton kernels under Triton's interpreter (CPU); whole models fused against
unfused; one op each way for the cost model; the config check."""

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_config

from siamesenorm import build_model
from siamesenorm.ai2_olmo.trainer import compile_blocks
from siamesenorm.models.config import validate_model_config
from siamesenorm.nn import fused
from siamesenorm.perf import costmodel

ROOT = Path(__file__).resolve().parents[2]
#: Where scripts/setup_env.sh installs Triton for its interpreter (not into the environment: torch's CPU build
#: does not expect it there).
TRITON_TARGET = Path(sys.prefix) / "triton-interpreter"
#: Triton's interpreter in a child process: the Triton it needs and this checkout first on the path, then this folder
#: (for interpreter_memo.py), one thread. Each child's code starts with INTERPRETER_START.
INTERPRETER_ENV = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
                       PYTHONPATH=os.pathsep.join([str(TRITON_TARGET), str(ROOT), str(Path(__file__).parent)]))
#: the interpreter's patching once a jit function, not once a call (interpreter_memo.py: stream_input's combinations
#: in 39 % less CPU, the at-size pass in 7 % less), then the kernels, not the torch path
INTERPRETER_START = ("import interpreter_memo, torch; from siamesenorm.nn import fused; "
                     "assert fused.available(torch.zeros(1)), 'not the kernels'; ")
needs_interpreter = pytest.mark.skipif(not (TRITON_TARGET / "triton").is_dir(),
                                       reason=f"Triton for its interpreter is not in {TRITON_TARGET} "
                                       "(bash scripts/setup_env.sh puts it there)")


#: fused.check's cases of the width ops (hc_width, mhc_width), in its order.
WIDTH_CASES = [dict(width=f, n=n, win=w, strided=s) for f in ("hc", "mhc") for n in (2, 4) for w in (True, False)
               for s in (False, True)]


def test_torch_path_matches_autograd_of_the_reference():
    assert not fused.available(torch.zeros(1)), "this test is for the torch path (no CUDA, no TRITON_INTERPRET)"
    seen = []
    assert fused.check(seen=seen) == []
    # 256 two-stream + 32 one-stream + 6 with copy + 32 block_input + 2 stream_add + 16 head_norm + 4 qkv_rope + 8 sinkhorn
    # + 6 mix + 12 pair_mix + 2 rms_project + 16 width (hc, mhc)
    assert len(seen) == 392


def test_the_check_catches_a_wrong_head_norm_backward(monkeypatch):
    """head_norm's backward without the weights in d qkv: every combination with weights must fail."""
    original = fused._head_backward_impl

    def wrong(outs, grads, rstd, table, *args):
        return original(outs, grads, rstd, None, *args)[0], original(outs, grads, rstd, table, *args)[1]

    monkeypatch.setattr(fused, "_head_backward_impl", wrong)
    bad = fused.check()
    assert [b for b in bad if b.get("head_norm")] == [b for b in bad if b.get("affine")] and len(bad) == 8


def test_the_check_catches_a_head_norm_that_forgets_to_turn_back(monkeypatch):
    """head_norm's backward without RoPE's inverse (the outputs taken as the norm's output, the gradients as the
    norm's): exactly the 8 head-norm combinations with RoPE and the 4 of ``qkv_rope`` fail."""
    original = fused._head_backward_impl
    monkeypatch.setattr(fused, "_head_backward_impl", lambda outs, grads, rstd, table, rope, *args:
                        original(outs, grads, rstd, table, None, *args))
    bad = fused.check()
    assert len(bad) == 12 and all(b.get("qkv_rope") or b.get("head_norm") and b["rope"] for b in bad), bad


def test_the_check_catches_a_wrong_pair_mix_backward(monkeypatch):
    """SiameseNorm's stream mixing with the mixed streams' gradients swapped (dXM taken for dYM): exactly the 12
    pair_mix combinations must fail, whatever the form (p is far from 1/2 in every one)."""
    original = fused._pair_backward_torch

    def swapped(x, y, o, dxm, dym, *args):
        return original(x, y, o, dym, dxm, *args)

    monkeypatch.setattr(fused, "_pair_backward_torch", swapped)
    bad = fused.check()
    assert len(bad) == 12 and all(b.get("pair_mix") for b in bad), bad


def test_the_check_catches_a_wrong_project_backward(monkeypatch):
    """rms_project's backward without rstd's own gradient in dx (only the product's): both projection cases fail, and
    with dW's partial sums halved (a split lost) both fail again with the width ops', which share dW's kernel; nothing
    else does either time."""
    original_dx, original_dw = fused._project_dx_impl, fused._project_dw_impl
    monkeypatch.setattr(fused, "_project_dx_impl",
                        lambda x, wp, logits, rstd, dlog: original_dx(x, wp, logits * 0, rstd, dlog))
    cases = [dict(project=True, k=24, strided=False), dict(project=True, k=6, strided=True)]
    assert fused.check() == cases
    monkeypatch.setattr(fused, "_project_dx_impl", original_dx)
    monkeypatch.setattr(fused, "_project_dw_impl", lambda *args: original_dw(*args) * 0.5)
    # the width ops' dW is the same kernel: their 16 cases fail with it
    assert fused.check() == cases + WIDTH_CASES


def test_the_check_catches_a_wrong_width_backward(monkeypatch):
    """The width ops' backward (hc_width, mhc_width) with the input coefficients' path into the logits' gradient
    dropped (a_scale taken as 0 there), and then with every token's input rstd replaced by their mean: all 16 width
    cases fail each time, nothing else does."""
    original = fused._width_grads_torch

    def no_coefficient_path(h, wp, a_static, a_scale, *args):
        return original(h, wp, a_static, a_scale * 0, *args)[:2] + original(h, wp, a_static, a_scale, *args)[2:]

    monkeypatch.setattr(fused, "_width_grads_torch", no_coefficient_path)
    assert fused.check() == WIDTH_CASES
    monkeypatch.setattr(fused, "_width_grads_torch",
                        lambda h, wp, a_static, a_scale, in_weight, logits, rstd, rin, *rest:
                        original(h, wp, a_static, a_scale, in_weight, logits, rstd, rin * 0 + rin.mean(), *rest))
    assert fused.check() == WIDTH_CASES


def test_the_width_ops_refuse_mismatched_shapes_in_one_line():
    h = torch.zeros(2, 3, 4, 8)  # (B, T, n, d)
    for call, proj in ((fused.hc_width, torch.zeros(16, 6)), (fused.mhc_width, torch.zeros(8, 24))):  # rows: d, n d
        with pytest.raises(ValueError, match=f"{call.__name__} takes h") as raised:
            call(h, proj, torch.zeros(4), torch.zeros(1))
        assert "\n" not in str(raised.value)
    logits, inp, copy = fused.mhc_width(h + 1, torch.zeros(32, 24), torch.zeros(4), torch.zeros(1))
    assert logits.shape == (2, 3, 24) and inp.shape == (2, 3, 8) and torch.equal(copy, h + 1)
    logits, inp, copy = fused.hc_width(h + 1, torch.zeros(8, 6), torch.zeros(4), torch.zeros(1))
    assert logits.shape == (2, 3, 4, 6) and inp.shape == (2, 3, 8) and torch.equal(copy, h + 1)


def test_the_check_catches_a_wrong_backward(monkeypatch):
    """The same check with dO missing the depth scale on X's part: many combinations must fail."""
    original = fused._torch_backward

    def wrong(*args):
        dx, dy, do, grads = original(*args)
        return dx, dy, (dx + dy if do is not None and dx is not None else do), grads

    monkeypatch.setattr(fused, "_torch_backward", wrong)
    assert len(fused.check()) >= 64


@pytest.mark.slow
@needs_interpreter
def test_triton_kernels_in_the_interpreter():
    """The Triton kernels themselves (forward and backward, every flag, fp64 and bf16 inputs; then one combination an
    op at a size that runs every code path, fp64 and bf16), run by Triton's interpreter on CPU."""
    code = (INTERPRETER_START + "seen = []; "
            "print('{dtype}', 'mismatches', fused.check(dtype=torch.{dtype}, tol={tol}, seen=seen), len(seen)); "
            "seen = []; print('{big}', 'at size', 'mismatches', fused.check(d=2040, rows=(2, 33), "
            "dtype=torch.{big}, tol={big_tol}, seen=seen, select=fused.SIZE_CASES), len(seen))")
    # the two checks in two processes at once: the interpreter is single-threaded Python, the machines have 2 cores
    runs = {dtype: subprocess.Popen([sys.executable, "-c", code.format(dtype=dtype, tol=tol, big=big, big_tol=big_tol)],
                                    env=INTERPRETER_ENV, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for dtype, tol, big, big_tol in (("float64", 2e-5, "float64", fused.AT_SIZE_FP64_TOL),
                                                            ("bfloat16", 3e-2, "bfloat16", 3e-2))}
    for dtype, run in runs.items():
        out, err = run.communicate(timeout=1500)
        assert run.returncode == 0, err[-3000:]
        # fp64 inputs to 2e-5 elementwise; bf16 inputs (as autocast gives them) to 3e-2 of each tensor's largest
        # value against the references computed in fp32 from the same inputs: the kernels write bf16 gradients
        small, big = out.strip().splitlines()[-2:]
        assert small == f"{dtype} mismatches [] 392", out[-3000:]
        # then each op once with every part on at the recipes' width, where every code path runs: d = 2040 (a
        # 2048-wide row block with a partial tail, the stream mix's feature loop in 32 chunks of 64, the last partial;
        # the head norms at the recipes' head size, 128), 66 rows, two sequences of 33 (each launch's programs full
        # and the last one partial, 2 rows, with a sequence ending inside a program: the row-block backwards in 5
        # programs of 16 (fused._ROWS_PER_PROGRAM); Sinkhorn in 2 of 64 tokens; the stream mix in 5 of 16 tokens;
        # the coefficient projection in 3 programs of 32 rows over 128 chunks of 64 features (mHC's 8,160) or 32
        # (hc's 2,040), each ending in a partial chunk, and its weight gradient in row splits, the last partial,
        # hc's last ones empty). 130 rows
        # (2 x 65) ran the same paths with more full programs, at about twice the interpreter's time.
        # bf16 inputs within the tolerance above, fp64 inputs within fused.AT_SIZE_FP64_TOL of each tensor's largest
        # value: fp32 inside, the weights' gradients sum the rows' up to 8,160 features in another order than the
        # reference (measured up to 6e-5 at d 2048 over 130 rows; a wrong kernel differs by far more: the
        # monkeypatched checks above). About 3 minutes a process in the interpreter on this machine.
        assert big == f"{dtype} at size mismatches [] 18", out[-3000:]


def _perturbed_pair(model_type, **extra):
    """The same weights (norm scales moved off 1, so every scale's gradient matters) unfused and fused."""
    torch.manual_seed(0)
    plain = build_model(tiny_config(layer_norm_with_affine=True, **extra), model_type)
    with torch.no_grad():
        for p in plain.parameters():
            if p.dim() == 1:
                p.mul_(1 + 0.2 * torch.randn_like(p))
    fused_model = build_model(tiny_config(layer_norm_with_affine=True, fused_streams=True, **extra), model_type)
    fused_model.load_state_dict(plain.state_dict())  # the same parameter names: checkpoints load either way
    return plain, fused_model


#: fused ops per forward of the 3-layer tiny model: (stream_forward, head_norm_forward, sinkhorn_forward,
#: stream_mix_forward, project_forward). pre: two per block; SiameseNorm: three (the end of the last block is the
#: final fusion LN^out_X(X + O / c) + LN^out_Y(Y + O) as one op); every block one head_norm_forward (HybridNorm's norms with RoPE, or RoPE alone: ``qkv_rope``); hc and
#: mhc: per connection (two a block) one stream mix and the coefficients, the branch input and its Pre-Norm as one op
#: (width_forward); mhc one Sinkhorn too.
FUSED_OPS = {"pre": (6, 3, 0, 0, 0, 0), "hybrid_pre": (9, 3, 0, 0, 0, 0), "post_pre": (9, 3, 0, 0, 0, 0),
             "hybrid": (0, 3, 0, 0, 0, 0), "hybrid_star": (0, 3, 0, 0, 0, 0), "mhc": (0, 3, 6, 6, 0, 6),
             "hc": (0, 3, 0, 6, 0, 6)}


@pytest.mark.parametrize("model_type,extra", [
    ("pre", {}), ("hybrid_pre", {}), ("post_pre", {}), ("hybrid_pre", {"siamese_normalized_input": False}),
    ("post_pre", {"siamese_depth_scaling": False}), ("hybrid", {}), ("hybrid_star", {}),
    ("hybrid_pre", {"n_kv_heads": 2, "attention_layer_norm_with_affine": False}), ("mhc", {}),
    ("mhc", {"mhc_expansion_rate": 3, "mhc_sinkhorn_order": "rows_first"}), ("hc", {}),
    ("hc", {"hc_expansion_rate": 3}), ("hybrid_pre", {"siamese_mixing": "dynamic"}),
    ("post_pre", {"siamese_mixing": "dynamic"}), ("hybrid_pre", {"siamese_mixing": "static"}),
    ("post_pre", {"siamese_mixing": "static", "siamese_depth_scaling": False}),
])
def test_fused_model_matches_unfused(model_type, extra):
    plain, fused_model = _perturbed_pair(model_type, **extra)
    ids = torch.randint(0, 96, (2, 16))
    results = []
    for model in (plain, fused_model):
        logits = model(ids).logits
        logits.square().mean().backward()
        results.append((logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (logits_a, grads_a), (logits_b, grads_b) = results
    assert grads_a.keys() == grads_b.keys()
    assert (logits_a - logits_b).abs().max() < 1e-5
    largest = max(g.abs().max() for g in grads_a.values())
    for name in grads_a:
        # relative 1e-5, above 1e-7 of the largest gradient: mhc's H_res mixes near-identical streams at init (block
        # 0: copies of the embedding), so its biases get gradients of rounding size, 1e-12..1e-10, either way
        limit = 1e-5 * grads_a[name].abs().max() + 1e-7 * largest
        assert (grads_a[name] - grads_b[name]).abs().max() <= limit, name
    # the fused blocks ran the fused ops (not the unfused code under another flag)
    with costmodel._Counter() as counter:
        fused_model(ids)
    ran = tuple(counter.cost.by_op.get(op, [0])[0] for op in ("stream_forward", "head_norm_forward",
                                                               "sinkhorn_forward", "stream_mix_forward",
                                                               "project_forward", "width_forward"))
    assert ran == FUSED_OPS[model_type]
    # stream mixing: one pair_mix a mixed sublayer (block 0's attention has none: its streams are one embedding)
    assert counter.cost.by_op.get("pair_mix_forward", [0])[0] == (5 if "siamese_mixing" in extra else 0)


def test_after_addition_post_pre_ignores_the_flag_exactly():
    """post_pre's text reading (LN^X after the addition) has no fused form: the flag leaves it bit-identical."""
    plain, fused_model = _perturbed_pair("post_pre", post_pre_x_norm_position="after_addition")
    ids = torch.randint(0, 96, (2, 16))
    assert torch.equal(plain(ids).logits, fused_model(ids).logits)


def test_one_op_each_way_per_sublayer():
    """What the cost model sees of a fused post_pre middle block: three fused ops forward (the attention's input,
    the attention's add with the MLP's input, the MLP's add into the stacked state) and three backward."""
    cfg = tiny_config(layer_norm_with_affine=True, fused_streams=True)
    step = costmodel.step_cost(cfg, "post_pre", microbatch=2, seq_len=16, autocast=None)
    full = step["by_op"]
    assert full["forward"]["stream_forward"][0] == 3 * 3  # the last block's end: the final fusion, one op too
    assert full["backward"]["stream_backward"][0] == 3 * 3
    unfused = costmodel.step_cost(tiny_config(layer_norm_with_affine=True), "post_pre", 2, 16, autocast=None)
    for phase in ("forward", "backward"):
        assert step["layer"][phase]["kernels"] < unfused["layer"][phase]["kernels"] / 2
        assert step["layer"][phase]["bytes"] < unfused["layer"][phase]["bytes"]
        assert step["layer"][phase]["matmul_flops"] == unfused["layer"][phase]["matmul_flops"]


@pytest.mark.parametrize("model_type", ["post_pre", "hybrid_pre"])
def test_the_last_block_fuses_the_streams_in_one_op(model_type):
    """Outside its middle layers (the step less n x a middle layer: embedding, the first block's widening, the last
    block's end, ln_f, the loss) a fused two-stream step moves about 10 (B, T, d) passes more than fused pre's: the
    last block's update and final fusion LN^out_X(X + O / c) + LN^out_Y(Y + O) are one op each way. Run as eager
    RMSNorms and adds, that end moved about 170 passes more (11.8 GB a step at the 1.3B recipe). The only eager
    RMSNorm left in the step is OLMo's ln_f, as in pre."""
    cfg = tiny_config(layer_norm_with_affine=True, fused_streams=True)
    one_pass = 2 * 16 * cfg.d_model * 4  # one (B, T, d) fp32 read or write

    def outside(mt):
        step = costmodel.step_cost(cfg, mt, microbatch=2, seq_len=16, autocast=None)
        moved = {k: step[k]["forward"]["bytes"] + step[k]["backward"]["bytes"] for k in ("step", "layer")}
        return moved["step"] - cfg.n_layers * moved["layer"], step["by_op"]

    base, base_ops = outside("pre")
    extra, ops = outside(model_type)
    assert 0 < extra - base <= 12 * one_pass, (extra - base) / one_pass
    for phase in ("forward", "backward"):
        assert ops[phase].get("pow", [0])[0] == base_ops[phase].get("pow", [0])[0], phase


@pytest.mark.parametrize("fused_streams", [False, True])
@pytest.mark.parametrize("model_type", ["hc", "mhc"])
def test_the_connected_streams_leave_a_middle_block_as_a_view_not_a_copy(model_type, fused_streams):
    """hc's and mhc's connections carry the streams as one tensor (B, T, n, d); a middle block returns its view
    (B, T, n * d). It used to cat the unbound streams, a copy of the whole state forward and a stack of its gradients
    backward (4 (B, T, d) passes a layer at n = 2, 8 at n = 4, each way): no layer copies its streams now."""
    cfg = tiny_config(layer_norm_with_affine=True, fused_streams=fused_streams)
    n = 2 if model_type == "hc" else 4
    state = 4 * 64 * cfg.d_model * n * 4  # the streams' state, fp32: one read or write of it

    def copied(mt):  # bytes of cat and stack each phase (unfused RoPE's cats are pre's too)
        step = costmodel.step_cost(cfg, mt, microbatch=4, seq_len=64, autocast=None)
        return {phase: sum(ops.get(op, [0, 0])[1] for op in ("cat", "stack")) for phase, ops in step["by_op"].items()}

    mine, pre = copied(model_type), copied("pre")

    # forward: only the coefficient weights' small cat (0.09 states here); backward: the last block's stack of the gradients of the
    # streams it sums (read and write the state once). The copies made 4 states forward and 6 backward here.
    for phase, allowed in (("forward", 0.25), ("backward", 2.25)):
        above = mine[phase] - pre[phase]
        assert above < allowed * state, (phase, above / state)
    block = build_model(cfg, model_type).transformer.blocks[1]
    h = torch.randn(2, 5, n, cfg.d_model)
    out = block.finish_stacked(h)
    assert out.data_ptr() == h.data_ptr() and torch.equal(out, torch.cat(h.unbind(-2), dim=-1))


@pytest.mark.parametrize("model_type", ["pre", "post_pre", "hybrid_pre"])
def test_the_stream_ops_backward_reads_no_materialised_zero_gradient(model_type):
    """Outputs nothing downstream uses (X1, kept for the backward; Y1 or XA where a stream passes through) get no
    gradient: autograd would otherwise write a zero tensor of their shape for each that the kernel then reads
    (post_pre: two a layer). The fused layers' backward runs no ``zeros`` at all, and moves fewer bytes than with
    materialised gradients (fewer kernels; for the two streams fewer bytes too)."""
    cfg = tiny_config(layer_norm_with_affine=True, fused_streams=True)
    step = costmodel.step_cost(cfg, model_type, microbatch=2, seq_len=16, autocast=None)
    assert "zeros" not in step["by_op"]["backward"], step["by_op"]["backward"].get("zeros")
    setup = fused._setup

    def materialising(ctx, inputs, output):
        setup(ctx, inputs, output)
        ctx.set_materialize_grads(True)

    with pytest.MonkeyPatch.context() as patch:  # the op as it was: what the assertion above would catch
        patch.setattr(fused, "_setup", materialising)
        fused._stream_forward.register_autograd(fused._backward, setup_context=fused._setup)
        try:
            before = costmodel.step_cost(cfg, model_type, microbatch=2, seq_len=16, autocast=None)
        finally:
            fused._stream_forward.register_autograd(fused._backward, setup_context=setup)
    assert before["by_op"]["backward"]["zeros"][0] > 0
    now, then = step["layer"]["backward"], before["layer"]["backward"]
    assert now["kernels"] < then["kernels"]
    # pre's, in this tiny model, were empty; the two-stream layers' were (B, T, d) tensors
    assert now["bytes"] < then["bytes"] if model_type != "pre" else now["bytes"] == then["bytes"]


@pytest.mark.parametrize("model_type", ["post_pre", "hybrid_pre"])
def test_a_two_stream_block_takes_and_returns_its_stacked_state_whole(model_type, monkeypatch):
    """The block's first op reads the stacked state (X, Y) in place and its backward writes the state's gradient
    whole (``block_input``); the end-of-block add hands its gradient's halves on as they are. Against the same
    blocks fed the state's two halves as separate views (the form before): one ``cat`` fewer a block after the
    first (the join of the halves' gradients), fewer ``add`` (a half's gradients from two uses summed), fewer bytes
    backward and in all, the same gradients."""
    cfg = tiny_config(layer_norm_with_affine=True, fused_streams=True)
    whole = costmodel.step_cost(cfg, model_type, microbatch=2, seq_len=16, autocast=None)
    torch.manual_seed(0)
    model = build_model(cfg, model_type)
    ids = torch.randint(0, 96, (2, 16))
    model(ids).logits.square().mean().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    monkeypatch.setattr(type(model.transformer.blocks[1]), "fused_input",
                        lambda self, state, **kw: fused.stream_input(*self.split_streams(state), **kw))
    halves = costmodel.step_cost(cfg, model_type, microbatch=2, seq_len=16, autocast=None)
    model(ids).logits.square().mean().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-5, atol=1e-6, msg=name)
    new, old = whole["by_op"]["backward"], halves["by_op"]["backward"]
    assert new["cat"][0] == old["cat"][0] - (cfg.n_layers - 1)
    assert new["add"][0] < old["add"][0]
    assert whole["layer"]["backward"]["bytes"] < halves["layer"]["backward"]["bytes"]
    both = [sum(cost["layer"][phase]["bytes"] for phase in ("forward", "backward")) for cost in (whole, halves)]
    assert both[0] < both[1]


@pytest.mark.parametrize("change,words", [
    ({"layer_norm_type": "default"}, "layer_norm_type: default"),
    ({"bias_for_layer_norm": True}, "a norm bias"),
    ({"norm_after": True}, "norm_after: true"),
])
def test_fused_streams_needs_rms_without_bias(change, words):
    for model_type in ("pre", "hybrid_pre"):
        with pytest.raises(Exception) as raised:
            validate_model_config(tiny_config(fused_streams=True, **change), model_type)
        message = str(raised.value)
        assert "model.fused_streams" in message and words in message and "\n" not in message
    validate_model_config(tiny_config(**change), "pre")  # without the flag, pre takes any of these


@pytest.mark.slow
@pytest.mark.parametrize("model_type,extra", [("hybrid_pre", {}), ("mhc", {}), ("hc", {}),
                                              ("hybrid_pre", {"siamese_mixing": "dynamic"})])
def test_fused_blocks_compile_whole_and_match_eager(model_type, extra):
    """The fused ops are opaque to torch.compile (one custom op each way, with fake implementations): a fused block
    compiles as one graph (fullgraph) around them and gives eager's logits and gradients (mhc: compiled, the mixing
    is left to inductor and Sinkhorn stays one op; eager mixes in ``stream_mix``; SiameseNorm's mix stays
    ``pair_mix`` either way)."""
    eager = _perturbed_pair(model_type, n_layers=2, **extra)[1]
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    try:
        assert compile_blocks(compiled, {"fullgraph": True, "mode": None}) == 2
        ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
        for model in (eager, compiled):
            model(ids).logits.square().mean().backward()
        for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    finally:
        torch._dynamo.reset()


def _fused_and_unfused_costs(model_type):
    """The cost model's step (eager, fp32) of the tiny model with model.fused_streams, and without."""
    return [costmodel.step_cost(tiny_config(layer_norm_with_affine=True, fused_streams=on), model_type,
                                microbatch=2, seq_len=16, autocast=None) for on in (True, False)]


def _kept_unfused_and_fused(model_type, recompute):
    """Bytes autograd keeps for a 3-layer tiny model's step (2 x 16 tokens), [unfused, fused]."""
    return [costmodel._fake_saved_bytes(tiny_config(layer_norm_with_affine=True, fused_streams=on), model_type,
                                        n_layers=3, microbatch=2, seq_len=16, recompute=recompute,
                                        loss_chunk_tokens=None) for on in (False, True)]


def test_head_norm_is_one_op_each_way_and_keeps_no_more_than_unfused():
    """HybridNorm's Q/K/V norms fused: one op each way per block (not three norms of ~8 kernels), fewer bytes, and
    autograd keeps no more than the unfused norms with recompute (q, k, v are separate tensors: attention keeps v
    without the normalised q and k beside it)."""
    step, unfused = _fused_and_unfused_costs("hybrid")
    assert step["by_op"]["forward"]["head_norm_forward"][0] == 3
    assert step["by_op"]["backward"]["head_norm_backward"][0] == 3
    for phase in ("forward", "backward"):
        assert step["layer"][phase]["kernels"] < unfused["layer"][phase]["kernels"]
        assert step["layer"][phase]["bytes"] < unfused["layer"][phase]["bytes"]
    for model_type in ("hybrid", "hybrid_pre"):
        kept = _kept_unfused_and_fused(model_type, recompute=True)
        assert kept[1] <= kept[0], (model_type, kept)


def test_fused_head_norms_keep_what_attention_keeps_and_nothing_of_their_own():
    """The fused head norms (RoPE inside) recompute from their outputs, which attention keeps anyway: fused hybrid_pre
    keeps exactly what fused post_pre keeps (the same second stream; both rotate q and k in one op, ``qkv_rope`` for
    post_pre) plus rstd, one fp32 number a head, token and layer; the single-stream HybridNorm keeps less than pre.
    Recomputing from qkv, as the op did before, kept qkv beside attention's own q, k, v (3 (B, T, d) tensors a layer
    more), and both comparisons failed."""
    cfg = tiny_config()
    kept = {mt: _kept_unfused_and_fused(mt, recompute=True)[1] for mt in ("pre", "hybrid", "hybrid_pre", "post_pre")}
    rstd = 3 * (2 * 16) * (cfg.n_heads + 2 * cfg.effective_n_kv_heads) * 4  # layers x tokens x heads x fp32
    assert kept["hybrid_pre"] - kept["post_pre"] == rstd, kept
    assert kept["hybrid"] < kept["pre"], kept


@pytest.mark.parametrize("model_type", ["hybrid_pre", "hybrid", "pre", "post_pre"])
def test_fused_rope_with_a_kv_cache_is_left_to_olmo(model_type):
    """Generation: OLMo caches k before RoPE, so with a cache the fused ops (the head norms, ``qkv_rope``) leave RoPE
    to OLMo's attention; logits of the last tokens run with the cache equal those of the whole sequence run at once
    (RoPE inside the op), and of the unfused model."""
    plain, fused_model = _perturbed_pair(model_type)
    ids = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        whole = fused_model(ids).logits
        first = fused_model(ids[:, :8], use_cache=True)
        rest = fused_model(ids[:, 8:], past_key_values=first.attn_key_values, use_cache=True).logits
        assert (torch.cat([first.logits, rest], 1) - whole).abs().max() < 1e-5
        assert (plain(ids).logits - whole).abs().max() < 1e-5


def test_fused_mhc_is_fewer_kernels_and_bytes_and_keeps_less():
    """mhc fused: Sinkhorn one op each way per connection (2 a block), the width connection with the branch's
    Pre-Norm one op (``mhc_width``: the projection with its norm's division after the product, the input), the
    mixing with the depth connection one op; a middle block launches under a third of the kernels, moves fewer
    bytes, computes the same matmul FLOPs less exactly the mixing's (2 n^2 d a token and connection forward; three
    times that backward, where unfused recompute mixes again before the two gradient products: the mix op's are
    counted as bytes, not as a matmul) and, backward, the width half's forward products (the projection, 2 n d
    (n^2 + 2n) a token, and the input's sum, 2 n d), which unfused recompute runs again and the width op does not,
    and autograd keeps less without recompute (Sinkhorn keeps only its logits,
    not 40 iterates) and, with recompute, nothing d wide beyond unfused: only small fp32 numbers a token and
    connection, the width op's logits, rstd and input rstd (n^2 + 2n + 2), Sinkhorn's logits (n^2), H_post's sigmoid
    (n), and H_res and H_post, which the mix op keeps (n^2 + n): 66 at n = 4, against 4 x 64 stream features here."""
    step, unfused = _fused_and_unfused_costs("mhc")
    assert step["by_op"]["forward"]["sinkhorn_forward"][0] == 6
    assert step["by_op"]["backward"]["stream_mix_backward"][0] == 6
    assert "sinkhorn_forward" not in unfused["by_op"]["forward"]
    n, d, tokens = 4, tiny_config().d_model, 2 * 16
    mixing = 2 * tokens * 2 * n * n * d  # two connections a block
    for phase, times in (("forward", 1), ("backward", 3)):
        assert step["layer"][phase]["kernels"] < unfused["layer"][phase]["kernels"] / 3, phase
        assert step["layer"][phase]["bytes"] < unfused["layer"][phase]["bytes"], phase
        recomputed = 2 * tokens * 2 * n * d * (n * n + 2 * n + 1) if phase == "backward" else 0
        assert unfused["layer"][phase]["matmul_flops"] - step["layer"][phase]["matmul_flops"] \
            == times * mixing + recomputed, phase
    kept = _kept_unfused_and_fused("mhc", recompute=True) + _kept_unfused_and_fused("mhc", recompute=False)
    coefficients = 6 * tokens * (3 * n * n + 4 * n + 2) * 4  # six connections in three blocks
    assert kept[1] <= kept[0] + coefficients and kept[3] < kept[2], kept


def test_the_check_catches_a_wrong_mix_backward(monkeypatch):
    """The stream mix's backward with m's gradient transposed (dm[j, s] = <g_s, h_j>): every stream-mix case fails,
    nothing else does."""
    original = fused._mix_grads

    def transposed(*args):
        dh, dm, db, df = original(*args)
        return dh, dm.transpose(-1, -2), db, df

    monkeypatch.setattr(fused, "_mix_grads", transposed)
    bad = fused.check()
    assert bad == [dict(stream_mix=True, n=n, widened=w) for n in (4, 3, 2) for w in (False, True)]


def test_fused_hc_is_fewer_kernels_and_bytes():
    """hc fused: one width op (coefficients, branch input, its Pre-Norm) and one stream-mix op each way per
    connection; a middle block moves fewer bytes each way and launches no more kernels forward, and autograd keeps
    nothing d wide of its own, only small fp32 numbers a token and connection: the width op's logits, rstd and the
    input's rstd (n (n + 2) + n + 1), and A's mixing columns and B, kept by the stream mix and by their tanh
    (2 (n^2 + n)); no normalised or unnormalised input (n = 2: 23 numbers, against d = 64 wide streams here)."""
    step, unfused = _fused_and_unfused_costs("hc")
    assert step["by_op"]["forward"]["stream_mix_forward"][0] == 6
    assert step["by_op"]["forward"]["width_forward"][0] == 6 and "project_forward" not in step["by_op"]["forward"]
    for phase in ("forward", "backward"):
        assert step["layer"][phase]["bytes"] < unfused["layer"][phase]["bytes"], phase
    assert step["layer"]["forward"]["kernels"] <= unfused["layer"]["forward"]["kernels"]
    n = 2
    for recompute in (True, False):
        kept = _kept_unfused_and_fused("hc", recompute)
        assert kept[1] <= kept[0] + 6 * 2 * 16 * (n * (n + 2) + n + 1 + 2 * (n * n + n)) * 4, (recompute, kept)


def test_the_check_catches_a_wrong_sinkhorn_backward(monkeypatch):
    """Sinkhorn's backward one half-step short (the first normalisation skipped): every Sinkhorn case fails."""
    def short(ys, dp, columns_first):
        p = ys[-1].exp()
        dy = dp.float() * p
        axes = fused._sinkhorn_axes(columns_first)
        for t in range(len(ys) - 1, 1, -1):
            dy = dy - ys[t].exp() * dy.sum(dim=axes[(t - 1) % 2], keepdim=True)
        return dy

    monkeypatch.setattr(fused, "_sinkhorn_grad", short)
    bad = fused.check()
    assert bad == [b for b in bad if b.get("sinkhorn")] and len(bad) == 8


@pytest.mark.parametrize("cls", ["HyperConnections", "ManifoldHyperConnections"])
def test_plain_connections_fused_match_unfused(cls):
    """siamesenorm.nn's connections alone (plain PyTorch, nn.RMSNorm with its scale moved off 1): fused equals
    unfused in output and every gradient, from random streams and from block 0's widened embedding; a LayerNorm is
    refused in one line."""
    from siamesenorm import nn as core

    make = getattr(core, cls)
    torch.manual_seed(0)
    branch = torch.nn.Linear(16, 16)
    plain = make(3, 16, branch, norm=torch.nn.RMSNorm)
    with torch.no_grad():
        for p in plain.parameters():
            p.add_(0.1 * torch.randn_like(p))  # off the init: every coefficient and the norm's scale matter
    fused_conn = make(3, 16, branch, norm=torch.nn.RMSNorm, fused=True)
    fused_conn.load_state_dict(plain.state_dict())
    for h in (torch.randn(2, 5, 3, 16), core.expand_streams(torch.randn(2, 5, 16), 3)):
        outs = []
        for conn in (plain, fused_conn):
            conn.zero_grad()
            leaf = h.detach().clone().requires_grad_()
            out = conn(leaf)
            (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
            outs.append((out.detach(), leaf.grad, [p.grad.clone() for p in conn.parameters()]))
        (a, ga, pa), (b, gb, pb) = outs
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gb, ga, rtol=1e-5, atol=1e-6)
        for x, y in zip(pb, pa):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="RMSNorm without bias"):
        make(3, 16, branch, norm=torch.nn.LayerNorm, fused=True)


@pytest.mark.slow
@needs_interpreter
def test_sinkhorn_backward_replays_in_segments_of_any_length():
    """Sinkhorn's backward kernel replays its iterates in segments (``fused._SINKHORN_SEGMENT``, 8); with segments of
    1, 7 (40 half-steps: the last segment partial) and 64 (one segment, longer than the steps) its gradient is the
    reference's, fp64 within 2e-5, in Triton's interpreter."""
    code = (INTERPRETER_START + "select = lambda c: c.get('sinkhorn', False) and c['n'] == 4\n"
            "for segment in (1, 7, 64):\n"
            "    fused._SINKHORN_SEGMENT = segment; seen = []\n"
            "    print(segment, len(fused.check(d=48, rows=(2, 5), dtype=torch.float64, tol=2e-5, seen=seen, "
            "select=select)), len(seen))")
    run = subprocess.run([sys.executable, "-c", code], env=INTERPRETER_ENV, text=True, capture_output=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["1", "0", "4", "7", "0", "4", "64", "0", "4"], run.stdout
