"""A small Vision Transformer on scikit-learn's 8x8 digits, with its residual topology from siamesenorm.nn: no OLMo.

    python examples/vit_digits.py                          # Pre-Norm, Post-Norm and SiameseNorm, 400 steps each
    python examples/vit_digits.py --topology siamese --steps 1000

Each image is cut into 16 patches of 2 x 2 pixels, plus a class token; the transformer's attention and MLP are
ordinary modules, and the topology wraps them: ``PreNorm(dim, attention)``, ``SiameseNorm(dim, attention, layer=l,
sublayer="attention")`` with a ``SiameseFusion`` before the final norm, and so on. Data: 1,797 digits shipped with
scikit-learn (offline), 80% for training, 20% held out; the accuracy printed is on the held-out images.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from siamesenorm import nn as snn  # noqa: E402

TOPOLOGIES = ("pre", "post", "siamese")


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):  # (B, T, d)
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)  # each (B, heads, T, hd)
        return self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(-2))


class MLP(nn.Sequential):
    def __init__(self, dim: int):
        super().__init__(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))


class ViT(nn.Module):
    def __init__(self, topology: str = "siamese", dim: int = 64, depth: int = 6, heads: int = 4, classes: int = 10):
        super().__init__()
        if topology not in TOPOLOGIES:
            raise ValueError(f"topology must be one of {TOPOLOGIES} (got {topology!r}).")
        self.topology = topology
        self.patch = nn.Linear(4, dim)  # 2 x 2 pixels per patch
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(0.02 * torch.randn(1, 17, dim))
        layers = []
        for layer in range(depth):
            for sublayer, branch in (("attention", Attention(dim, heads)), ("mlp", MLP(dim))):
                if topology == "pre":
                    layers.append(snn.PreNorm(dim, branch))
                elif topology == "post":
                    layers.append(snn.PostNorm(dim, branch))
                else:
                    layers.append(snn.SiameseNorm(dim, branch, layer=layer, sublayer=sublayer))
        self.layers = nn.ModuleList(layers)
        self.fusion = snn.SiameseFusion(dim) if topology == "siamese" else None
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:  # (B, 8, 8) in [0, 1]
        patches = images.unfold(1, 2, 2).unfold(2, 2, 2).flatten(-2).flatten(1, 2)  # (B, 16, 4)
        x = torch.cat([self.cls.expand(len(images), -1, -1), self.patch(patches)], dim=1) + self.pos
        state = snn.SiameseNorm.expand(x) if self.fusion is not None else x
        for layer in self.layers:
            state = layer(state)
        h = self.fusion(state) if self.fusion is not None else state
        return self.head(self.norm(h)[:, 0])


def digits(seed: int = 0):
    from sklearn.datasets import load_digits

    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32) / 16.0
    labels = torch.tensor(data.target)
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(images))
    return (images[order[:cut]], labels[order[:cut]]), (images[order[cut:]], labels[order[cut:]])


def train(topology: str, steps: int = 400, seed: int = 0, lr: float = 1e-3, batch: int = 64, depth: int = 6) -> float:
    """Train one model; return its accuracy on the held-out 20%."""
    torch.manual_seed(seed)
    (x_train, y_train), (x_test, y_test) = digits(seed)
    model = ViT(topology, depth=depth)
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optim, max_lr=lr, total_steps=steps, pct_start=0.1)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        idx = torch.randint(0, len(x_train), (batch,), generator=gen)
        loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
        optim.zero_grad()
        loss.backward()
        optim.step()
        schedule.step()
    model.eval()
    with torch.no_grad():
        return (model(x_test).argmax(-1) == y_test).float().mean().item()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--topology", choices=TOPOLOGIES, nargs="*", default=list(TOPOLOGIES),
                        help="which residual topologies to train (default: all three)")
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps of 64 images")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (one-cycle schedule)")
    parser.add_argument("--depth", type=int, default=6, help="transformer layers")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for topology in args.topology:
        acc = train(topology, args.steps, args.seed, args.lr, depth=args.depth)
        print(f"{topology:8s} held-out accuracy {100 * acc:.1f}% ({args.steps} steps, depth {args.depth})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
