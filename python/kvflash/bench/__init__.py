"""kvflash.bench: the reference's tables and curves, measured on this machine.

    python -m kvflash.bench ab --preset quick          # the headline table, < 5 min on 2 cores
    python -m kvflash.bench decode --contexts 1K,8K,32K --pool 2048
    python -m kvflash.bench all --preset standard --out bench/results --plot

Routines (each usable alone): decode, memory, paging, prefill, needle, ab.  Results go to
stdout (markdown, or -o json|csv), progress to stderr.  ``main(argv)`` is the entry point
that ``kvflash bench ...`` calls.
"""
from __future__ import annotations

from .cli import PRESETS, main
from .common import BenchConfig

__all__ = ["main", "PRESETS", "BenchConfig"]
