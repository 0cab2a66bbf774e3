import collections
import fcntl
import os
import sys

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


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (scripts/test.sh), the files with the most slow tests first: a worker takes a whole file
    at a time, in this order, so the long files start early and the short ones fill the gaps at the end, instead of a
    long file left for last on one worker while the other idles. Within a file the order stays as written; a run in
    one process keeps the collection order."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    slow = collections.Counter(item.location[0] for item in items if "slow" in item.keywords)
    items.sort(key=lambda item: -slow[item.location[0]])  # a stable sort: each file's order kept
