"""Fixtures for the torch runner tests (helpers, and the device and dtypes they run on, live in
``torch_helpers``)."""

from __future__ import annotations

import pytest
import torch
from torch_helpers import DEVICE, DTYPES, dtype_name


def pytest_report_header(config):
    where = torch.cuda.get_device_name(DEVICE) if torch.device(DEVICE).type == "cuda" else "cpu"
    return f"torch runner tests on {DEVICE} ({where}), dtypes {[dtype_name(d) for d in DTYPES]}"


@pytest.fixture(autouse=True)
def _few_threads():
    # the machine is shared: keep torch from spreading over every core
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
