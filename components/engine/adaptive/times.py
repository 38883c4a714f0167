"""A round profile's numbers: the seconds of one batch-engine round per (batch size, cap), as
measured by ``profile.profile_round_times`` and read by the adaptive policy (``policy.py``).

Knows seconds on a grid and how to interpolate them; nothing about engines or models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray
from torch import Tensor


@dataclass
class RoundTimes:
    """Seconds of one engine round per (batch size, cap): a measured grid, interpolated.

    Between profiled batch sizes the seconds are linear in B; above the largest they grow in
    proportion to B (each row brings its own tokens); a cap above the largest profiled one is
    held at it."""

    batch_sizes: list[int]  # increasing
    seconds: Tensor  # [len(batch_sizes), max_cap + 1] float64

    def __post_init__(self) -> None:
        self.seconds = torch.as_tensor(self.seconds, dtype=torch.float64)
        if self.seconds.dim() != 2 or self.seconds.shape[0] != len(self.batch_sizes) or not self.batch_sizes:
            raise ValueError(f"RoundTimes: seconds {tuple(self.seconds.shape)} does not match "
                             f"{len(self.batch_sizes)} batch sizes")
        if any(b <= a for a, b in zip(self.batch_sizes, self.batch_sizes[1:])) or self.batch_sizes[0] < 1:
            raise ValueError(f"RoundTimes: batch sizes must be increasing and >= 1, got {self.batch_sizes}")

    @property
    def max_cap(self) -> int:
        return self.seconds.shape[1] - 1

    def row(self, batch_size: int, max_cap: int | None = None) -> Tensor:
        """[max_cap + 1] float64: the seconds of every cap 0..max_cap (default: the profiled
        ones) at ``batch_size``, interpolated in B; caps above the profile's are held at its last."""
        return torch.from_numpy(self.row_array(batch_size, max_cap))

    def row_array(self, batch_size: int, max_cap: int | None = None) -> NDArray:
        """``row`` as a numpy array (what the policy reads every round)."""
        sizes, b, grid = self.batch_sizes, float(batch_size), self.seconds.numpy()  # a view
        if b >= sizes[-1]:
            row = grid[-1] * (b / sizes[-1])
        elif b <= sizes[0]:
            row = grid[0]
        else:
            hi = next(i for i, s in enumerate(sizes) if s >= b)
            t = (b - sizes[hi - 1]) / (sizes[hi] - sizes[hi - 1])
            row = grid[hi - 1] + t * (grid[hi] - grid[hi - 1])
        caps = np.minimum(np.arange((self.max_cap if max_cap is None else int(max_cap)) + 1), self.max_cap)
        return row[caps]

    def __call__(self, batch_size: int, cap: int) -> float:
        return float(self.row_array(batch_size)[min(max(int(cap), 0), self.max_cap)])

    def to_dict(self) -> dict[str, Any]:
        return {"batch_sizes": list(self.batch_sizes), "seconds": self.seconds.tolist()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RoundTimes:
        return cls([int(b) for b in data["batch_sizes"]], torch.tensor(data["seconds"], dtype=torch.float64))
