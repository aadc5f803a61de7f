"""The one place membudget's native extension (``membudget._C``) is loaded.

Where this sits in the flow: ``install()``, ``stats()`` and ``python -m
membudget.info`` call :func:`load_extension` to reach the C++ allocator and
residency manager. If the extension is missing, does not load, or was built
against a torch other than the one imported, a :class:`NativeExtensionError`
says what was built, what is present and how to rebuild (``make build``), so a
user never has to read an undefined-symbol message to find out.
"""
from __future__ import annotations

import importlib
import importlib.machinery
import sys
from pathlib import Path
from types import ModuleType
from typing import Optional

__all__ = ["NativeExtensionError", "load_extension"]

EXTENSION_NAME = "membudget._C"
BUILD_HINT = (
    "build it with `make build` in the membudget repository "
    "(or `python setup.py build_ext --inplace`)"
)

_extension: Optional[ModuleType] = None


class NativeExtensionError(ImportError):
    """The native extension ``membudget._C`` cannot be used: not built, built for
    another torch or Python, or failing to load. The message says which, what
    is present and how to rebuild."""


def _present() -> str:
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = "not importable"
    python = ".".join(str(part) for part in sys.version_info[:3])
    return f"torch {torch_version}, Python {python}"


def explain_import_failure(error: ImportError, package_dir: Path) -> str:
    """Return the message for a failed import of ``membudget._C`` from
    ``package_dir``: not built at all, built for another Python (no file with
    this interpreter's suffix), or present but not loading (an undefined symbol
    usually means another torch), always with what is present and the build
    hint. Separate from :func:`load_extension` so each case can be tested."""
    built = sorted(package_dir.glob("_C.*so")) + sorted(package_dir.glob("_C.*pyd"))
    present = _present()
    if not built:
        return f"membudget's native extension {EXTENSION_NAME} is not built ({present}); {BUILD_HINT}"
    suffixes = importlib.machinery.EXTENSION_SUFFIXES
    usable = [path for path in built if any(path.name == "_C" + suffix for suffix in suffixes)]
    names = ", ".join(path.name for path in built)
    if not usable:
        return (
            f"membudget's native extension was built for another Python ({names} in {package_dir}); "
            f"present: {present}, which loads _C{suffixes[0]}; {BUILD_HINT}"
        )
    detail = str(error)
    if "undefined symbol" in detail:
        return (
            f"membudget's native extension {usable[0]} does not load against the torch present "
            f"({present}): it was built for another torch ({detail}); {BUILD_HINT}"
        )
    return f"membudget's native extension {usable[0]} failed to load ({present}): {detail}; {BUILD_HINT}"


def load_extension() -> ModuleType:
    """Import ``membudget._C`` once and return it, after checking that it was
    built against the torch imported in this process. Raises
    :class:`NativeExtensionError` with what was built, what is present and how
    to rebuild when it is missing, fails to load or was built for another
    torch."""
    global _extension
    if _extension is not None:
        return _extension
    # torch first: the extension links against libtorch/libc10, which the
    # dynamic loader only finds once torch has loaded them.
    import torch

    try:
        extension = importlib.import_module(EXTENSION_NAME)
    except ImportError as error:
        package_dir = Path(__file__).resolve().parent
        raise NativeExtensionError(explain_import_failure(error, package_dir)) from error
    built_for = getattr(extension, "torch_version_built", None)
    if built_for != torch.__version__:
        raise NativeExtensionError(
            f"membudget's native extension {getattr(extension, '__file__', EXTENSION_NAME)} was built "
            f"for torch {built_for}, but torch {torch.__version__} is imported; {BUILD_HINT}"
        )
    _extension = extension
    return extension
