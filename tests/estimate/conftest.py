import pytest

from tests.passes.remote.inprocess_server import STORE


@pytest.fixture(autouse=True)
def _fresh_store() -> None:
    STORE.reset()
