"""Behaviour of ``python -m membudget.info`` and of loading the native extension
through membudget._native: versions and build info are printed, a bad
environment is reported without a crash, and a missing or mismatched extension
is a typed error that says how to rebuild."""
import importlib.machinery
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import membudget
from membudget import _native
from membudget._native import NativeExtensionError, explain_import_failure, load_extension

PYTHON_DIR = Path(membudget.__file__).resolve().parent.parent


def _extension_builds():
    try:
        load_extension()
        return True
    except NativeExtensionError:
        return False


requires_native = pytest.mark.skipif(not _extension_builds(), reason="native extension not built (make build)")


def run_python(*args, env=None):
    environ = {key: value for key, value in os.environ.items() if not key.startswith("MEMBUDGET_")}
    environ["PYTHONPATH"] = os.pathsep.join([str(PYTHON_DIR), os.environ.get("PYTHONPATH", "")])
    environ.update(env or {})
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=environ, timeout=120)


@pytest.fixture
def fresh_loader(monkeypatch):
    """Forget any loaded extension so load_extension() imports again."""
    monkeypatch.setattr(_native, "_extension", None)


@requires_native
def test_info_prints_versions_and_build_info():
    result = run_python("-m", "membudget.info")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert torch.__version__ in out
    assert "cuda backend compiled" in out
    assert "torch built against" in out and "compiler" in out
    assert "backends" in out and "host" in out
    assert "cuda device visible" in out
    assert "MEMBUDGET_BUDGET" in out and "unbounded" in out


@requires_native
def test_info_reports_a_bad_environment_without_crashing():
    result = run_python("-m", "membudget.info", env={"MEMBUDGET_BUDGET": "12 potatoes"})
    assert result.returncode == 0, result.stderr
    assert "MEMBUDGET_BUDGET='12 potatoes' is not a size" in result.stdout
    assert "Traceback" not in result.stderr


@requires_native
def test_info_shows_active_configuration_and_unknown_variables():
    result = run_python("-m", "membudget.info", env={"MEMBUDGET_POLICY": "lru", "MEMBUDGET_PLOICY": "x"})
    assert result.returncode == 0, result.stderr
    assert "lru" in result.stdout
    assert "did you mean MEMBUDGET_POLICY?" in result.stdout


@requires_native
def test_cli_info_subcommand():
    result = run_python("-m", "membudget", "info")
    assert result.returncode == 0, result.stderr
    assert "cuda backend compiled" in result.stdout


def test_info_exits_1_with_typed_error_when_extension_missing():
    code = (
        "import sys, runpy; sys.modules['membudget._C'] = None; "
        "runpy.run_module('membudget.info', run_name='__main__')"
    )
    result = run_python("-c", code)
    assert result.returncode == 1
    assert "make build" in result.stdout
    assert torch.__version__ in result.stdout


def test_load_extension_raises_typed_error_when_import_fails(monkeypatch, fresh_loader):
    monkeypatch.setitem(sys.modules, "membudget._C", None)
    with pytest.raises(NativeExtensionError) as caught:
        load_extension()
    assert isinstance(caught.value, ImportError)
    assert "make build" in str(caught.value)


def test_load_extension_rejects_an_extension_built_for_another_torch(monkeypatch, fresh_loader):
    fake = types.ModuleType("membudget._C")
    fake.torch_version_built = "1.0.0"
    monkeypatch.setitem(sys.modules, "membudget._C", fake)
    with pytest.raises(NativeExtensionError) as caught:
        load_extension()
    message = str(caught.value)
    assert "built for torch 1.0.0" in message
    assert f"torch {torch.__version__} is imported" in message
    assert "make build" in message


def test_load_extension_returns_a_matching_extension_once(monkeypatch, fresh_loader):
    fake = types.ModuleType("membudget._C")
    fake.torch_version_built = torch.__version__
    monkeypatch.setitem(sys.modules, "membudget._C", fake)
    assert load_extension() is fake
    monkeypatch.setitem(sys.modules, "membudget._C", None)  # not imported again
    assert load_extension() is fake


def test_explain_not_built(tmp_path):
    message = explain_import_failure(ImportError("No module named 'membudget._C'"), tmp_path)
    assert "is not built" in message and "make build" in message
    assert torch.__version__ in message


def test_explain_built_for_another_python(tmp_path):
    (tmp_path / "_C.cpython-27-x86_64-linux-gnu.so").write_bytes(b"")
    message = explain_import_failure(ImportError("No module named 'membudget._C'"), tmp_path)
    assert "built for another Python" in message
    assert "_C.cpython-27-x86_64-linux-gnu.so" in message
    assert "make build" in message


def test_explain_undefined_symbol_means_another_torch(tmp_path):
    (tmp_path / ("_C" + importlib.machinery.EXTENSION_SUFFIXES[0])).write_bytes(b"")
    error = ImportError("_C.so: undefined symbol: _ZN3c104cuda9SetDeviceEa")
    message = explain_import_failure(error, tmp_path)
    assert "built for another torch" in message
    assert "undefined symbol: _ZN3c104cuda9SetDeviceEa" in message
    assert f"torch {torch.__version__}" in message
    assert "make build" in message
