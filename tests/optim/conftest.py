"""Shared fixtures for the optimizer tests: the declarative option matrix."""

import pytest

from megatron_lowprec.optim import available_strategies

OPTIONS = [strategy.name for strategy in available_strategies()]


@pytest.fixture(params=OPTIONS)
def option(request):
    return request.param
