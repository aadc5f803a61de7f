"""``python -m membudget.info`` (and ``membudget info``): what is installed and active.

Where this sits in the flow: the first thing to run after ``make build`` and the
first thing to paste into a bug report. It prints membudget's version, Python,
torch and its CUDA version, the native extension's build information (loaded
through :mod:`membudget._native`), the backends compiled in, whether a CUDA
device is visible, and the configuration the environment would give
``install()``. A bad environment is reported, not raised; a missing or
mismatched extension prints the typed error and exits 1.
"""
from __future__ import annotations

import platform
import sys
import warnings
from typing import List, Optional, TextIO

__all__ = ["main", "membudget_version"]


def membudget_version() -> str:
    """Return membudget's version: the package's ``__version__`` when it has one,
    else the installed distribution's, else the native extension's, else
    ``"unknown"``; used by ``membudget --version`` and :func:`main`."""
    import membudget

    version = getattr(membudget, "__version__", None)
    if version:
        return str(version)
    from importlib.metadata import PackageNotFoundError, version as package_version

    try:
        return package_version("membudget")
    except PackageNotFoundError:
        pass
    from membudget._native import NativeExtensionError, load_extension

    try:
        return f"{load_extension().__version__} (from the native extension)"
    except (NativeExtensionError, AttributeError):
        return "unknown"


def _configuration_text() -> str:
    from membudget.config import Config, ConfigError, describe

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            text = describe(Config.from_env())
        except ConfigError as error:
            text = f"invalid environment: {error}"
    notes = [f"warning: {warning.message}" for warning in caught]
    return "\n".join([text, *notes])


def main(stream: Optional[TextIO] = None) -> int:
    """Print membudget's version, Python, torch and CUDA versions, the native
    extension's build info, the backends compiled in, CUDA visibility and the
    active configuration to ``stream`` (default stdout), and return the exit
    code: 0, or 1 (after printing the error) when the native extension cannot
    be loaded."""
    out = stream or sys.stdout
    from membudget._native import NativeExtensionError, load_extension

    import torch

    lines: List[str] = [
        f"python                    {platform.python_version()} ({sys.executable})",
        f"torch                     {torch.__version__}",
        f"torch cuda                {torch.version.cuda or 'none (CPU-only torch)'}",
    ]
    try:
        extension = load_extension()
    except NativeExtensionError as error:
        print(f"{'membudget':<26}(native extension unavailable)", file=out)
        print("\n".join(lines), file=out)
        print(f"error: {error}", file=out)
        return 1

    cuda_compiled = bool(getattr(extension, "cuda_backend_compiled", False))
    hooks_compiled = bool(getattr(extension, "torch_cuda_hooks_compiled", False))
    backends = "host, cuda" if cuda_compiled else "host"
    lines = [f"membudget                 {membudget_version()}", *lines]
    lines += [
        f"extension                 {getattr(extension, '__file__', '?')}",
        f"extension version         {getattr(extension, '__version__', '?')}",
        f"compiler                  {getattr(extension, 'compiler', '?')}",
        f"torch built against       {getattr(extension, 'torch_version_built', '?')}",
        f"cuda backend compiled     {'yes' if cuda_compiled else 'no'}",
        f"torch cuda hooks compiled {'yes' if hooks_compiled else 'no'}",
        f"backends                  {backends}",
        f"cuda device visible       {'yes' if torch.cuda.is_available() else 'no'}",
        "",
        "configuration (from MEMBUDGET_* environment variables):",
    ]
    lines += ["  " + line for line in _configuration_text().splitlines()]
    print("\n".join(lines), file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
