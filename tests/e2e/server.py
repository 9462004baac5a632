"""A real ``python -m sglang.launch_server`` as a test fixture: started as a subprocess on
127.0.0.1, waited for on ``/health`` with a deadline, stopped by its process group, its
log shown when a test fails.

The server runs on this machine's CPU (SGLang's CPU engine with its torch-native attention
and sampling), from a folder that is not the checkout root (the checkout's ``hiradix/``
would shadow the installed package there), with ``tests/e2e/stubs`` (a CPU
``sgl_kernel``) and ``tests/e2e/inject`` (fault injection, off unless asked) on its
``PYTHONPATH``. HTTP goes through ``urllib``: no client library between the test and the
server.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.support import subprocess_env

HERE = Path(__file__).resolve().parent

#: What gets SGLang's server running on a CPU (verified on 0.5.18, 0.5.20 and 0.5.23).
CPU_ARGS = (
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--sampling-backend",
    "pytorch",
    "--disable-cuda-graph",
    "--skip-server-warmup",
    "--dtype",
    "float32",
    # An idle scheduler otherwise polls at 100% of a core (and its detokenizer at 40%).
    "--sleep-on-idle",
)
START_TIMEOUT_S = 240.0  # about 40 s on 2 idle cores; more beside another suite
REQUEST_TIMEOUT_S = 120.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sglang_version() -> str:
    """The installed SGLang's version (``"0.5.18"``, ...)."""
    from importlib.metadata import version

    return version("sglang").split("+")[0]


def only_on(versions: tuple[str, ...], why: str) -> None:
    """Skip the calling test unless the installed SGLang is one of ``versions``: checks
    whose hiradix code path does not depend on the version run on fewer versions, to keep
    CI's real-server minutes down (a server takes 20-40 s to start here)."""
    v = sglang_version()
    if v not in versions:
        pytest.skip(f"runs on SGLang {', '.join(versions)} only ({v} installed): {why}")


def only_on_mark(versions: tuple[str, ...], why: str) -> pytest.MarkDecorator:
    """:func:`only_on` as a mark, decided at collection: for a module whose servers are
    module-scoped fixtures, which would otherwise start before the test body skips."""
    from importlib.metadata import PackageNotFoundError

    try:
        v = sglang_version()
    except PackageNotFoundError:  # no SGLang: conftest.py skips the whole suite, saying why
        return pytest.mark.skipif(False, reason="")
    why = f"runs on SGLang {', '.join(versions)} only ({v} installed): {why}"
    return pytest.mark.skipif(v not in versions, reason=why)


#: Why a case runs on 0.5.18 and 0.5.23 but not 0.5.20 (CI's real-server minutes): what it
#: drives through the adapter exists on those two, and 0.5.20 is made of their parts.
NOT_ON_020 = only_on_mark(
    ("0.5.18", "0.5.23"),
    "SGLang 0.5.20's adapter is 0.5.18's request calls (hiradix/sglang/cache_req.py) with 0.5.23's server "
    "arguments (options.py), both run in full there; 0.5.20 keeps the outputs, L3, metrics and pressure cases",
)


class ServerError(RuntimeError):
    """The server died, did not come up in time, or answered an error."""


class PortTaken(ServerError):
    """Another process had the server's port first."""


