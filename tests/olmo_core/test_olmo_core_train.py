"""Training through OLMo-core's own Trainer (scripts/train_olmo_core.py) on the shipped Austen data: two processes
under torchrun with OLMo-core's FSDP, its distributed checkpoints, a resume that reproduces the losses exactly, and
checkpoint files from elsewhere that run nothing."""

import json
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("siamesenorm.olmo_core.config")
from conftest import tiny_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
STEPS = ["--max_duration=6", "--save_interval=3", "--device_train_microbatch_size=8"]


def _train(folder, *extra, processes=1, model_type="hybrid_pre", port=29700):
    command = [sys.executable, str(ROOT / "scripts" / "train_olmo_core.py")]
    if processes > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
                   "--master_port", str(port)] + command[1:]
    command += [str(ROOT / "configs" / "tiny-cpu.yaml"), f"--save_folder={folder}", *STEPS, *extra]
    env = dict(os.environ, MODEL_TYPE=model_type, OMP_NUM_THREADS="1")
    log = Path(folder).with_suffix(".log")
    with open(log, "w") as out:  # a file, not a pipe: a stray worker cannot keep the test waiting
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            proc.wait(timeout=420)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers
            proc.wait()
    text = log.read_text()
    return subprocess.CompletedProcess(command, proc.returncode, text, text)


