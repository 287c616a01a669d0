import builtins
import os

import pytest
import torch

from tiny import tiny_qwen, tiny_tokenizer

torch.set_num_threads(1)  # tiny models: threads only add overhead


#: the fake second device drives torch's PrivateUse1 hooks from Python (torch._C._acc), which older torch releases
#: within pyproject.toml's range (2.6 has none) lack: there its two test files are not collected, and the header says so
SECOND_DEVICE = hasattr(torch._C, "_acc") and hasattr(torch._C._acc, "PrivateUse1Hooks")
collect_ignore = [] if SECOND_DEVICE else ["test_second_device.py", "test_second_device_training.py"]


def pytest_report_header(config):
    if not SECOND_DEVICE:
        return (f"second device: unavailable on torch {torch.__version__} (no torch._C._acc.PrivateUse1Hooks); "
                f"not collected: {', '.join(collect_ignore)}")


def pytest_addoption(parser):
    parser.addoption("--metasd-device", default=os.environ.get("METASD_TEST_DEVICE", "cpu"),
                     help="device the conformance tests build their pools on (default cpu; e.g. cuda)")


def pytest_configure(config):
    """Register the second device (tests/second_device.py) before any test runs: torch's autograd engine sizes its
    per-device queues at the first backward of the process, so a device registered after a CPU backward (a trainer's
    test) would be unknown to it. Registering changes nothing for CPU work (test_second_device checks that), but on a
    real accelerator it does: torch then routes pinned host memory to the PrivateUse1 hooks, which the fake device
    does not implement, so a run with ``--metasd-device cuda`` (benchmarks/gpu_check.py) leaves it unregistered."""
    if not SECOND_DEVICE or config.getoption("--metasd-device") != "cpu":
        return
    import second_device

    second_device.enable()


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="session")
def verifier_model():
    return tiny_qwen(seed=0)


def _process_state() -> dict:
    """Process-wide state a test file must leave as it found it: tests run in any order, several files to a process
    (one process, or each xdist worker), so a change one file leaves makes another's result depend on the order."""
    return {"builtins.print": builtins.print, "cwd": os.getcwd(), "grad enabled": torch.is_grad_enabled(),
            "inference mode": torch.is_inference_mode_enabled(), "default dtype": torch.get_default_dtype()}


@pytest.fixture(autouse=True, scope="module")
def _leaves_the_process_as_it_found_it(request):
    """Fails the file (an error in its last test's teardown) that changed ``_process_state``, and restores what can
    be restored so that the files after it still run as they would alone."""
    before = _process_state()
    yield
    changed = {key: (was, now) for key, (was, now) in
               ((key, (before[key], value)) for key, value in _process_state().items()) if was != now}
    builtins.print = before["builtins.print"]
    os.chdir(before["cwd"])
    torch.set_grad_enabled(before["grad enabled"])
    torch.set_default_dtype(before["default dtype"])
    if changed:
        pytest.fail(f"{request.module.__name__} changed process-wide state (before, after): {changed}", pytrace=False)


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
