import collections
import fcntl
import json
import os
import resource
import sys
import time

import pytest
import torch

# tests/ mirrors the package (tests/<folder>/test_*.py; tests/README.md): the shared helpers here (conftest,
# reference) and each folder's modules importable by name from any test (a few share fixtures and helpers).
_HERE = os.path.dirname(os.path.abspath(__file__))
_FOLDERS = [os.path.join(_HERE, d) for d in sorted(os.listdir(_HERE)) if os.path.isdir(os.path.join(_HERE, d))]
for _folder in [_HERE] + [f for f in _FOLDERS if any(n.startswith("test_") for n in os.listdir(f))]:
    if _folder not in sys.path:
        sys.path.insert(0, _folder)

from siamesenorm import SiameseModelConfig  # noqa: E402

# scripts/test.sh runs the suite in pytest-xdist workers, one a core: torch's intra-op threads in a worker
# would otherwise take both cores and the two workers would fight over them (training subprocesses already pin one
# thread, siamesenorm/ai2_olmo/train.py).
if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(1)

#: The first lines of a subprocess script that must run with transformers alone: importing siamesenorm or ai2-olmo
#: fails in there (the export tests load folders this way).
HIDE_SIAMESENORM_AND_OLMO = """
import importlib.abc, sys
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("siamesenorm", "olmo", "olmo_data", "olmo_core"):
            raise ImportError(f"{name} is hidden in this test")
sys.meta_path.insert(0, Hide())
"""


def tiny_config(**overrides) -> SiameseModelConfig:
    """A few-thousand-parameter OLMo: RMSNorm, RoPE, SwiGLU, weight tying, no dropout, fp32 on CPU."""
    values = dict(
        d_model=32,
        n_heads=4,
        n_layers=3,
        mlp_ratio=4,
        vocab_size=96,
        embedding_size=128,
        max_sequence_length=64,
        rope=True,
        include_bias=False,
        layer_norm_type="rms",
        attention_dropout=0.0,
        residual_dropout=0.0,
        embedding_dropout=0.0,
        weight_tying=True,
        eos_token_id=0,
        pad_token_id=0,
        init_device="cpu",
    )
    values.update(overrides)
    return SiameseModelConfig(**values)


@pytest.fixture(scope="session")
def austen_prepared():
    """data/prepared/austen-2k, the tiny recipe's data, prepared once if missing (what the quickstart does)."""
    from pathlib import Path

    from siamesenorm.run.data import PrepareSettings, prepare

    root = Path(__file__).resolve().parents[1]
    out = root / "data" / "prepared" / "austen-2k"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / ".austen-2k.lock", "w") as lock:  # one pytest-xdist worker prepares, the other waits
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "manifest.json").is_file():
            settings = PrepareSettings([str(root / "data" / "austen.jsonl.gz")],
                                       tokenizer=str(root / "data" / "tokenizer-austen-2k.json"), docs_per_unit=50)
            prepare(settings, out, progress=False)
    return out


@pytest.fixture(autouse=True)
def _no_model_type_env(monkeypatch):
    monkeypatch.delenv("MODEL_TYPE", raising=False)
    torch.manual_seed(0)


#: Each test file's seconds in a whole-suite run (tests/file_seconds.json; written by a run with
#: SIAMESENORM_FILE_SECONDS=<path>, see ``pytest_sessionfinish``): the order in which pytest-xdist's workers take files.
FILE_SECONDS = os.path.join(_HERE, "file_seconds.json")


def file_seconds(path: str = FILE_SECONDS) -> dict:
    """{file: seconds} from a measured run, or {} where the file is missing or unreadable (the order then falls back
    to the count of slow tests: a wrong table only costs balance, never a test)."""
    try:
        with open(path) as f:
            seconds = json.load(f)["seconds"]
        return {str(k): float(v) for k, v in seconds.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def longest_first(files, measured: dict, slow: collections.Counter) -> dict:
    """Each file's rank in the workers' queue: the longest measured first, so the long files start early and the short
    ones fill the gaps at the end (a long file left for last holds one worker while the other idles). A file the
    table does not know (new since it was measured) goes before all of them: its time is unknown, and a long file
    started first costs nothing; among those, the most slow tests first. Ties keep the collection order."""
    def key(path):
        return (0, -slow[path], 0.0) if path not in measured else (1, 0, -measured[path])
    return {path: rank for rank, path in enumerate(sorted(dict.fromkeys(files), key=key))}


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (scripts/test.sh: ``--dist loadfile --no-loadscope-reorder``, so this order is the one the
    workers take files in) the files longest first (``longest_first``). Within a file the order stays as written; a
    run in one process keeps the collection order."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    slow = collections.Counter(item.location[0] for item in items if "slow" in item.keywords)
    rank = longest_first([item.location[0] for item in items], file_seconds(), slow)
    items.sort(key=lambda item: rank[item.location[0]])  # a stable sort: each file's order kept


_seconds_by_file: collections.Counter = collections.Counter()
_cpu_by_file: collections.Counter = collections.Counter()


def _cpu_seconds() -> float:
    """This process's CPU seconds and its finished children's (the training subprocesses a test waits for)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def _charge_cpu(item, when):
    start = _cpu_seconds()
    yield
    item.user_properties.append((f"cpu_{when}", _cpu_seconds() - start))  # before the phase's report is made


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    yield from _charge_cpu(item, "setup")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield from _charge_cpu(item, "call")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    yield from _charge_cpu(item, "teardown")


def pytest_runtest_logreport(report):
    """Sum each file's set-up, call and tear-down seconds, wall and CPU (in the process that reports: xdist's
    controller gets every worker's reports, CPU included as a user property)."""
    path = report.nodeid.split("::", 1)[0]
    _seconds_by_file[path] += report.duration
    _cpu_by_file[path] += sum(v for k, v in report.user_properties if k == f"cpu_{report.when}")


def pytest_sessionfinish(session, exitstatus):
    """With SIAMESENORM_FILE_SECONDS=<path>, write each file's seconds there, wall and CPU (what
    tests/file_seconds.json holds; CPU above wall: a file's tests ran processes side by side; below: they waited):
    ``SIAMESENORM_FILE_SECONDS=$PWD/tests/file_seconds.json bash .ci/run`` in a fresh clone, on the machine CI runs
    on."""
    path = os.environ.get("SIAMESENORM_FILE_SECONDS")
    if not path or os.environ.get("PYTEST_XDIST_WORKER") or not _seconds_by_file:
        return
    import datetime
    import platform
    import subprocess
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=_HERE, capture_output=True,
                            text=True).stdout.strip()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor()
    files = sorted(_seconds_by_file, key=_seconds_by_file.get, reverse=True)
    record = {"measured": f"pytest with SIAMESENORM_FILE_SECONDS={path} at {commit or '?'} on "
                          f"{os.cpu_count()} x {cpu}, {datetime.date.today()}, exit status {int(exitstatus)}",
              "total": {"seconds": round(sum(_seconds_by_file.values())),
                        "cpu_seconds": round(sum(_cpu_by_file.values()))},
              "seconds": {k: round(_seconds_by_file[k], 1) for k in files},
              "cpu_seconds": {k: round(_cpu_by_file[k], 1) for k in files}}
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
