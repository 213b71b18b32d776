"""Fixtures shared by several test files."""

import pytest

from tests.helpers.hub import hub_cache  # noqa: F401 (a fixture: an empty Hugging Face cache in tmp_path)


@pytest.fixture(scope="module")
def ray_session():
    """Ray for one test module (skipped where Ray is not installed), shut down after it: each module
    that starts ranks uses it (`pytest.mark.usefixtures("ray_session")` for all of its tests)."""
    ray = pytest.importorskip("ray")
    yield
    ray.shutdown()
