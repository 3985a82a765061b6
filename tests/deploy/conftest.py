"""tests/deploy: the Serve config, the Helm chart, the dashboard and the alert rules,
checked offline (no cluster, no Ray started)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Check this checkout's service code, whichever checkout the venv was installed from.
for sub in ("service", "client"):
    if str(ROOT / sub) not in sys.path:
        sys.path.insert(0, str(ROOT / sub))

# promql.py (the metric-name helpers) imports as `promql`, here and from a live test.
sys.path.insert(0, str(Path(__file__).resolve().parent))
