"""``python -m pybroker.tools <tail|to-file|pub|stat> ...``: the tools without the server."""
from pybroker.tools import make_app

if __name__ == "__main__":
    make_app()(prog_name="pybroker")
