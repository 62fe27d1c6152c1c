"""Builds the native writer ``layerckpt.io._uring``.

If the C compiler or the kernel headers are missing, the build warns and the package installs without it;
layerckpt then uses its threads backend. The reason is kept beside where the module would be
(``layerckpt/io/_uring.unbuilt``), so that the threads backend's notice and the tests can say why it is missing.

The package builds with ``-Wall`` but not ``-Werror``: a warning that a newer compiler adds must not cost a user
the native writer. ``tests/test_native_c.py`` compiles the same sources with ``-Werror``, so a warning fails
the tests instead.
"""
import os
import sys
import warnings

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

#: the flags of the package build; tests/test_native_c.py adds -Werror to them
CFLAGS = ["-O2", "-Wall", "-std=gnu11"]
UNBUILT = "_uring.unbuilt"  # read by layerckpt.io._backend.native_missing()


class OptionalBuildExt(build_ext):
    def run(self):
        self._failures, self._why = set(), {}
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any build failure
            for ext in self.extensions:
                if ext.name not in self._failures:
                    self._failed(ext, exc)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            self._failed(ext, exc)
        else:
            self._write_record(ext, None)  # an earlier failed build's reason no longer holds

    def copy_extensions_to_source(self):
        """An in-place build (an editable install) copies the modules into the source tree: a module that failed
        has none to copy, only its reason."""
        built = [e for e in self.extensions if e.name not in self._failures]
        failed = [e for e in self.extensions if e.name in self._failures]
        self.extensions = built
        try:
            super().copy_extensions_to_source()
        finally:
            self.extensions = built + failed
        for ext in failed:
            self._write_record(ext, self._why[ext.name], self._source_dir(ext))
        for ext in built:
            self._write_record(ext, None, self._source_dir(ext))

    def _source_dir(self, ext):
        build_py = self.get_finalized_command("build_py")
        return build_py.get_package_dir(".".join(ext.name.split(".")[:-1]))

    def _failed(self, ext, exc):
        why = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
        self._failures.add(ext.name)
        self._why[ext.name] = why
        warnings.warn(f"layerckpt: the native writer was not built ({why}); "
                      "the pure-Python threads backend will be used", stacklevel=1)
        self._write_record(ext, why)

    def _write_record(self, ext, why, folder=None):
        """Keeps ``why`` a build failed beside where the module would be, or removes a stale one (``why`` None)."""
        record = os.path.join(folder or os.path.dirname(self.get_ext_fullpath(ext.name)), UNBUILT)
        try:
            if why is None:
                if os.path.exists(record):
                    os.remove(record)
                return
            os.makedirs(os.path.dirname(record), exist_ok=True)
            with open(record, "w", encoding="utf-8") as f:
                f.write(why + "\n")
        except OSError:  # the warning says it all the same
            pass


ext_modules = []
if sys.platform.startswith("linux"):
    ext_modules.append(
        Extension(
            "layerckpt.io._uring",
            sources=["csrc/module.c", "csrc/ring.c", "csrc/sys.c", "csrc/crc32c.c", "csrc/planes.c",
                     "csrc/qcodes.c"],
            depends=["csrc/ring.h", "csrc/sys.h", "csrc/crc32c.h", "csrc/planes.h", "csrc/qcodes.h"],
            extra_compile_args=CFLAGS,
        )
    )

setup(ext_modules=ext_modules, cmdclass={"build_ext": OptionalBuildExt})
