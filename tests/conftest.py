"""Fixtures shared by several test files."""

from tests.helpers.hub import hub_cache  # noqa: F401 (a fixture: an empty Hugging Face cache in tmp_path)
