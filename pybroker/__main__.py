"""`python -m pybroker` runs the same command line as `pybroker`."""
from pybroker.cli import main

if __name__ == "__main__":
    main()