def _losses(folder):
    losses = {}
    for line in (Path(folder) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            losses[record["step"]] = record["loss"]
    return losses


@pytest.mark.slow
def test_two_processes_fsdp_train_save_resume_reproduce_the_losses(tmp_path, austen_prepared):
    whole, split = tmp_path / "whole", tmp_path / "split"
    run = _train(whole, processes=2, port=29701)
    assert run.returncode == 0, run.stderr[-3000:]
    assert sorted(p.name for p in (whole / "step6" / "train").iterdir()) == ["rank0.pt", "rank1.pt"]
    assert any(p.suffix == ".distcp" for p in (whole / "step3" / "model_and_optim").iterdir())
    first = _train(split, "--stop_at=3", processes=2, port=29702)
    assert first.returncode == 0, first.stderr[-3000:]
    assert sorted(_losses(split)) == [1, 2, 3]
    second = _train(split, processes=2, port=29703)  # the same command again: resumes from step 3
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"Loading checkpoint from '{split / 'step3'}'" in second.stderr + second.stdout
    expected = _losses(whole)
    assert sorted(expected) == [1, 2, 3, 4, 5, 6]
    assert _losses(split) == expected  # bit for bit: the resumed run trains the same steps on the same data
    assert expected[6] < expected[1]


@pytest.mark.slow
def test_two_processes_train_save_resume_an_moe(tmp_path, austen_prepared):
    """hybrid_pre over OLMo-core's MoE (4 experts, top 2; its router, auxiliary losses and FSDP), two processes:
    stopped at step 3 and resumed, the losses and the load-balancing losses are the uninterrupted run's."""
    moe = ["--moe.num_experts=4", "--moe.top_k=2"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    run = _train(whole, *moe, processes=2, port=29711)
    assert run.returncode == 0, run.stderr[-3000:]
    first = _train(split, *moe, "--stop_at=3", processes=2, port=29712)
    assert first.returncode == 0, first.stderr[-3000:]
    second = _train(split, *moe, processes=2, port=29713)
    assert second.returncode == 0, second.stderr[-3000:]
    expected = _losses(whole)
    assert sorted(expected) == [1, 2, 3, 4, 5, 6] and _losses(split) == expected
    assert expected[6] < expected[1]
    records = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()]
    balance = {r["step"]: r["train/load balancing loss"] for r in records if "train/load balancing loss" in r}
    assert sorted(balance) == [1, 2, 3, 4, 5, 6] and all(v > 0 for v in balance.values())
    assert all(f"train/block {b:02d}/router Z loss" in records[1] for b in range(4))
    split_records = [json.loads(line) for line in (split / "metrics.jsonl").read_text().splitlines()]
    assert {r["step"]: r["train/load balancing loss"] for r in split_records
            if "train/load balancing loss" in r} == balance


class _Bomb:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.slow
@pytest.mark.parametrize("planted", ["metadata", "trainer_state"])
def test_a_crafted_checkpoint_runs_nothing(tmp_path, austen_prepared, planted):
    folder = tmp_path / "run"
    first = _train(folder, "--stop_at=3", model_type="pre")
    assert first.returncode == 0, first.stderr[-3000:]
    marker = tmp_path / "ran"
    if planted == "metadata":
        target = folder / "step3" / "model_and_optim" / ".metadata"
        target.write_bytes(pickle.dumps(_Bomb(marker)))
    else:
        target = folder / "step3" / "train" / "rank0.pt"
        torch.save({"global_step": _Bomb(marker)}, target)
    before = (folder / "metrics.jsonl").read_text()
    second = _train(folder, model_type="pre")
    assert second.returncode != 0
    assert "refusing to load" in second.stderr and "nothing in it was run" in second.stderr
    assert not marker.exists()
    assert (folder / "metrics.jsonl").read_text() == before  # nothing already written is lost


def test_deepnorm_and_hc_scale_their_init_after_olmo_cores_init():
    from siamesenorm.olmo_core.config import transformer_config
    from siamesenorm.variants.deepnorm import deepnorm_beta

    config = tiny_config(weight_tying=False)
    models = {}
    for model_type in ("post", "deepnorm", "pre", "hc"):
        model = transformer_config(config, model_type=model_type).build(init_device="meta")
        model.init_weights(device=torch.device("cpu"))
        models[model_type] = model
    beta = deepnorm_beta(config.n_layers)
    post, deep = models["post"].blocks["1"], models["deepnorm"].blocks["1"]
    assert torch.allclose(deep.attention.w_v.weight, post.attention.w_v.weight * beta)
    assert torch.allclose(deep.feed_forward.w2.weight, post.feed_forward.w2.weight * beta)
    assert torch.equal(deep.attention.w_q.weight, post.attention.w_q.weight)  # Q and K untouched
    hc = models["hc"].blocks["1"]
    assert hc.attention.w_out.weight.std() < 0.8 * models["pre"].blocks["1"].attention.w_out.weight.std()


def test_a_1b_recipe_maps_to_what_it_states(monkeypatch, austen_prepared):
    """configs/OLMo-1B-hybrid-2e-3.yaml on 8 processes: bf16 autocast, FSDP with bf16 parameters and fp32
    reductions (its fsdp.precision: mixed), compiled blocks, batch sizes in tokens, 100e9 tokens, the 1.3B shape."""
    from siamesenorm.olmo_core import train as core_train
    from siamesenorm.olmo_core.train import build_components
    from siamesenorm.run.recipe import load_config

    checked = []  # the recipe's FineWeb token files are not here; Austen's hold less than its 2048-sequence batch
    monkeypatch.setattr(core_train, "check_data", checked.append)
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("MODEL_TYPE", "hybrid_pre")
    cfg = load_config("configs/OLMo-1B-hybrid-2e-3.yaml", ["--data.paths=[data/prepared/austen-2k/train/*.npy]",
                                                            "--save_folder=/tmp/unused-core-1b"])
    model, module, _, loader, trainer = build_components(cfg, world_size=8)
    assert checked == [cfg] and cfg.evaluators == []  # the data checks ran; the recipe's evaluators are skipped
    assert (model.n_layers, model.d_model, model.block.model_type) == (16, 2048, "hybrid_pre")
    assert str(module.autocast_precision) == "bfloat16" and module.compile_model
    assert (str(module.dp_config.param_dtype), str(module.dp_config.reduce_dtype)) == ("bfloat16", "float32")
    assert module.rank_microbatch_size == 8 * 2048 and loader.global_batch_size == 2048 * 2048
    assert trainer.max_duration.value == 100_000_000_000 and str(trainer.max_duration.unit) == "tokens"
    monkeypatch.undo()
    monkeypatch.chdir(ROOT)
    tiny = load_config("configs/tiny-cpu.yaml", ["--save_folder=/tmp/unused-core-tiny"])
    _, tiny_module, _, _, _ = build_components(tiny)
    assert tiny_module.autocast_precision is None and not tiny_module.compile_model and tiny_module.dp_config is None
    from siamesenorm.run.recipe import RunError

    with pytest.raises(RunError, match="device_train_microbatch_size=8"):  # the ai2-olmo path's batch check
        build_components(tiny, world_size=2)
    with pytest.raises(ValueError, match="maps fp32 and amp_bf16"):
        build_components(load_config("configs/tiny-cpu.yaml", ["--precision=amp_fp16",
                                                               "--save_folder=/tmp/unused-core-tiny"]))


@pytest.fixture(scope="module")
def core_checkpoint(tmp_path_factory, austen_prepared):
    """A run folder stopped at step 3 (one process): the checkpoint each crafted case below starts from."""
    folder = tmp_path_factory.mktemp("core") / "run"
    run = _train(folder, "--stop_at=3", model_type="pre")
    assert run.returncode == 0, run.stderr[-3000:]
    return folder


def _metadata_with(folder: Path, change) -> None:
    """Rewrite step3's .metadata with ``change(metadata)`` applied (a legitimate pickle of the allowed classes)."""
    from siamesenorm.run.safeload import load_checkpoint_metadata

    path = folder / "step3" / "model_and_optim" / ".metadata"
    with open(path, "rb") as f:
        metadata = load_checkpoint_metadata(f)
    change(metadata)
    path.write_bytes(pickle.dumps(metadata))


def _first_entry(metadata, **fields):
    import dataclasses

    index = next(i for i in metadata.storage_data if i.fqn == "model.embeddings.weight")
    metadata.storage_data[index] = dataclasses.replace(metadata.storage_data[index], **fields)


def _plant(folder: Path, case: str) -> str:
    """Plant crafted ``case`` in ``folder``'s checkpoint; the words the one-line refusal must hold."""
    step = folder / "step3" / "model_and_optim"
    distcp = sorted(step.glob("*.distcp"))[0]
    if case == "not_metadata":
        (step / ".metadata").write_bytes(pickle.dumps([1, 2, 3]))
        return "its metadata is a list, not a checkpoint's Metadata"
    if case == "parent_path":
        _metadata_with(folder, lambda m: _first_entry(m, relative_path="../../../../../../etc/hostname"))
        return "names '../../../../../../etc/hostname', outside the checkpoint folder"
    if case == "link_out":
        (step / "link.distcp").symlink_to("/etc/hostname")
        _metadata_with(folder, lambda m: _first_entry(m, relative_path="link.distcp"))
        return "names 'link.distcp', outside the checkpoint folder"
    if case == "fifo":
        os.mkfifo(step / "pipe.distcp")
        _metadata_with(folder, lambda m: _first_entry(m, relative_path="pipe.distcp"))
        return "names 'pipe.distcp', which is not a regular file"
    if case == "unbounded":
        _metadata_with(folder, lambda m: _first_entry(m, length=-1))
        return "with a path, offset or length of the wrong type or sign"
    if case == "cut":
        os.truncate(distcp, distcp.stat().st_size // 2)
        return "(a cut or altered file)"
    if case == "zeroed":
        distcp.write_bytes(b"\0" * distcp.stat().st_size)
        return f"refusing to load {distcp} (bytes "
    raise AssertionError(case)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["not_metadata", "parent_path", "link_out", "fifo", "unbounded", "cut", "zeroed"])
def test_a_crafted_distributed_checkpoint_is_refused_in_one_line(tmp_path, core_checkpoint, case):
    import shutil

    folder = tmp_path / "run"
    shutil.copytree(core_checkpoint, folder, symlinks=True)
    words = _plant(folder, case)
    before = (folder / "metrics.jsonl").read_text()
    second = _train(folder, model_type="pre")
    assert second.returncode == 2, second.stderr[-3000:]
    last = second.stderr.strip().splitlines()[-1]
    assert last.startswith("error: refusing to load ") and words in last, last
    assert "Traceback" not in second.stderr and "weights_only" not in second.stderr
    assert (folder / "metrics.jsonl").read_text() == before


@pytest.mark.slow
def test_a_token_file_changed_in_place_is_seen_on_resume(tmp_path, austen_prepared):
    import shutil

    prepared = tmp_path / "prepared"
    shutil.copytree(austen_prepared, prepared)
    folder = tmp_path / "run"
    data = f"--data.paths=[{prepared}/train/*.npy]"
    first = _train(folder, data, "--stop_at=3", model_type="pre")
    assert first.returncode == 0, first.stderr[-3000:]
    assert json.loads((folder / "data-fingerprint.json").read_text())[0]["content"].startswith("whole:")
    target = sorted((prepared / "train").glob("*.npy"))[0]
    raw = bytearray(target.read_bytes())
    raw[-64:] = bytes(reversed(raw[-64:]))  # same size, manifest untouched
    target.write_bytes(bytes(raw))
    second = _train(folder, data, model_type="pre")
    assert second.returncode == 2, second.stderr[-3000:]
    last = second.stderr.strip().splitlines()[-1]
    assert "the token files differ from the ones this run started with" in last
    assert f"{target}: same size, other content" in last
    assert sorted(_losses(folder)) == [1, 2, 3]


@pytest.mark.parametrize("given", [None, "2"])
def test_the_olmo_core_path_pins_cpu_threads_before_olmo_core_sets_eight(monkeypatch, given):
    """OLMo-core's environment set-up sets OMP_NUM_THREADS=8 on any machine (720 tokens/s against 9,500 with one
    thread on 2 cores, measured by the issue); the run pins one thread first, as the ai2-olmo path does, unless the
    user set OMP_NUM_THREADS."""
    import torch

    from siamesenorm.olmo_core import train as core_train

    seen = {}

    def stop(**kwargs):
        seen.update(env=os.environ.get("OMP_NUM_THREADS"), threads=torch.get_num_threads())
        raise KeyboardInterrupt  # stop before any training

    threads = torch.get_num_threads()
    if given is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", given)
    monkeypatch.setattr(core_train, "prepare_training_environment", stop)
    monkeypatch.setattr(core_train, "teardown_training_environment", lambda: None)
    try:
        with pytest.raises(KeyboardInterrupt):
            core_train.main(str(ROOT / "configs" / "tiny-cpu.yaml"), ["--save_folder=/tmp/unused-core-threads"])
    finally:
        torch.set_num_threads(threads)
    assert seen == ({"env": "1", "threads": 1} if given is None else {"env": "2", "threads": threads})


@pytest.mark.parametrize("recipe,overrides", [
    ("tiny-cpu.yaml", []),
    ("OLMo-1B-hybrid-2e-3.yaml", []),
    ("tiny-cpu.yaml", ["--scheduler.warmup_min_lr=0.0", "--scheduler.t_max=50", "--scheduler.alpha_f=0.2"]),
])
def test_the_olmo_core_schedule_is_ai2_olmo_s_at_every_step(recipe, overrides):
    """The learning rate OLMo-core's scheduler gives at each step equals ai2-olmo's for the same recipe: warmup from
    ai2-olmo's warmup_min_lr (0.1 x lr when unset; the issue found OLMo-core's 0 used instead: 1e-4 against
    3.9e-4 at step 1 of the tiny recipe), t_max and alpha_f."""
    from olmo.optim import build_scheduler

    from siamesenorm.olmo_core.train import scheduler_config
    from siamesenorm.run.recipe import load_config

    cfg = load_config(str(ROOT / "configs" / recipe), overrides)
    lr, ai2, core = cfg.optimizer.learning_rate, build_scheduler(cfg), scheduler_config(cfg)
    total = 3 * int(cfg.scheduler.t_warmup)
    for step in [0, 1, 2, int(cfg.scheduler.t_warmup) - 1, int(cfg.scheduler.t_warmup), total // 2, total - 1, total]:
        assert core.get_lr(lr, step, total) == pytest.approx(ai2.get_lr(lr, step, total), rel=1e-12, abs=0), step
    assert core.get_lr(lr, 1, total) > (0.1 * lr if "--scheduler.warmup_min_lr=0.0" not in overrides else 0)


def test_a_scheduler_the_olmo_core_path_does_not_map_is_one_line():
    from siamesenorm.olmo_core.train import scheduler_config
    from siamesenorm.run.recipe import RunError, load_config

    cfg = load_config(str(ROOT / "configs" / "tiny-cpu.yaml"), ["--scheduler.name=linear_with_warmup"])
    with pytest.raises(RunError, match="maps cosine_with_warmup in steps only"):
        scheduler_config(cfg)


def test_the_loader_reads_in_its_own_thread_and_gives_the_batches_olmo_cores_threads_give(tmp_path, austen_prepared):
    """OLMo-core's loader, left to itself without worker processes, reads through four daemon threads; a run that
    stops before its data ends leaves them reading, and Python kills a daemon thread inside torch's C++ at exit with
    std::terminate (SIGABRT after a run that had finished its work). Ours starts no thread and yields the same batches."""
    import dataclasses
    import threading

    from siamesenorm.olmo_core.train import build_components
    from siamesenorm.run.recipe import load_config

    cfg = load_config(str(ROOT / "configs" / "tiny-cpu.yaml"), [f"--save_folder={tmp_path / 'run'}"])
    _, _, data_config, loader_config, _ = build_components(cfg)
    dataset = data_config.build()

    def first_batches(config, n=3):
        loader = config.build(dataset, dp_process_group=None)
        loader.reshuffle(epoch=1)
        before = set(threading.enumerate())
        batches = []
        for batch in loader:
            batches.append(batch["input_ids"].clone())
            if len(batches) == n:
                break
        started = [t.name for t in threading.enumerate() if t not in before and t.is_alive()]
        loader.reset()
        return batches, started

    ours, started = first_batches(loader_config)
    assert started == []
    theirs, their_threads = first_batches(dataclasses.replace(loader_config, num_threads=None))
    assert len(their_threads) == 4  # OLMo-core's default: what this test guards against
    assert len(ours) == 3 and all(torch.equal(a, b) for a, b in zip(ours, theirs))
