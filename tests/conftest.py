import os

import pytest

# Two cores in CI: keep torch (in tests and in the servers they start) on one thread.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(1)
