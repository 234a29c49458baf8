"""Fixtures shared by the training-app tests."""

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """The data cache (the prepared embedded corpus) that every run of the session shares."""
    return tmp_path_factory.mktemp("lowprec_cache")
