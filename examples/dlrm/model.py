"""A small DLRM for the reference job: TorchRec embedding tables plus a dense tower that torch.compile can take.

The model is split where sharding and compilation want it split: `sparse_arch` is a TorchRec
`EmbeddingBagCollection` (sharded by the planner, run by fbgemm's fused kernels, never compiled), and
`dense_tower` (bottom MLP, dot interaction, over-arch MLP) takes plain tensors only, so `dense_tower.compile()`
sees one static graph with no KeyedJaggedTensor in it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor


@dataclass(frozen=True, kw_only=True)
class DlrmConfig:
    """Shape of the model. The synthetic data set must be built with the same tables, rows and dense width."""

    num_tables: int = 12
    """Number of embedding tables; one sparse feature per table (feature `f{i}` reads table `t{i}`)."""
    num_rows: int = 4000
    """Rows of every table (ids are in [0, num_rows))."""
    embedding_dim: int = 32
    """Width of every embedding; the bottom MLP ends at this width so the dot interaction can pair them."""
    num_dense: int = 13
    """Number of dense (continuous) input features."""
    bottom_mlp: tuple[int, ...] = (64, 32)
    """Hidden widths of the bottom (dense) MLP; the last must equal `embedding_dim`."""
    over_mlp: tuple[int, ...] = (64, 32)
    """Hidden widths of the over-arch MLP; a final linear layer to one logit is added after them."""

    def __post_init__(self) -> None:
        for name in ("num_tables", "num_rows", "embedding_dim", "num_dense"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not self.bottom_mlp or self.bottom_mlp[-1] != self.embedding_dim:
            raise ValueError(
                f"bottom_mlp must end at embedding_dim={self.embedding_dim} for the dot interaction, "
                f"got {self.bottom_mlp}"
            )
        if any(width < 1 for width in (*self.bottom_mlp, *self.over_mlp)):
            raise ValueError("MLP widths must be positive")

    @property
    def feature_names(self) -> list[str]:
        """Sparse feature names, in the order the dense tower stacks their pooled embeddings."""
        return [f"f{i}" for i in range(self.num_tables)]

    def table_configs(self) -> list[EmbeddingBagConfig]:
        """One sum-pooled table per sparse feature."""
        return [
            EmbeddingBagConfig(
                name=f"t{i}",
                embedding_dim=self.embedding_dim,
                num_embeddings=self.num_rows,
                feature_names=[name],
            )
            for i, name in enumerate(self.feature_names)
        ]


def _mlp(in_width: int, widths: tuple[int, ...], *, final_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, width in enumerate(widths):
        layers.append(nn.Linear(in_width, width))
        if final_relu or i < len(widths) - 1:
            layers.append(nn.ReLU())
        in_width = width
    return nn.Sequential(*layers)


class DotInteraction(nn.Module):
    """DLRM's pairwise interaction: the dense vector and every pooled embedding, all pairwise dot products.

    Input: dense `[B, D]`, sparse `[B, F, D]`. Output `[B, D + (F+1)F/2]`: the dense vector followed by the
    strictly upper triangle of the `(F+1)x(F+1)` Gram matrix.
    """

    def __init__(self, num_sparse: int) -> None:
        super().__init__()
        num_vectors = num_sparse + 1
        rows, cols = torch.triu_indices(num_vectors, num_vectors, offset=1)
        # Buffers (not parameters): fixed index pattern, moved with the module, not checkpointed.
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("cols", cols, persistent=False)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        vectors = torch.cat([dense.unsqueeze(1), sparse], dim=1)
        gram = torch.bmm(vectors, vectors.transpose(1, 2))
        return torch.cat([dense, gram[:, self.rows, self.cols]], dim=1)


class DenseTower(nn.Module):
    """Bottom MLP, dot interaction and over-arch: plain tensors in, one logit per sample out.

    This is the part the job compiles; it has no TorchRec types in its signature.
    """

    def __init__(self, config: DlrmConfig) -> None:
        super().__init__()
        self.bottom = _mlp(config.num_dense, config.bottom_mlp, final_relu=True)
        self.interaction = DotInteraction(config.num_tables)
        num_pairs = (config.num_tables + 1) * config.num_tables // 2
        self.over = _mlp(config.embedding_dim + num_pairs, (*config.over_mlp, 1), final_relu=False)

    def forward(self, dense_features: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """`dense_features [B, num_dense]`, `pooled [B, num_tables, embedding_dim]` -> logits `[B]`."""
        return self.over(self.interaction(self.bottom(dense_features), pooled)).squeeze(-1)


class Dlrm(nn.Module):
    """The whole model: `sparse_arch` (an EmbeddingBagCollection) feeding `dense_tower`.

    Build it with `device=torch.device("meta")` for the tables when it is to be sharded by
    `DistributedModelParallel`: the sharder allocates only each rank's shards.
    """

    def __init__(self, config: DlrmConfig, *, table_device: torch.device | None = None) -> None:
        super().__init__()
        self.config = config
        self.sparse_arch = EmbeddingBagCollection(tables=config.table_configs(), device=table_device)
        self.dense_tower = DenseTower(config)

    def pooled_embeddings(self, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        """Look up and sum-pool every feature: `[B, num_tables, embedding_dim]` in `feature_names` order."""
        by_name = self.sparse_arch(sparse_features).to_dict()
        return torch.stack([by_name[name] for name in self.config.feature_names], dim=1)

    def forward(self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        """Logits `[B]` for one batch."""
        return self.dense_tower(dense_features, self.pooled_embeddings(sparse_features))
