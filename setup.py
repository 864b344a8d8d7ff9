"""What goes into the cuvmm-torch wheel, and where (pyproject.toml has the rest; docs/pytorch.md, "The wheel").

- ``cuvmm_torch/`` (python/cuvmm_torch/), the module;
- ``cuvmm_torch/libcuvmm_torch.so``: the cuvmm-torch crate's cdylib, a plain C library that ctypes and the C++
  layer load (setuptools-rust's ``Binding.NoBinding``), under the name they look for;
- ``cuvmm_torch/csrc/cuvmm_allocator.cpp`` and ``cuvmm_torch/cuvmm_torch.h``: the C++ layer, compiled at first
  use against the user's PyTorch (``cuvmm_torch.csrc_dir()`` finds them there first);
- ``cuvmm_torch_autoinstall.pth`` in site-packages: with ``CUVMM_TORCH_AUTOINSTALL=1``, cuvmm becomes PyTorch's
  CUDA allocator when a program imports torch (python/cuvmm_torch/autoinstall.py); unset, it does nothing;
- ``cuvmm`` in the environment's ``bin/``: the cuvmm-lab crate's command-line tool (``RustBin``), with the CUDA
  backend (libcuda is opened only for ``--backend cuda``).

Nothing in it calls Python's C API, so the wheel is tagged ``py3-none-<platform>``: one wheel for every Python 3.
``tools/wheel.sh`` builds the manylinux one (glibc 2.28, through cargo-zigbuild) and checks its tag.
"""

import os
import shutil

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py
from setuptools_rust import Binding, RustBin, RustExtension, Strip, build_rust

PACKAGE = "cuvmm_torch"
LIBRARY = "libcuvmm_torch.so"
# (source in the checkout, destination in the package)
PACKAGE_FILES = [
    ("cuvmm-torch/csrc/cuvmm_allocator.cpp", "csrc/cuvmm_allocator.cpp"),
    ("cuvmm-torch/cuvmm_torch.h", "cuvmm_torch.h"),
]
# Beside the package, in site-packages itself, where the interpreter reads .pth files at start-up.
PTH = "python/cuvmm_torch_autoinstall.pth"


class BuildPy(build_py):
    """The package's Python files, plus the C++ layer's sources and header, and the .pth hook."""

    def run(self):
        super().run()
        if self.editable_mode:
            return  # an editable install reads them from the checkout (csrc_dir()'s second place)
        for source, destination in PACKAGE_FILES:
            target = os.path.join(self.build_lib, PACKAGE, destination)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copyfile(source, target)
        shutil.copyfile(PTH, os.path.join(self.build_lib, os.path.basename(PTH)))


class BuildRust(build_rust):
    """The cdylib as ``libcuvmm_torch.so``: it is no Python extension module, so it takes no
    ``.cpython-3XX-...`` suffix, and the name stays the one the C++ layer, the header and the docs use."""

    def get_dylib_ext_path(self, ext, target_fname):
        path = super().get_dylib_ext_path(ext, target_fname)
        return os.path.join(os.path.dirname(path), LIBRARY)


class BdistWheel(bdist_wheel):
    """``py3-none-<platform>``: the binaries depend on the platform, not on Python's version or ABI."""

    def get_tag(self):
        _, _, platform = super().get_tag()
        return "py3", "none", platform


setup(
    rust_extensions=[
        RustExtension(
            f"{PACKAGE}.{LIBRARY[3:-3]}",
            path="cuvmm-torch/Cargo.toml",
            binding=Binding.NoBinding,
            args=["--locked"],
            strip=Strip.Debug,
        ),
        RustBin(
            "cuvmm",
            path="cuvmm-lab/Cargo.toml",
            args=["--locked", "--bin", "cuvmm"],
            features=["cuda"],
            strip=Strip.Debug,
        ),
    ],
    cmdclass={"build_py": BuildPy, "build_rust": BuildRust, "bdist_wheel": BdistWheel},
    zip_safe=False,
)
