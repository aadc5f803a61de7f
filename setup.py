"""Builds membudget's native extension by driving CMake.

CMakeLists.txt holds the source lists; this file only finds torch and Python in
the running interpreter and passes their locations to CMake, then places the
built module in python/membudget/. `pip install --no-build-isolation -e .`
(what the Makefile runs) builds against the torch already installed.

Environment: MEMBUDGET_BUILD_DIR (default build/) selects the CMake build
folder; MEMBUDGET_WITH_CUDA=0 skips the CUDA backend even if the toolkit exists.
"""
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        import torch
        from torch.utils import cpp_extension

        build_dir = Path(os.environ.get("MEMBUDGET_BUILD_DIR", ROOT / "build")).resolve()
        build_dir.mkdir(parents=True, exist_ok=True)
        torch_has_cuda = torch.version.cuda is not None
        cuda_root = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
        args = [
            f"-DTORCH_INCLUDE_DIRS={';'.join(cpp_extension.include_paths())}",
            f"-DTORCH_LIBRARY_DIR={Path(torch.__file__).parent / 'lib'}",
            f"-DTORCH_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            f"-DTORCH_VERSION_STRING={torch.__version__}",
            f"-DTORCH_HAS_CUDA={'ON' if torch_has_cuda else 'OFF'}",
            f"-DPYTHON_INCLUDE_DIR={sysconfig.get_paths()['include']}",
            f"-DMEMBUDGET_EXTENSION_NAME=_C",
            f"-DMEMBUDGET_WITH_CUDA={'OFF' if os.environ.get('MEMBUDGET_WITH_CUDA') == '0' else 'ON'}",
            "-DCMAKE_BUILD_TYPE=Release",
        ]
        if os.path.isdir(cuda_root):
            args.append(f"-DCUDAToolkit_ROOT={cuda_root}")
        if shutil.which("ninja"):
            args += ["-G", "Ninja"]
        subprocess.check_call(["cmake", str(ROOT)] + args, cwd=build_dir)
        jobs = os.environ.get("MEMBUDGET_BUILD_JOBS", str(os.cpu_count() or 2))
        subprocess.check_call(["cmake", "--build", ".", "--parallel", jobs], cwd=build_dir)
        suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
        built = build_dir / "_C.so"
        for target in (Path(self.get_ext_fullpath(ext.name)), ROOT / "python" / "membudget" / f"_C{suffix}"):
            target.parent.mkdir(parents=True, exist_ok=True)
            if built.resolve() != target.resolve():
                # Copy beside, then rename: overwriting a shared library in
                # place crashes every process that has it loaded (seen: a
                # benchmark worker died with SIGSEGV during a rebuild).
                staging = target.with_name(target.name + ".tmp")
                shutil.copy2(built, staging)
                os.replace(staging, target)


setup(
    name="membudget",
    version="0.1.0",
    description="Run PyTorch training under a device-memory budget (swap and recompute of saved activations)",
    package_dir={"": "python"},
    packages=find_packages("python"),
    ext_modules=[CMakeExtension("membudget._C")],
    cmdclass={"build_ext": CMakeBuild},
    entry_points={"console_scripts": ["membudget=membudget.cli:main"]},
    python_requires=">=3.9",
)
