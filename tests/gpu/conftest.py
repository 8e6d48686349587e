"""tests/gpu: checks that need a CUDA device (marker `gpu`); each skips with its reason where CUDA is absent."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (tests/gpu); torch sees none here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
