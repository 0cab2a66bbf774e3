"""The divergence guard and the loss-spike counter: the rule on its own, then real runs through OLMo's Trainer."""

import json
import re
import subprocess
import sys

import pytest
from test_training import ROOT, SMALL, TINY, learnable_tokens

from siamesenorm.run.stability import EXIT_DIVERGED, Diverged, StabilityConfig, StabilityMonitor


def monitor(**kw):
    return StabilityMonitor(StabilityConfig(**{"spike_window": 5, "patience": 3, "max_loss": 5.0, **kw}),
                            vocab_size=64, warmup_steps=2)


def feed(m, losses, start=1):
    for step, loss in enumerate(losses, start):
        m.update(step, loss, 1.0)


@pytest.mark.parametrize("loss,grad", [(float("nan"), 1.0), (float("inf"), 1.0), (3.0, float("nan"))])
def test_non_finite_stops_at_once_even_in_warmup(loss, grad):
    m = monitor()
    with pytest.raises(Diverged) as err:
        m.update(1, loss, grad)
    assert err.value.step == 1 and "non-finite" in err.value.reason


def test_loss_bound_needs_patience_and_only_after_grace():
    m = monitor()
    feed(m, [9.0, 9.0])  # above the bound, but within the grace steps
    feed(m, [9.0, 9.0, 4.0, 9.0, 9.0], start=3)  # the run of bad steps is broken by 4.0
    with pytest.raises(Diverged) as err:
        m.update(8, 9.0, 1.0)
    assert err.value.step == 8 and "3 consecutive" in err.value.reason


def test_default_bound_is_the_uniform_guess_loss():
    m = StabilityMonitor(StabilityConfig(), vocab_size=64, warmup_steps=0)
    assert m.max_loss == pytest.approx(4.1589, abs=1e-4)


def test_spikes_count_excursions_not_steps():
    m = monitor(max_loss=100.0)
    feed(m, [3.0] * 8 + [4.0, 4.5, 3.0] + [3.0] * 3 + [3.7] + [3.0] * 3)
    assert m.spike_count == 2 and [s["step"] for s in m.spikes] == [9, 15]
    assert m.spikes[0]["baseline"] == 3.0


def test_noisy_but_healthy_losses_have_no_spike():
    import random

    rng = random.Random(0)
    m = monitor(max_loss=100.0)
    feed(m, [3.0 - 0.001 * i + rng.uniform(-0.1, 0.1) for i in range(300)])
    assert m.spike_count == 0


def test_the_guard_state_resumes_the_decisions_of_the_uninterrupted_run():
    """A checkpoint keeps the guard's state (windows, the consecutive-steps counter, an open spike): stopped
    mid-spike and mid-run of bad steps and resumed from its state_dict, the guard decides as if never stopped;
    from the run record's spike list alone (older checkpoints) it would not."""
    losses = [3.0] * 8 + [4.0, 4.5] + [3.0] * 3 + [9.0, 9.0]  # a spike in progress at step 10, bad steps 14-15
    whole = monitor(max_loss=5.0)
    feed(whole, losses)
    expected = whole.state_dict()
    assert [x["step"] for x in whole.spikes] == [9, 14] and whole.above_bound == 2
    with pytest.raises(Diverged) as err:
        whole.update(16, 9.0, 1.0)  # the third bad step in a row
    stopped = monitor(max_loss=5.0)
    feed(stopped, losses[:9])  # stopped at step 9, inside the spike
    state = json.loads(json.dumps(stopped.state_dict()))  # plain data, as a checkpoint holds it
    resumed = monitor(max_loss=5.0)
    assert resumed.load_state_dict(state)
    feed(resumed, losses[9:], start=10)
    assert resumed.state_dict() == expected
    with pytest.raises(Diverged) as again:
        resumed.update(16, 9.0, 1.0)
    assert again.value.reason == err.value.reason
    legacy = monitor(max_loss=5.0)  # the record's spikes only: empty windows, no open spike
    legacy.restore(stopped.spikes)
    feed(legacy, losses[9:], start=10)
    assert legacy.state_dict()["window"] != expected["window"]  # its window refilled from the spike's losses


