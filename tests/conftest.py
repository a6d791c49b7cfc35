import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # benchmarks/ holds the naive reference implementations used as oracles
    sys.path.insert(0, ROOT)


import pytest  # noqa: E402


@pytest.fixture(scope="module")
def transfer_queue():
    """verl's real TransferQueue on a local ray (started here unless already running), as the v1 trainer uses it."""
    ray = pytest.importorskip("ray")
    verl = pytest.importorskip("verl")
    import transfer_queue as tq
    from omegaconf import OmegaConf

    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    cfg = OmegaConf.load(os.path.join(verl.__path__[0], "trainer/config/transfer_queue/transfer_queue.yaml"))
    cfg.enable = True
    cfg.backend.SimpleStorage.num_data_storage_units = 1
    cfg.backend.SimpleStorage.total_storage_size = 1000
    tq.init(cfg)
    yield tq
    tq.close()
    if started_ray:
        ray.shutdown()


@pytest.fixture(scope="module")
def one_thread():
    """The tiny model is overhead-bound: one torch thread is many times faster than two on a shared 2-core box.
    A module opts in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
