"""Fault injection for the real-server tests: a slow host -> device load.

``tests/e2e`` puts this folder on a server's ``PYTHONPATH`` so that Python imports this
module at the start of every process of that server (the scheduler included). With
``HIRADIX_E2E_SLOW_LOAD_S`` set, each layer of every load that hiradix's copy engine runs
takes that many seconds longer, as a loaded host or a slow PCIe link would make it. A
forward pass that does not wait for the layer-done counter then reads KV before it lands,
every time rather than now and then: the race the load-back tests must catch. Unset, this
module does nothing.
"""

from __future__ import annotations

import os

_DELAY = float(os.environ.get("HIRADIX_E2E_SLOW_LOAD_S", "0") or 0)

if _DELAY > 0:
    import threading
    from typing import Any

    from hiradix.memory import copy as _copy

    _execute = _copy.ThreadCopyEngine._execute
    _never = threading.Event()  # never set: waiting on it is a bounded stall of _DELAY seconds

    def _slow_execute(self: Any, handle: Any, step: Any) -> None:
        if handle.kind == "load":
            inner = step

            def step(layer: int) -> None:
                _never.wait(_DELAY)
                inner(layer)

        _execute(self, handle, step)

    _copy.ThreadCopyEngine._execute = _slow_execute  # type: ignore[method-assign]
