"""Build script: the package metadata lives in pyproject.toml; this adds the cffi module.

The C codec is optional: where it cannot be compiled (no compiler, CC=false), the
install goes on and pybroker runs its pure-Python codec, saying so once at start-up.
"""
from setuptools import setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """build_ext that warns, instead of failing, when the C codec does not compile."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as e:  # the compiler's failure, whatever it is
            self.warn(f"pybroker: the C codec was not built ({e}); the pure-Python codec "
                      "will be used")

    def build_extension(self, ext: object) -> None:
        try:
            super().build_extension(ext)
        except Exception as e:
            self.warn(f"pybroker: the C codec was not built ({e}); the pure-Python codec "
                      "will be used")


setup(cffi_modules=["pybroker/_native/build.py:ffibuilder"],
      cmdclass={"build_ext": OptionalBuildExt})
