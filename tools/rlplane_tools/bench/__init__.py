"""``rlplane bench``: how fast a batch moves writer -> reader through rlplane and the alternatives.

- :mod:`.run`: the transfer bench (every path, workload, sweep; the embedded service when no URL)
- :mod:`.paths`: the paths compared, one small class each (add a backend here)
- :mod:`.workers`: the writer / reader processes (Ray actors)
- :mod:`.targets`, :mod:`.report`, :mod:`.plot`: verdicts, tables and JSON, the PNG
- :mod:`.codec`: encode -> in-memory transport -> decode, no service (``--codec``)

Example::

    python -m rlplane_tools.bench --quick --json out/bench.json --plot out/bench.png
"""
