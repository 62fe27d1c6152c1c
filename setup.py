"""Builds the native writer ``layerckpt.io._uring``.

If the C compiler or the kernel headers are missing, the build warns and the
package installs without it; layerckpt then uses its threads backend.
"""
import sys
import warnings

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    def run(self):
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any build failure
            self._warn(exc)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            self._warn(exc)

    @staticmethod
    def _warn(exc):
        warnings.warn(
            f"layerckpt: the native writer was not built ({exc}); "
            "the pure-Python threads backend will be used",
            stacklevel=1,
        )


ext_modules = []
if sys.platform.startswith("linux"):
    ext_modules.append(
        Extension(
            "layerckpt.io._uring",
            sources=["csrc/module.c", "csrc/ring.c", "csrc/sys.c", "csrc/crc32c.c", "csrc/planes.c",
                     "csrc/qcodes.c"],
            depends=["csrc/ring.h", "csrc/sys.h", "csrc/crc32c.h", "csrc/planes.h", "csrc/qcodes.h"],
            extra_compile_args=["-O2", "-Wall", "-Werror", "-std=gnu11"],
        )
    )

setup(ext_modules=ext_modules, cmdclass={"build_ext": OptionalBuildExt})
