"""Builds tokenmill's C++ CPU kernels into the package: one extension module per x86 ISA level,
tokenmill/kernels/_C_<level>.so (src/tokenmill/kernels/build.py says how), so that a wheel built
on one machine runs at full speed on any other and nothing compiles when the server starts.

Everything else about the package is in pyproject.toml. Settings (environment):
  TOKENMILL_KERNEL_LEVELS=avx2,amx   build only these levels (default: every level; a machine
                                     whose level is missing compiles it on first use)
  TOKENMILL_SKIP_KERNEL_BUILD=1      build none (they compile on first use)
  MAX_JOBS=N                         compile N units at a time (default: the machine's cores)
  CXX=...                            the compiler (default c++)
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).parent.resolve()
sys.path.insert(0, str(HERE / "build_backend"))
from tokenmill_backend import KERNELS, kernel_modules  # noqa: E402 - the path just above

isa, kernel_build = kernel_modules()
envs = isa.envs  # src/tokenmill/envs.py, loaded by path with isa
SKIP = envs.TOKENMILL_SKIP_KERNEL_BUILD
LEVELS = envs.TOKENMILL_KERNEL_LEVELS or isa.level_names()
for _name in LEVELS:
    isa.level(_name)  # an unknown name fails here, naming the choices


def _progress(line: str) -> None:
    """One line per compiled unit. pip shows a build's output only with -v, so the lines also go to
    the terminal pip runs in, when there is one."""
    print(line, flush=True)
    if not sys.stdout.isatty():
        try:
            with open("/dev/tty", "w") as tty:
                tty.write(f"tokenmill: {line}\n")
        except OSError:
            pass


class BuildKernels(build_ext):
    def build_extensions(self) -> None:
        out = self._kernels_out = Path(self.get_ext_fullpath(self.extensions[0].name)).parent
        kernel_build.build(
            out, LEVELS, work=HERE / "build" / "tokenmill-kernels", jobs=self.parallel or None, log=_progress
        )

    def copy_extensions_to_source(self) -> None:  # editable installs: the build's record goes along
        super().copy_extensions_to_source()
        built = getattr(self, "_kernels_out", None)
        if built is not None and (built / kernel_build.BUILD_INFO).exists():
            built = built / kernel_build.BUILD_INFO
            shutil.copyfile(built, KERNELS / kernel_build.BUILD_INFO)


setup(
    ext_modules=[] if SKIP else [Extension(f"tokenmill.kernels._C_{name}", sources=[]) for name in LEVELS],
    cmdclass={"build_ext": BuildKernels},
)