class Server:
    """One SGLang server process. ``args`` are the server's own options after the model
    and the CPU options; ``env`` adds to the environment. Use as a context manager or call
    :meth:`start` and :meth:`stop`."""

    def __init__(
        self,
        model: Path,
        args: Sequence[str],
        workdir: Path,
        *,
        env: dict[str, str] | None = None,
        name: str = "server",
    ) -> None:
        self.model = Path(model)
        self.args = [str(a) for a in args]
        self.workdir = Path(workdir)
        self.extra_env = dict(env or {})
        self.name = name
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.workdir / f"{name}.log"
        # SGLang's admin endpoints (runtime L3 attach and detach) need the admin key.
        self.admin_key = self.args[self.args.index("--admin-api-key") + 1] if "--admin-api-key" in self.args else None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(self.model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *CPU_ARGS,
            *self.args,
        ]

    def start(self) -> Server:
        """Start the server and wait until it answers. A port taken meanwhile (another
        process may take it between :func:`free_port` and the server's bind, tens of
        seconds later) means another try on a fresh port, up to three."""
        for attempt in range(3):
            try:
                return self._start_once()
            except PortTaken:
                self.stop()
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _start_once(self) -> Server:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        env = subprocess_env(HERE / "stubs", HERE / "inject", repo=False)  # the installed hiradix
        env.update(
            {
                "SGLANG_USE_CPU_ENGINE": "1",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "PYTHONUNBUFFERED": "1",
            }
        )
        env.update(self.extra_env)
        log = open(self.log_path, "wb")  # noqa: SIM115 - the child writes it until stop()
        try:
            self.proc = subprocess.Popen(
                self.command(), cwd=self.workdir, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        finally:
            log.close()
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                if "address already in use" in self.log_text().lower():
                    raise PortTaken(f"{self.name}: port {self.port} was taken before the server bound it")
                raise ServerError(f"{self.name} exited with {self.proc.returncode} at start-up:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        self._check_it_is_ours()
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            # Polling a process that is starting, not ordering events: nothing to wait on.
            time.sleep(0.5)
        self.stop()
        raise ServerError(f"{self.name} did not answer /health in {START_TIMEOUT_S:.0f} s:\n{self.log_tail()}")

    def _check_it_is_ours(self) -> None:
        """The server answering on the port serves this server's model (each test session
        builds its model in a folder of its own), not another process's server that took
        the port first."""
        with urllib.request.urlopen(self.url + "/get_server_info", timeout=30) as r:
            info = json.loads(r.read())
        if Path(str(info.get("model_path"))) != self.model:
            raise PortTaken(f"{self.name}: port {self.port} answers for {info.get('model_path')!r}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 80) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def kill9(self) -> None:
        """``kill -9`` of the whole server (every process of its group), at once."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        """End the server: SIGKILL to its whole process group. A test server holds nothing
        to save, and SGLang answers SIGTERM with a 5 s pause for crash diagnostics."""
        self.kill9()
        self._reap_group()

    def _reap_group(self) -> None:
        # Children (the scheduler, the detokenizer) may outlive the launcher: end them too.
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ HTTP
    def request(
        self, path: str, body: Any = None, *, method: str | None = None, timeout: float = REQUEST_TIMEOUT_S
    ) -> Any:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.admin_key:
            headers["Authorization"] = f"Bearer {self.admin_key}"
        req = urllib.request.Request(
            self.url + path, data=data, method=method or ("POST" if data else "GET"), headers=headers
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            raise ServerError(f"{self.name} {path}: HTTP {e.code}: {e.read()[:2000]!r}") from e
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            raise ServerError(f"{self.name} {path}: {e}\n{self.log_tail(40)}") from e
        try:
            return json.loads(raw)
        except ValueError:
            return raw.decode(errors="replace")

    def generate(self, input_ids: Sequence[int], max_new_tokens: int, **extra: Any) -> dict[str, Any]:
        """Greedy generation of exactly ``max_new_tokens`` tokens (EOS ignored) for token ids."""
        body = {
            "input_ids": list(input_ids),
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
            **extra,
        }
        out = self.request("/generate", body)
        if not isinstance(out, dict):
            raise ServerError(f"{self.name} /generate answered {out!r}")
        return out

    def _when_idle(self, path: str, body: Any = None, *, method: str | None = None, timeout: float = 60.0) -> Any:
        """An admin request, repeated until it succeeds: SGLang refuses (HTTP 400) while
        its scheduler still holds a request, which it may for a moment after the answer
        was sent."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.request(path, body, method=method)
            except ServerError:
                if time.monotonic() > deadline:
                    raise
            # Polling the server's state: no event of its to wait on from here.
            time.sleep(0.2)

    def wait_log(self, text: str, count: int, timeout: float = 60.0) -> None:
        """Until ``text`` appears ``count`` times in the server's log, a :class:`ServerError`
        after ``timeout`` seconds or if the server dies."""
        deadline = time.monotonic() + timeout
        while self.log_text().count(text) < count:
            if not self.alive() or time.monotonic() > deadline:
                raise ServerError(f"{self.name}: {text!r} not seen {count} times in its log\n{self.log_tail(40)}")
            # Polling the log the server writes: no event of its to wait on from here.
            time.sleep(0.05)

    def flush_cache(self, timeout: float = 60.0) -> None:
        """``POST /flush_cache`` (once the scheduler is idle)."""
        self._when_idle("/flush_cache", {}, timeout=timeout)

    def attach_storage(self, backend: str, extra_config: dict[str, Any] | None = None, **options: str) -> str:
        """Attach an L3 at runtime through SGLang's admin endpoint (``PUT
        /hicache/storage-backend``, once the scheduler is idle; the server needs
        ``--admin-api-key``); its answer. A refusal for another reason raises
        :class:`ServerError` after the retries."""
        body = {"hicache_storage_backend": backend, **options}
        if extra_config is not None:
            body["hicache_storage_backend_extra_config_json"] = json.dumps(extra_config)
        return str(self._when_idle("/hicache/storage-backend", body, method="PUT"))

    def detach_storage(self) -> str:
        """Detach the L3 through SGLang's admin endpoint (``DELETE /hicache/storage-backend``)."""
        return str(self._when_idle("/hicache/storage-backend", method="DELETE"))

    def metric(self, name: str) -> float:
        """The sum of ``name``'s samples in ``/metrics`` (over its labels); 0 if absent."""
        total = 0.0
        for line in self.metrics().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def metrics(self) -> str:
        req = urllib.request.Request(self.url + "/metrics")
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.read().decode()
