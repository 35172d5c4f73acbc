"""Fixtures for the torch runner tests (helpers live in ``torch_helpers``)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _few_threads():
    # the machine is shared: keep torch from spreading over every core
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
