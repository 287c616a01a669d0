import os

import pytest
import torch

from tiny import tiny_qwen, tiny_tokenizer

torch.set_num_threads(1)  # tiny models: threads only add overhead


def pytest_addoption(parser):
    parser.addoption("--metasd-device", default=os.environ.get("METASD_TEST_DEVICE", "cpu"),
                     help="device the conformance tests build their pools on (default cpu; e.g. cuda)")


def pytest_configure(config):
    """Register the second device (tests/second_device.py) before any test runs: torch's autograd engine sizes its
    per-device queues at the first backward of the process, so a device registered after a CPU backward (a trainer's
    test) would be unknown to it. Registering changes nothing for CPU work (test_second_device checks that)."""
    import second_device

    second_device.enable()


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="session")
def verifier_model():
    return tiny_qwen(seed=0)


#: files of the longest tests (real models; Ray workers; subprocesses), run first
LONGEST_FIRST = ("test_real_smoke.py", "test_ray_executor.py", "test_faults.py")


def pytest_collection_modifyitems(config, items):
    """The longest tests first, so that under the README's `-n 2 --dist worksteal` they start at once and the
    short tests fill in around them (collected in file order, they came last and made a tail). The order is
    otherwise kept."""
    def rank(item) -> int:
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)
