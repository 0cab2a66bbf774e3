"""The analysis tools on tiny models: fresh ones, and a checkpoint trained here through OLMo's Trainer."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_config
from test_training import ROOT, SMALL, TINY, learnable_tokens
from test_variants import ids, randomize

from siamesenorm import build_model
from siamesenorm.analysis import probes as analysis

SEQ = 32  # SMALL's max_sequence_length


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-layer hybrid_pre trained 24 steps, with a validation evaluator and a final unsharded checkpoint."""
    tmp = tmp_path_factory.mktemp("analysis")
    data = learnable_tokens(tmp / "train.npy")
    val = learnable_tokens(tmp / "val.npy", n_tokens=SEQ * 20, seed=1)
    run = tmp / "run"
    evaluator = (f"--evaluators=[{{label: val, type: lm, data: {{datasets: {{val: [{val}]}}, memmap_dtype: uint16, "
                 "drop_last: false, num_workers: 0}}]")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "train.py"), str(TINY), *SMALL, f"--data.paths=[{data}]",
         f"--save_folder={run}", "--max_duration=24", "--eval_interval=24", "--save_interval_unsharded=24",
         "--model.vocab_size=2048", "--model.embedding_size=2048", evaluator],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "MODEL_TYPE": "hybrid_pre", "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run, val


def analyze(*args):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "analyze.py"), *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


# ---- figure 2a ------------------------------------------------------------------------------------------------------
def test_magnitudes_bounded_stream_stays_at_norm_scale_pre_norm_grows():
    torch.manual_seed(0)
    batch = ids(batch=4, length=16)
    post = analysis.hidden_magnitudes(build_model(tiny_config(n_layers=6), "post").eval(), batch)
    pre = analysis.hidden_magnitudes(build_model(tiny_config(n_layers=6), "pre").eval(), batch)
    siamese = analysis.hidden_magnitudes(build_model(tiny_config(n_layers=6), "post_pre").eval(), batch)
    assert post["layers"] == list(range(7)) and post["streams"] == ["residual"]
    assert all(abs(v - 1.0) < 1e-2 for v in post["rms"]["residual"][1:])  # LN output, unit scale
    grow = pre["rms"]["residual"]
    assert all(b > a for a, b in zip(grow, grow[1:])) and grow[-1] > 1.2 * grow[0]  # grows with every layer
    assert all(abs(v - 1.0) < 1e-2 for v in siamese["rms"]["x_post"][1:])
    assert siamese["rms"]["y_pre"][-1] > 1.2 * siamese["rms"]["y_pre"][1]


# ---- figure 6 -------------------------------------------------------------------------------------------------------
def test_stream_ratios_at_init_are_one_and_follow_the_weights():
    model = build_model(tiny_config(), "hybrid_pre")
    result = analysis.stream_ratios(model)
    assert result["ratio_x_over_y"]["attention"] == [1.0, 1.0, 1.0] == result["ratio_x_over_y"]["mlp"]
    with torch.no_grad():
        model.transformer.blocks[1].gamma.fill_(3.0)
        model.transformer.blocks[2].ff_norm_y.weight.fill_(0.5)
    result = analysis.stream_ratios(model)
    assert result["ratio_x_over_y"]["attention"] == [1.0, 3.0, 1.0]
    assert result["ratio_x_over_y"]["mlp"] == [1.0, 1.0, 2.0]
    text = analysis.stream_ratios(build_model(tiny_config(post_pre_x_norm_position="after_addition"), "post_pre"))
    assert text["ratio_x_over_y"]["attention"][0] is None  # X_0 is the embedding: no scale yet
    official = build_model(tiny_config(), "post_pre")  # LN^X before each sublayer: layer 0's X has a scale
    with torch.no_grad():
        official.transformer.blocks[0].attn_norm_x.weight.fill_(2.0)
    assert analysis.stream_ratios(official)["ratio_x_over_y"]["attention"][0] == 2.0


@pytest.mark.parametrize("model_type", ["pre", "hc", "residual"])
def test_stream_ratios_say_when_they_do_not_apply(model_type):
    with pytest.raises(analysis.NotApplicable, match=f"MODEL_TYPE={model_type}"):
        analysis.stream_ratios(build_model(tiny_config(), model_type))


