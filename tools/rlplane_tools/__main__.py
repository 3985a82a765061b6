"""``python -m rlplane_tools [COMMAND]``: the same as the ``rlplane`` script."""

from rlplane_tools.cli import main

main()
