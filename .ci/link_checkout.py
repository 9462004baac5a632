"""Put the checkout on a venv's path as an installed distribution, without building it again.

For the SGLang 0.5.20 and 0.5.23 venvs of .ci/run: the main venv's editable install has
already compiled the extensions in place, and a second editable install would compile them
all again (about a minute and a half here). This writes what that install would write for
Python and SGLang to see: a path entry for the checkout, and a ``hiradix`` dist-info with
the version and the entry points of ``pyproject.toml`` (SGLang finds its plugins there, so
``--radix-cache-backend hiradix`` works in a real server started from that venv). Run it with
the venv's own Python: ``.venv-X/bin/python .ci/link_checkout.py``.
"""

from __future__ import annotations

import site
import sys
from pathlib import Path

import tomllib

root = Path(__file__).resolve().parent.parent
project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
packages = Path(site.getsitepackages()[0])
(packages / "hiradix-checkout.pth").write_text(f"{root}\n")
info = packages / f"hiradix-{project['version']}.dist-info"
info.mkdir(exist_ok=True)
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: hiradix\nVersion: {project['version']}\n")
groups = dict(project.get("entry-points", {}))
if "scripts" in project:
    groups["console_scripts"] = project["scripts"]
(info / "entry_points.txt").write_text(
    "".join(
        f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in eps.items()) + "\n"
        for group, eps in groups.items()
    )
)
(info / "INSTALLER").write_text("hiradix .ci/link_checkout.py\n")
(info / "RECORD").write_text("")
print(f"{sys.prefix}: hiradix {project['version']} from {root}")
