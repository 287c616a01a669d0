import pytest
import torch

from tiny import tiny_qwen, tiny_tokenizer

torch.set_num_threads(1)  # tiny models: threads only add overhead


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="session")
def verifier_model():
    return tiny_qwen(seed=0)
