"""Test markers (defined once, here) and the fixture that puts membudget back
to a clean, uninstalled state after every test.

Markers: ``requires_cuda`` skips without a CUDA device; ``requires_native``
skips when the extension is not built (it always is under ``make test``).

Fixtures: ``lineage_recorder`` runs a test once per lineage recorder
(``MEMBUDGET_LINEAGE=python`` and ``cxx``); ``python_lineage`` pins the
Python recorder for tests about its dispatch mode.
"""
import gc

import pytest
import torch


def _native_available() -> bool:
    try:
        from membudget._native import load_extension

        load_extension()
        return True
    except ImportError:
        return False


def pytest_collection_modifyitems(config, items):
    no_cuda = pytest.mark.skip(reason="needs a CUDA device (none visible)")
    no_native = pytest.mark.skip(reason="membudget's native extension is not built (run `make build`)")
    has_native = _native_available()
    for item in items:
        if "requires_cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_cuda)
        if "requires_native" in item.keywords and not has_native:
            item.add_marker(no_native)


@pytest.fixture(params=["python", "cxx"])
def lineage_recorder(request, monkeypatch):
    """Runs the test under each lineage recorder (``install()`` reads
    ``MEMBUDGET_LINEAGE`` when not told otherwise); yields its name."""
    monkeypatch.setenv("MEMBUDGET_LINEAGE", request.param)
    yield request.param


@pytest.fixture
def python_lineage(monkeypatch):
    """Pins the Python recorder (tests of its dispatch mode)."""
    monkeypatch.setenv("MEMBUDGET_LINEAGE", "python")


@pytest.fixture(scope="module")
def gpt_trace():
    """A fake-tensor trace of a small GPT step (forward and backward), for the
    simulator's tests."""
    import membudget
    from membudget.models import gpt

    w = gpt(batch=4, context=128, width=64, heads=4, layers=2, vocab=512)
    torch.manual_seed(0)
    return membudget.trace(lambda m: w.loss(m, w.batch(torch.device("cpu"))).backward(), fake=True,
                           setup=w.build, metadata={"model": "gpt-quick"})


@pytest.fixture(autouse=True)
def membudget_clean_state():
    """After each test: uninstall, drop garbage, return cached segments, zero
    counters and peaks, so that tests do not see each other's memory."""
    yield
    if not _native_available():
        return
    import membudget
    from membudget._native import load_extension

    native = load_extension()
    if native.runtime_kind() != "none":
        membudget.uninstall()
        gc.collect()
        native.synchronize()
        native.release_cached()
        membudget.reset_counters()
        membudget.reset_peak_stats()
