"""``metasd`` from this checkout whether or not it is installed (``metasd_layout``): the command the device scripts
start servers with (``python benchmarks/metasd_cli.py serve ...``), as a GPU machine gets a bare copy."""
import sys

import metasd_layout  # noqa: F401  (first)
from metasd.cli import main

if __name__ == "__main__":
    sys.exit(main())
