"""Shared fixtures for the optimizer tests: the declarative option matrix."""

import pytest

from ..options import OPTIONS


@pytest.fixture(params=OPTIONS)
def option(request):
    return request.param