@pytest.mark.parametrize("bad", [None, [], {"window": "x"}, {"window": [1.0] * 99}])
def test_a_malformed_guard_state_is_ignored(bad):
    m = monitor()
    feed(m, [3.0] * 6)
    before = m.state_dict()
    state = dict(before, **bad) if isinstance(bad, dict) else bad
    assert m.load_state_dict(state) is False and m.state_dict() == before


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="spike_factor"):
        monitor(spike_factor=0.9)


# ---- real runs -------------------------------------------------------------------------------------------------------
def train(args, env=None):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), str(TINY), *SMALL, *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1", **(env or {})})


@pytest.mark.slow
def test_absurd_learning_rate_is_stopped_with_record_and_exit_code(tmp_path):
    data = learnable_tokens(tmp_path / "train.npy")
    run = tmp_path / "run"
    proc = train([f"--data.paths=[{data}]", f"--save_folder={run}", "--max_duration=40", "--save_interval_unsharded=5",
                  "--optimizer.learning_rate=50", "--scheduler.t_warmup=2", "--stability.patience=3"],
                 env={"MODEL_TYPE": "post"})
    assert proc.returncode == EXIT_DIVERGED, proc.stderr[-3000:]
    record = json.loads((run / "run.json").read_text())
    assert record["status"] == "diverged" and record["model_type"] == "post"
    assert record["diverged_at_step"] <= 2 + 3  # grace + patience, or earlier for a non-finite loss
    assert record["step"] == record["diverged_at_step"] < 40
    assert record["learning_rate"] == 50.0 and len(record["config_hash"]) == 16
    assert not list(run.glob("step*"))  # no checkpoint written for a dead run
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["diverged"] == record["divergence"]


@pytest.mark.slow
def test_healthy_run_finishes_with_a_full_record(tmp_path):
    data = learnable_tokens(tmp_path / "train.npy")
    val = learnable_tokens(tmp_path / "val.npy", seed=1)
    run = tmp_path / "run"
    evaluator = (f"--evaluators=[{{label: val, type: lm, data: {{datasets: {{val: [{val}]}}, memmap_dtype: uint16, "
                 "drop_last: true, num_workers: 0}}]")
    proc = train([f"--data.paths=[{data}]", f"--save_folder={run}", "--max_duration=30", "--eval_interval=10",
                  evaluator, "--model.siamese_depth_scaling=false", "--model.vocab_size=2048",
                  "--model.embedding_size=2048"], env={"MODEL_TYPE": "hybrid_pre"})  # the tokenizer's vocabulary
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((run / "run.json").read_text())
    assert record["status"] == "finished" and record["step"] == 30
    assert record["tokens_seen"] == record["token_budget"] == 30 * 8 * 32
    assert record["variant_knobs"] == {"siamese_depth_scaling": False}
    assert record["eval_step"] == 30 and record["val_perplexity"] == pytest.approx(record["perplexity"]["val"])
    assert 1.0 < record["val_perplexity"] < 64
    assert record["loss_spikes"] == len(record["spikes"])


@pytest.mark.slow
def test_two_process_divergence_stops_every_rank_and_launch_maps_the_code(tmp_path):
    data = learnable_tokens(tmp_path / "train.npy")
    run = tmp_path / "run"
    args = [str(TINY), *SMALL, f"--data.paths=[{data}]", f"--save_folder={run}", "--max_duration=40",
            "--optimizer.learning_rate=50", "--scheduler.t_warmup=2", "--stability.patience=2"]
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "launch.py"), "--standalone", "--nproc_per_node=2",
                           *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**env, "MODEL_TYPE": "post", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == EXIT_DIVERGED, proc.stderr[-3000:]
    # both ranks took the decision at the same step (neither hung in a collective)...
    steps = {rank: re.search(rf"\[rank{rank}\] WARNING .*divergence guard: stopping at step (\d+)", proc.stderr)
             for rank in (0, 1)}
    assert all(steps.values()), proc.stderr[-3000:]
    assert steps[0].group(1) == steps[1].group(1)
    # ...ended normally (no torchrun failure report), and launch.py gave the outcome in one line
    assert "ChildFailedError" not in proc.stderr and "exitcode" not in proc.stderr, proc.stderr[-3000:]
    assert re.search(r"launch: the run diverged at step \d+: .*exit status 3", proc.stderr)
    assert json.loads((run / "run.json").read_text())["world_size"] == 2


