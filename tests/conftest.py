import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
