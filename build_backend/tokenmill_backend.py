"""tokenmill's build backend: setuptools' own, plus torch as a build requirement only where the
environment being installed into has none.

The C++ kernels compile against torch's headers (setup.py, src/tokenmill/kernels/build.py), and
must match the torch they will run with. pip builds in an isolated environment; requiring torch
there would install a second copy of it for every build (about 45 s, and from plain PyPI the
multi-GB CUDA build), and one that may differ from the user's. So when the target environment
already has torch (the README installs torch==2.13.0 first), the build compiles against that one
and requires nothing more; only without it is torch==2.13.0 installed into the build environment.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403 - every hook not overridden below

KERNELS = Path(__file__).resolve().parent.parent / "src" / "tokenmill" / "kernels"
TORCH_FOR_BUILD = "torch==2.13.0"  # the release the README installs, when the target has no torch


def load_kernel_module(name: str, file: str):
    """A module of src/tokenmill/kernels by path: importing tokenmill itself would need its dependencies."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, KERNELS / file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before exec: dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def kernel_modules():
    """(isa, build) from src/tokenmill/kernels, loaded by path (build.py imports isa by this name)."""
    return load_kernel_module("tokenmill_kernels_isa", "isa.py"), load_kernel_module(
        "tokenmill_kernels_build", "build.py"
    )


def _torch_if_needed() -> list[str]:
    _, build = kernel_modules()
    return [] if build.target_torch() is not None else [TORCH_FOR_BUILD]


def get_requires_for_build_wheel(config_settings=None):
    return _setuptools.get_requires_for_build_wheel(config_settings) + _torch_if_needed()


def get_requires_for_build_editable(config_settings=None):
    return _setuptools.get_requires_for_build_editable(config_settings) + _torch_if_needed()
