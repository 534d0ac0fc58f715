"""Build script: the package metadata lives in pyproject.toml; this adds the cffi module."""
from setuptools import setup

setup(cffi_modules=["pybroker/_native/build.py:ffibuilder"])