# ---- failure to converge, spikes right after warmup, gradient-norm spikes (synthetic traces) ----------------------
def test_run_stuck_on_the_unigram_plateau_is_judged_not_converged_at_the_end():
    m = StabilityMonitor(StabilityConfig(), vocab_size=2048, warmup_steps=10, unigram_loss=6.2)
    assert m.max_loss > 7.0  # the loss bound alone never fires on a 6.2 plateau
    feed(m, [7.6 - 0.1 * i for i in range(14)] + [6.21] * 16)  # by default nothing stops the run...
    verdict = m.convergence()  # ...and the end of the budget judges it
    assert verdict["converged"] is False and verdict["window"] == 20
    assert verdict["final_mean_loss"] == pytest.approx((sum(7.6 - 0.1 * i for i in range(10, 14)) + 16 * 6.21) / 20)


def test_explicit_convergence_budget_stops_a_stuck_run_there():
    m = StabilityMonitor(StabilityConfig(converge_steps=30), vocab_size=2048, warmup_steps=10, unigram_loss=6.2)
    with pytest.raises(Diverged) as err:
        feed(m, [7.6 - 0.1 * i for i in range(14)] + [6.21] * 16)
    assert err.value.step == 30 and err.value.kind == "not_converged" and "unigram loss 6.2000" in err.value.reason


def test_run_that_learns_past_the_unigram_level_converges():
    m = StabilityMonitor(StabilityConfig(converge_steps=30), vocab_size=2048, warmup_steps=10, unigram_loss=6.2)
    feed(m, [7.6 - 0.1 * i for i in range(30)] + [4.0] * 10)  # mean of steps 11-30 is 5.15
    assert m.convergence()["converged"] is True
    assert StabilityMonitor(StabilityConfig(), 64, 10).convergence() == {"converged": None}  # no unigram: unknown


def test_late_escape_from_the_plateau_converges_with_the_default_budget():
    """The tiny recipe's SiameseNorm at lr 0.1: loss 6.20 around step 100 (unigram 6.29), 5.0 at step 300."""
    trace = [7.6] * 30 + [6.2] * 90 + [6.2 - 0.006 * i for i in range(180)]
    m = StabilityMonitor(StabilityConfig(), 2048, warmup_steps=30, unigram_loss=6.29)
    feed(m, trace)
    assert m.convergence()["converged"] is True
    early = StabilityMonitor(StabilityConfig(converge_steps=100), 2048, 30, unigram_loss=6.29)
    with pytest.raises(Diverged):
        feed(early, trace)


def test_spike_just_after_warmup_is_counted():
    """Warmup losses (falling from 9) do not enter the baseline, so a +30% excursion right after it is a spike."""
    m = monitor(max_loss=100.0, spike_window=5, grace_steps=6)
    feed(m, [9.0, 8.0, 7.0, 6.0, 5.0, 4.0] + [3.0] * 5 + [3.9] + [3.0] * 3)
    assert [s["step"] for s in m.spikes] == [12]


def test_gradient_norm_spikes_are_counted_apart_from_loss_spikes():
    m = monitor(max_loss=100.0)
    for step in range(1, 40):
        grad = 26.8 if step in (20, 21, 30) else 0.3
        m.update(step, 3.0, grad)
    assert [s["step"] for s in m.grad_spikes] == [20, 30] and m.spike_count == 0
    assert m.grad_spikes[0]["grad_norm"] == 26.8 and m.grad_spikes[0]["baseline"] == 0.3
