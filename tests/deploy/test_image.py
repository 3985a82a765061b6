"""The production image (deploy/Dockerfile) installs the service's runtime, not the tools' plotting library."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_image_installs_no_plotting_library():
    docker = (ROOT / "deploy" / "Dockerfile").read_text()
    (extras,) = re.findall(r'pip install --no-cache-dir "\.\[([a-z,]+)\]"', docker)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    installed = list(project["dependencies"])
    for extra in extras.split(","):
        installed += project["optional-dependencies"][extra]
    assert not [d for d in installed if re.match(r"(matplotlib|plotly|seaborn)\b", d)], installed
    assert any(d.startswith("matplotlib") for d in project["optional-dependencies"]["bench"])
    assert "COPY tools ./tools" in docker  # rlplane demo / bench still run in the image (without --plot)
