"""`python -m pybroker` runs the same command line as `pybroker`."""
from pybroker.launch import main

if __name__ == "__main__":
    main()
