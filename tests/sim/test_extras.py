"""The simulator's optional dependencies (hiradix/sim/extras.py): the package and the
simulator's modules import without tqdm and matplotlib; using a bar or a plot without
them is an ImportError that says what to install."""

from __future__ import annotations

import subprocess
import sys

from tests.support import REPO

SCRIPT = """
import sys
sys.modules["tqdm"] = None  # as if not installed: importing it raises ImportError
sys.modules["matplotlib"] = None
import hiradix.cli, hiradix.sim.run, hiradix.sim.sweep, hiradix.sim.curve, hiradix.sim.report
from hiradix.sim.extras import figure, progress_bar
for make in (progress_bar, figure):
    try:
        make()
    except ImportError as exc:
        print(exc)
"""


def test_without_the_extra_the_simulator_imports_and_says_what_to_install() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=300, check=True
    ).stdout.splitlines()
    assert out == [
        "the simulator's progress bars need tqdm, which is not installed: pip install 'hiradix[sim]'",
        "the simulator's plots need matplotlib, which is not installed: pip install 'hiradix[sim]'",
    ], out


def test_with_the_extra_they_are_tqdm_and_matplotlib() -> None:
    from matplotlib.figure import Figure
    from tqdm import tqdm

    from hiradix.sim.extras import figure, progress_bar

    with progress_bar(total=1, disable=True) as bar:
        assert isinstance(bar, tqdm)
    assert isinstance(figure(figsize=(1, 1)), Figure)
