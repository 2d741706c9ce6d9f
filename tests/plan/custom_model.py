"""A decoder that is not one of spmd.plan's built-in shapes, for planning through ``ModuleDecoder``.

Blocks are a norm and an MLP on the residual stream; a learned position embedding is added to the
tokens' embeddings, so the model needs the whole sequence on each rank (context parallelism
cannot run it: the search must report that, not estimate it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from spmd.plan import ModuleDecoder

DIM, VOCAB, SEQ = 64, 256, 128


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(DIM)
        self.up, self.down = nn.Linear(DIM, 4 * DIM, bias=False), nn.Linear(4 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class MlpDecoder(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.positions = nn.Parameter(torch.zeros(SEQ, DIM))
        self.layers = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.positions
        for block in self.layers:
            x = block(x)
        return self.head(x)


MLP_DECODER = ModuleDecoder(name="mlp decoder", factory=MlpDecoder, layers=4, dim=DIM, vocab=VOCAB)