# ---- section 5.2 ----------------------------------------------------------------------------------------------------
def test_logit_lens_of_two_identical_streams_agrees_everywhere():
    model = randomize(build_model(tiny_config(), "hybrid_pre")).eval()
    c = torch.randn(2, 7, 32)
    result = analysis.lens_agreement(model, [c, c.clone()], ["a", "b"])
    assert result["match"] == {"a": 1.0, "b": 1.0}
    assert result["disagreeing_positions"] == 0 and result["match_where_streams_disagree"]["a"] is None
    other = analysis.lens_agreement(model, [c, 0.05 * torch.randn_like(c)], ["a", "b"])  # "a" dominates the sum
    assert other["disagreeing_positions"] > 0 and other["match"]["a"] > other["match"]["b"]


@pytest.mark.parametrize("model_type", ["post_pre", "hybrid_pre", "residual", "hc", "mhc"])
def test_fusion_weights_and_lens_on_every_multi_stream_type(model_type):
    model = randomize(build_model(tiny_config(), model_type)).eval()
    result = analysis.fusion_and_lens(model, ids())
    last = model.transformer.blocks[-1]
    assert list(result["fusion_weights"]) == list(last.stream_names)
    if model_type in ("post_pre", "hybrid_pre"):
        assert result["fusion_weights"]["y_pre"] == pytest.approx(float(last.out_norm_y.weight.detach().mean()))
    assert all(0.0 <= v <= 1.0 for v in result["match"].values())
    assert result["positions"] == ids().numel()


def test_lens_does_not_apply_to_one_stream():
    with pytest.raises(analysis.NotApplicable, match="has one"):
        analysis.fusion_and_lens(build_model(tiny_config(), "peri"), ids())


# ---- depth probe ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model_type", ["pre", "post", "hybrid_pre", "hc", "mhc", "peri", "residual"])
def test_removing_layers_is_a_real_change_and_removing_none_is_the_model(model_type):
    model = randomize(build_model(tiny_config(n_layers=4), model_type)).eval()
    batch = ids(batch=3, length=16)
    result = analysis.depth_probe(model, batch)
    assert result["without_last_k"][0] == analysis.perplexity(model, batch) == result["perplexity"]
    assert len(result["without_layer"]) == 4 and len(result["without_last_k"]) == 4
    assert all(abs(p - result["perplexity"]) > 1e-6 for p in result["without_layer"])
    with analysis.layers_removed(model, []):
        assert analysis.perplexity(model, batch) == result["perplexity"]
    assert analysis.perplexity(model, batch) == result["perplexity"]  # the blocks are restored


