"""The chunked cross-entropy (siamesenorm/nn/loss.py): OLMo's loss value and gradient, without the fp32 logits kept
for backward, and selected by the config through OLMo's trainer."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from olmo.train import cross_entropy_loss

from siamesenorm.nn.loss import chunked_cross_entropy_loss

ROOT = Path(__file__).resolve().parents[2]


def _inputs(dtype, n=100, vocab=37):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(n, vocab, generator=g) * 3).to(dtype).requires_grad_(True)
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[::7] = -100  # ignored positions (padding, masked labels)
    return logits, labels


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("z_loss", [False, True])
def test_equals_olmos_loss_and_gradient(reduction, z_loss):
    results = {}
    for name, fn in (("olmo", cross_entropy_loss), ("chunked", lambda *a, **k: chunked_cross_entropy_loss(
            *a, chunk_tokens=16, **k))):
        logits, labels = _inputs(torch.float32)
        ce, z = fn(logits, labels, ignore_index=-100, reduction=reduction, compute_z_loss=z_loss)
        total = ce.sum() + (z.sum() if z is not None else 0)
        total.backward()
        results[name] = (ce.detach(), None if z is None else z.detach(), logits.grad)
    olmo, chunked = results["olmo"], results["chunked"]
    torch.testing.assert_close(chunked[0], olmo[0], rtol=1e-6, atol=1e-6)
    assert (chunked[1] is None) == (olmo[1] is None)
    if z_loss:
        torch.testing.assert_close(chunked[1], olmo[1], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(chunked[2], olmo[2], rtol=1e-6, atol=1e-7)


def test_bf16_logits_under_autocast_give_olmos_value():
    """As training runs it: bf16 logits, bf16 autocast (OLMo's cross-entropy upcasts to fp32 there)."""
    logits, labels = _inputs(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours, _ = chunked_cross_entropy_loss(logits, labels, reduction="sum", chunk_tokens=32)
        theirs, _ = cross_entropy_loss(logits, labels, reduction="sum")
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-5, atol=1e-4)


def _saved_bytes(fn, logits):
    """Bytes of the distinct storages autograd keeps for backward, the logits' own storage left out."""
    own = logits.untyped_storage().data_ptr()
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in (own, 0):
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fn(logits)
    loss.backward()
    return sum(seen.values())


def test_backward_keeps_no_fp32_copy_of_the_logits():
    n, vocab = 512, 1000
    logits = torch.randn(n, vocab, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (n,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        olmo = _saved_bytes(lambda x: cross_entropy_loss(x, labels, reduction="sum")[0], logits)
        chunked = _saved_bytes(lambda x: chunked_cross_entropy_loss(x, labels, reduction="sum",
                                                                    chunk_tokens=64)[0], logits)
    assert olmo >= n * vocab * 4  # OLMo's: at least the fp32 log-softmax of every token
    assert chunked < 0.02 * n * vocab * 4, (olmo, chunked)  # ours: labels and per-chunk scalars


def _train(tmp_path, name, austen_prepared, *extra):
    folder = tmp_path / name
    cmd = [sys.executable, str(ROOT / "scripts/train.py"), str(ROOT / "configs/tiny-cpu.yaml"),
           f"--save_folder={folder}", "--max_duration=3", "--console_log_interval=1", "--save_interval=1000", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    return proc, folder


@pytest.mark.slow
def test_a_run_with_loss_chunk_tokens_trains_like_olmos_loss(tmp_path, austen_prepared):
    losses = {}
    for name, extra in (("olmo", ()), ("chunked", ("--loss_chunk_tokens=100",))):
        proc, folder = _train(tmp_path, name, austen_prepared, *extra)
        assert proc.returncode == 0, proc.stderr[-2000:]
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [r["loss"] for r in rows if "loss" in r]
        losses[name].append(rows[-1]["eval"]["eval/austen-val/CrossEntropyLoss"])  # evaluation: reduction none
    assert len(losses["olmo"]) == 4
    assert losses["chunked"] == pytest.approx(losses["olmo"], rel=1e-4)
    proc, folder = _train(tmp_path, "bad", austen_prepared, "--loss_chunk_tokens=0")
    assert proc.returncode == 2 and "loss_chunk_tokens must be >= 1" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
