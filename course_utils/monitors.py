"""ActivationMonitor, the probe that lesson 07 keeps out of a compiled graph.

It lives in a module of its own, not in lesson07.py, so that the notebook and the checker's fresh
copy of lesson07 share one class: a learner's isinstance(module, ActivationMonitor) must find
the monitors in the models the check builds.
"""

import torch
from torch import nn


class ActivationMonitor(nn.Module):
    """An identity layer that records, at each call, the largest |activation| of each feature as Python floats."""

    def __init__(self):
        super().__init__()
        self.records: list[list[float]] = []

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.records.append(h.detach().abs().amax(dim=0).tolist())  # .tolist(): Python numbers, out of any graph
        return h
