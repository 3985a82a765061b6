"""``python -m rlplane_tools.bench [OPTIONS]``: the same as ``rlplane bench [OPTIONS]``."""

import sys

from rlplane_tools.cli import app

app(["bench", *sys.argv[1:]], prog_name="python -m rlplane_tools.bench")
