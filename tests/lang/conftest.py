"""One default-model Engine for all of tests/lang (a model load is the slow part); KV integrity is
checked after every test that used it."""

from __future__ import annotations

import pytest

import sglbus as sgl


@pytest.fixture(scope="package")
def engine():
    e = sgl.Engine()
    yield e
    e.shutdown()


@pytest.fixture
def backend(engine):
    """The Engine as the default backend of the programs in a test."""
    sgl.set_default_backend(engine)
    yield sgl.get_default_backend()
    engine.check_integrity()
