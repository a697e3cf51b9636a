"""Where the installed C library, its header and package files are.

The wheel ships ``libkvflash`` (the one copy of the core and of ggml that the
Python module itself links) with ``kvflash.h``, a CMake package and a pkg-config
file, so C and C++ applications can link the library this package installed::

    cmake -Dkvflash_DIR="$(python -m kvflash --cmake-dir)" ...      # find_package(kvflash CONFIG)
    PKG_CONFIG_PATH="$(python -m kvflash --pkgconfig-dir)" pkg-config --cflags --libs kvflash
"""
from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent


def include_dir() -> Path:
    """The directory holding kvflash.h."""
    return _HERE / "include"


def lib_dir() -> Path:
    """The directory holding libkvflash.so."""
    return _HERE / "lib"


def library_path() -> Path:
    """libkvflash.so itself (e.g. for ctypes)."""
    return lib_dir() / "libkvflash.so"


def cmake_dir() -> Path:
    """The directory with kvflashConfig.cmake (pass it as -Dkvflash_DIR=...)."""
    return lib_dir() / "cmake" / "kvflash"


def pkgconfig_dir() -> Path:
    """The directory with kvflash.pc (add it to PKG_CONFIG_PATH)."""
    return lib_dir() / "pkgconfig"


def check_installed() -> None:
    """Raise FileNotFoundError naming what is missing from this install."""
    missing = [p for p in (library_path(), include_dir() / "kvflash.h", cmake_dir() / "kvflashConfig.cmake",
                           pkgconfig_dir() / "kvflash.pc") if not p.exists()]
    if missing:
        raise FileNotFoundError("this kvflash install lacks its C library files: " + ", ".join(map(str, missing)) +
                                " (reinstall kvflash from a wheel or `pip install .`)")
