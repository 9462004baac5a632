"""A prefill/decode-disaggregated SGLang deployment for the real-server tests: one prefill
server and one decode server (:class:`tests.e2e.server.Server` each), and the router's
small protocol played by the test itself (:class:`PDPair`), as SGLang's own PD tests do
with a router process.

The router protocol: the same ``/generate`` body goes to the prefill and the decode server
at once, with ``bootstrap_host`` and ``bootstrap_port`` (the prefill server's bootstrap
server, ``--disaggregation-bootstrap-port``) and a fresh random ``bootstrap_room`` that
pairs the two halves of one request; the client gets the decode server's answer.

KV goes from prefill to decode over SGLang's ``mooncake_tcp`` transfer backend (mooncake's
TCP transport: ``mooncake-transfer-engine-non-cuda`` on a CPU machine), all on 127.0.0.1.
"""

from __future__ import annotations

import importlib.util
import random
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.e2e.server import REQUEST_TIMEOUT_S, Server, ServerError

#: What a PD pair needs on this machine besides SGLang's server: mooncake's transfer engine.
MOONCAKE_MISSING = (
    None
    if importlib.util.find_spec("mooncake") is not None
    else "mooncake is not installed: pip install -r requirements/mooncake.txt (mooncake-transfer-engine-non-cuda)"
)

#: Both halves: mooncake's TCP transport (SGLang sets ``MC_FORCE_TCP`` for it).
TRANSFER = ("--disaggregation-transfer-backend", "mooncake_tcp")

#: SGLang's prefill sends the device-resident part of a cached prefix early, recording a
#: ``torch.cuda.Event`` on its forward stream (``maybe_send_cached_prefix_chunk`` in
#: ``sglang/srt/disaggregation/prefill.py``), which a CPU torch cannot make: its scheduler
#: dies at the first prefix hit. SGLang's own switch turns that optimisation off; the final
#: send covers the whole prompt either way.
#: And SGLang 0.5.23's prefill stages page indices through pinned memory and a CUDA event
#: for Mooncake's sender: a harness stand-in sends it down its other path
#: (``HIRADIX_E2E_PD_ON_CPU``, ``tests/e2e/inject/sitecustomize.py``).
PREFILL_ON_CPU = {"SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX": "0", "HIRADIX_E2E_PD_ON_CPU": "1"}


class PDPair:
    """A prefill and a decode server used as one: :meth:`generate` plays the router.

    It looks like a :class:`~tests.e2e.server.Server` to the judge (``name``, ``alive``,
    ``generate``, ``args``, ``log_path``). An answer is the decode server's, with
    ``meta_info`` replaced by the prefill server's (where the prompt's cache hits are
    counted: ``cached_tokens_details``) and the decode server's kept as
    ``decode_meta_info``.
    """

    def __init__(self, prefill: Server, decode: Server, bootstrap_port: int, *, name: str = "pd") -> None:
        self.prefill = prefill
        self.decode = decode
        self.bootstrap_port = bootstrap_port
        self.name = name
        self._rooms = random.Random()  # rooms only need to differ between requests in flight

    @property
    def args(self) -> list[str]:
        return ["prefill:", *self.prefill.args, "decode:", *self.decode.args]

    @property
    def log_path(self) -> Path:
        return self.prefill.log_path

    def alive(self) -> bool:
        return self.prefill.alive() and self.decode.alive()

    def generate(self, input_ids: Sequence[int], max_new_tokens: int, **extra: Any) -> dict[str, Any]:
        """Greedy generation of exactly ``max_new_tokens`` tokens through both servers."""
        body = {
            "input_ids": list(input_ids),
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": self.bootstrap_port,
            "bootstrap_room": self._rooms.getrandbits(63),
            **extra,
        }
        prefill_answer: list[Any] = []
        prefill_error: list[BaseException] = []

        def to_prefill() -> None:
            try:
                prefill_answer.append(self.prefill.request("/generate", body))
            except BaseException as e:  # handed to the caller below
                prefill_error.append(e)

        sender = threading.Thread(target=to_prefill, name="pd-router-prefill", daemon=True)
        sender.start()
        try:
            answer = self.decode.request("/generate", body)
        finally:
            sender.join(timeout=REQUEST_TIMEOUT_S)
        if prefill_error:
            raise prefill_error[0]
        if sender.is_alive() or not prefill_answer:
            raise ServerError(f"{self.name}: the prefill server never answered\n{self.prefill.log_tail(40)}")
        if not isinstance(answer, dict) or not isinstance(prefill_answer[0], dict):
            raise ServerError(f"{self.name} /generate answered {answer!r} / {prefill_answer[0]!r}")
        out = dict(answer)
        out["decode_meta_info"] = answer.get("meta_info")
        out["meta_info"] = prefill_answer[0].get("meta_info")
        return out