# ---- on a trained checkpoint, through the command line --------------------------------------------------------------
@pytest.mark.slow
def test_depth_probe_with_no_layer_removed_reproduces_the_runs_perplexity(trained, tmp_path):
    run, val = trained
    record = json.loads((run / "run.json").read_text())
    proc = analyze("depth", run, "--tokens", val, "--max-sequences", 1000, "--output", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "depth.json").read_text())
    assert result["eval_sequences"] == 20
    assert result["without_last_k"][0] == pytest.approx(record["val_perplexity"], rel=1e-4)
    assert (tmp_path / "depth.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_cli_tools_on_the_trained_run(trained, tmp_path):
    run, val = trained
    for tool in ("magnitudes", "lens", "stream-ratios"):
        proc = analyze(tool, run, "--output", tmp_path)  # evaluation data: the run's own validation split
        assert proc.returncode == 0, proc.stderr[-3000:]
        result = json.loads((tmp_path / f"{tool}.json").read_text())
        assert result["applies"] is True and result["model_type"] == "hybrid_pre"
        assert (tmp_path / f"{tool}.png").is_file()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    logged = [r["step"] for r in rows if "grad_norm" in r]
    for tool, key in (("grad-norms", "grad_norm"), ("loss-curves", "loss")):
        proc = analyze(tool, run, run, "--output", tmp_path)  # the same run twice: two labelled curves
        assert proc.returncode == 0, proc.stderr[-3000:]
        curves = json.loads((tmp_path / f"{tool}.json").read_text())["runs"]
        assert len(curves) == 2
        curve = next(iter(curves.values()))
        assert curve["steps"] == logged and all(v is None or v > 0 for v in curve[key])


@pytest.mark.slow
def test_cli_not_applicable_is_reported_not_failed(tmp_path):
    proc = analyze("stream-ratios", "--fresh", TINY, "--model-type", "pre", "--output", tmp_path)
    assert proc.returncode == 0 and "does not apply" in proc.stdout
    assert json.loads((tmp_path / "stream-ratios.json").read_text())["applies"] is False


@pytest.mark.slow
def test_cli_missing_checkpoint_says_what_to_do(tmp_path):
    proc = analyze("depth", tmp_path / "nothing", "--output", tmp_path)
    assert proc.returncode == 2 and "no OLMo checkpoint" in proc.stderr


def test_figure_conventions_smoothing_keeps_early_steps_captions_beside_not_inside_markers_and_styles(tmp_path):
    import numpy as np

    from siamesenorm.analysis.figures import caption_path, linestyle, moving_average, plot

    xs, ys = moving_average([1, 2, 3, 4, 5], [4.0, 2.0, None, 6.0, 8.0], 3)
    assert xs == [1, 2, 3, 4, 5]  # no step dropped
    np.testing.assert_allclose(ys, [4.0, 3.0, 3.0, 4.0, 7.0])  # the mean so far, then trailing means; None skipped
    assert linestyle("hybrid_star") != linestyle("hybrid") and linestyle("pre_embednorm") != linestyle("pre")
    assert linestyle("pre") != linestyle("pre", repeat=1)

    def run(n, spikes=(), stopped=False):
        return {"model_type": "hybrid_pre", "steps": list(range(1, n + 1)), "loss": [5.0 - 0.01 * i for i in range(n)],
                "spike_steps": list(spikes), "stopped": stopped}

    path = tmp_path / "loss.png"
    plot("loss-curves", {"metric": "loss", "runs": {"short": run(20), "long": run(200)}}, path, smooth=10)
    caption = caption_path(path).read_text()
    assert path.is_file() and "trailing mean over 10" in caption
    assert "triangles" not in caption and "x:" not in caption  # no mark drawn, none described
    plot("loss-curves", {"metric": "loss", "runs": {"spiky": run(200, spikes=[150], stopped=True)}}, path)
    assert "triangles: loss spikes" in caption_path(path).read_text() and "x: the guard" in caption_path(path).read_text()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from siamesenorm.analysis.figures import _curves

    fig, ax = plt.subplots()
    _curves(ax, {"short": run(20), "long": run(200)}, "loss", 1)
    markers = {line.get_label(): line.get_marker() for line in ax.get_lines()}
    assert markers["short"] == "o" and markers["long"] in ("None", None, "")  # markers only on the sparse series
    assert ax.get_ylabel() == "" and not fig.texts  # nothing written into the figure outside the axes
    plt.close(fig)


def test_every_analysis_figure_says_log_scale_and_numbers_layers_one_way(tmp_path, monkeypatch):
    """A log axis says so in its label; a layer axis numbers the embedding 0 and block l as l in every figure (the
    issue found 1-4 in one figure and 0-3 in another for the same four blocks)."""
    import matplotlib

    matplotlib.use("Agg")
    from siamesenorm.analysis import figures

    figs = {}
    monkeypatch.setattr(figures, "save", lambda fig, path, caption="", **kw: figs.setdefault(Path(path).stem, fig))
    torch.manual_seed(0)
    batch = ids(batch=2, length=16)
    model = randomize(build_model(tiny_config(n_layers=4), "hybrid_pre")).eval()
    results = {"magnitudes": analysis.hidden_magnitudes(model, batch), "stream-ratios": analysis.stream_ratios(model),
               "depth": analysis.depth_probe(model, batch),
               "grad-norms": {"metric": "grad_norm", "runs": {"a": {"model_type": "pre", "steps": [1, 2, 3],
                                                                    "grad_norm": [3.0, 0.5, 0.2]}}}}
    for tool, result in results.items():
        figures.plot(tool, result, tmp_path / f"{tool}.png")
    assert set(figs) == set(results)
    log_axes, layer_xs = 0, {}
    for name, fig in figs.items():
        for ax in fig.axes:
            for axis in ("x", "y"):
                label = getattr(ax, f"get_{axis}label")()
                if getattr(ax, f"get_{axis}scale")() == "log":
                    log_axes += 1
                    shared = axis == "y" and not label and any(
                        other.get_ylabel() for other in ax.get_shared_y_axes().get_siblings(ax))
                    assert "(log scale)" in label or shared, (name, axis, label)
                else:
                    assert "log" not in label, (name, axis, label)
            if ax.get_xlabel().startswith("layer"):
                xs = sorted({float(x) for line in ax.get_lines() if line.get_transform() == ax.transData
                             for x in line.get_xdata()})  # data lines (not a reference axhline)
                layer_xs[name] = xs
                assert xs[0] == (0 if "0 = embedding" in ax.get_xlabel() else 1), (name, ax.get_xlabel(), xs)
    assert log_axes >= 4  # magnitudes, both depth panels, gradient norms
    assert {name: xs[-1] for name, xs in layer_xs.items()} == {"magnitudes": 4, "stream-ratios": 4, "depth": 4}
