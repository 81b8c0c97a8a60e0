import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not torch.cuda.is_available():
    # Triton kernels run under Triton's interpreter on CPU; it must be on before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A factory: model_dir(name, arch, **kwargs) -> path of a tiny model (made once per session)."""
    from rollout.tools.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("models")
    made: dict[str, str] = {}

    def get(name: str, arch: str = "llama", **kwargs) -> str:
        if name not in made:
            made[name] = make_tiny_model(str(root / name), arch, **kwargs)
        return made[name]

    return get


@pytest.fixture(scope="session")
def llama_path(model_dir):
    return model_dir("llama-default", "llama")


def pytest_addoption(parser):
    parser.addoption("--fuzz-long", action="store_true",
                     help="run the fuzz module with many more examples (tests/test_fuzz.py)")


def pytest_configure(config):
    if config.getoption("--fuzz-long"):
        os.environ["ROLLOUT_FUZZ_EXAMPLES"] = os.environ.get("ROLLOUT_FUZZ_EXAMPLES", "400")
