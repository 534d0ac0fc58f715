#!/usr/bin/env python3
"""``python loadtest/bench.py ...`` is ``pybroker bench ...``: see pybroker/bench/."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pybroker.bench.cli import main

if __name__ == "__main__":
    main()
