"""The GPU check of the connector's sync-free path (``tests/gpu/connector_sync.py``) runs its calls on
the CPU too (the dry run): the load lands and the save reads back what the blocks hold."""
import torch

from tests.gpu import connector_sync

torch.set_num_threads(1)


def test_connector_sync_check_runs_on_the_cpu():
    ok, out = connector_sync.check("cpu")
    assert ok and out["load_equal"] and out["save_equal"], out
