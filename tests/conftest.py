import itertools
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
def compat_model(model_dir):
    """A tiny Qwen2 with a 4096-token context: what the compatibility, router and session tests serve."""
    return model_dir("compat", "qwen2", seed=5, max_position_embeddings=4096)


@pytest.fixture(scope="session")
def compat_model_b(model_dir):
    """The same shape with other weights: what their pushes deliver."""
    return model_dir("compat-b", "qwen2", seed=6, max_position_embeddings=4096)


@pytest.fixture(scope="session")
def compat_tok(compat_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(compat_model)


@pytest.fixture(scope="module")
def compat_srv(compat_model, module_servers, request):
    """A server of ``compat_model`` behind the test module's ``KEY``, and an HTTP client holding the key."""
    import httpx

    key = request.module.KEY
    server = module_servers(compat_model, "--dtype", "float32", "--kv-cache-tokens", "8192", "--api-key", key)
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=120) as http:
        yield http


@pytest.fixture(scope="session")
def llama_path(model_dir):
    return model_dir("llama-default", "llama")


ENGINE_DEFAULTS = {"dtype": "float32", "kv_cache_tokens": 1024}


class Made:
    """``made(*args, **kw)`` makes a thing with ``make`` and keeps it; ``close_all()`` closes every one
    with ``close``, last made first (a fixture's teardown)."""

    def __init__(self, make, close):
        self._make, self._close = make, close
        self.made: list = []

    def __call__(self, *args, **kw):
        thing = self._make(*args, **kw)
        self.made.append(thing)
        return thing

    def close_all(self) -> None:
        while self.made:
            self._close(self.made.pop())


def _engines() -> Made:
    """``engines(path, **kw)``: a ``RolloutEngine`` with ``ENGINE_DEFAULTS`` (``kw`` overrides them)."""
    from rollout import RolloutEngine

    return Made(lambda path, **kw: RolloutEngine(path, **{**ENGINE_DEFAULTS, **kw}), lambda e: e.shutdown())


def _servers(log_dir) -> Made:
    """``servers(path, *args, **kw)``: ``rollout serve`` from ``launch_server`` (waited for unless
    ``ready_timeout_s=None``), its output in a log beside the test's files (quoted if it fails to start)."""
    from rollout.server import launch_server

    count = itertools.count()

    def make(path: str, *args: str, **kw):
        kw.setdefault("log_path", str(log_dir / f"serve-{next(count)}.log"))
        return launch_server(path, *args, **kw)

    return Made(make, lambda server: server.stop())


@pytest.fixture
def make_engine():
    """Engines for one test, shut down after it."""
    made = _engines()
    yield made
    made.close_all()


@pytest.fixture(scope="module")
def module_engines():
    """Engines shared by a module's tests, shut down when the module ends."""
    made = _engines()
    yield made
    made.close_all()


@pytest.fixture
def make_server(tmp_path):
    """Servers for one test, stopped after it."""
    made = _servers(tmp_path)
    yield made
    made.close_all()


@pytest.fixture(scope="module")
def module_servers(tmp_path_factory):
    """Servers shared by a module's tests, stopped when the module ends."""
    made = _servers(tmp_path_factory.mktemp("servers"))
    yield made
    made.close_all()


def pytest_addoption(parser):
    parser.addoption("--fuzz-long", action="store_true",
                     help="run the fuzz module with many more examples (tests/test_fuzz.py)")


def pytest_configure(config):
    if config.getoption("--fuzz-long"):
        os.environ["ROLLOUT_FUZZ_EXAMPLES"] = os.environ.get("ROLLOUT_FUZZ_EXAMPLES", "400")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """After every test body (its servers, groups and routers still up): nothing of ours listens on
    every interface (``helpers.wildcard_listeners``)."""
    from helpers import wildcard_listeners

    result = yield
    wild = wildcard_listeners()
    if wild:
        raise AssertionError(f"listening on every interface (bind one address): {wild}")
    return result
