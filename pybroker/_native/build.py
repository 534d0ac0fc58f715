"""cffi builder for pybroker._native._nsqframe (out-of-line API mode).

The cdef is derived from csrc/nsqframe.h, so the header stays the single
contract: comments and preprocessor guards are stripped, and the integer
#defines (which cffi accepts) are kept. Paths are relative to this file, so
the build works from any working directory.
"""

from __future__ import annotations

import os
import re

from cffi import FFI  # type: ignore[import-untyped,unused-ignore]

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_HERE))
_CSRC = os.path.join(_ROOT, "csrc")
_HEADER = os.path.join(_CSRC, "nsqframe.h")
_SOURCE = os.path.join(_CSRC, "nsqframe.c")
_IO_SOURCE = os.path.join(_CSRC, "nsqio.c")
_IF_SOURCE = os.path.join(_CSRC, "inflight.c")

_DEFINE = re.compile(r"#define\s+(\w+)\s+(-?\d+)\s*$")


def cdef_from_header(text: str) -> str:
    """Turn the C header's text into a cffi cdef."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.DOTALL)
    text = re.sub(r"//[^\n]*", "", text)
    lines = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            match = _DEFINE.match(stripped)
            if match is None:
                continue  # include guards, #include, #endif
            lines.append(f"#define {match.group(1)} {match.group(2)}")
        elif stripped:
            lines.append(line.rstrip())
    return "\n".join(lines) + "\n"


def _relative(path: str) -> str:
    # setuptools wants sources relative to the project root when possible.
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive on Windows
        return path
    return path if rel.startswith("..") else rel


with open(_HEADER, encoding="utf-8") as _f:
    _CDEF = cdef_from_header(_f.read())

ffibuilder = FFI()
ffibuilder.cdef(_CDEF)
ffibuilder.set_source(
    "pybroker._native._nsqframe",
    '#include "nsqframe.h"\n',
    sources=[_relative(_SOURCE), _relative(_IO_SOURCE), _relative(_IF_SOURCE)],
    include_dirs=[_CSRC],
    extra_link_args=["-pthread"],     # the sender's thread (csrc/nsqio.c)
    # -Werror only where asked (CI sets PYBROKER_STRICT_CFLAGS=1): a newer compiler's
    # new warning must not break a user's install
    extra_compile_args=["-O2", "-std=c99", "-Wall", "-Wextra"]
    + (["-Werror"] if os.environ.get("PYBROKER_STRICT_CFLAGS") == "1" else []),
)

if __name__ == "__main__":
    ffibuilder.compile(tmpdir=_ROOT, verbose=True)
