"""Cluster-token authentication: a mutual HMAC-SHA256 challenge/response on every connection.

Both ends hold the same secret cluster token. On connect:

1. the server sends ``MAGIC || server_nonce`` (32 random bytes);
2. the client answers ``client_nonce || HMAC(token, "client" || context || server_nonce || client_nonce)``;
3. the server checks the tag in constant time and, if it matches, answers
   ``HMAC(token, "server" || context || client_nonce || server_nonce)``; otherwise it closes;
4. the client checks that tag in constant time.

Fresh nonces on both sides stop replay, the role labels stop reflection, and ``context``
(``b"transport"``, ``b"rpc"``) stops a proof for one service from opening another. The
token never crosses the wire. Nothing here encrypts the stream: the token keeps strangers
out, loopback / a private network keeps the bytes private.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import time

from hiradix import envvars

__all__ = ["TOKEN_ENV", "AuthError", "HandshakeTimeout", "client_handshake", "load_token", "server_handshake"]

#: Environment variable read by :func:`load_token` when no token is passed.
TOKEN_ENV = "HIRADIX_CLUSTER_TOKEN"

_MAGIC = b"HRDXAUTH1"
_NONCE = 32
_TAG = 32
_MIN_TOKEN = 16


class AuthError(ConnectionError):
    """The peer did not prove it holds the cluster token (or the handshake broke)."""


class HandshakeTimeout(AuthError, TimeoutError):
    """The peer stayed silent through the handshake."""


def load_token(token: bytes | str | None = None) -> bytes:
    """The cluster token as bytes: ``token`` if given, else ``$HIRADIX_CLUSTER_TOKEN``.

    Raises ``ValueError`` when there is none or it is shorter than 16 bytes.

    >>> load_token("0123456789abcdef") == b"0123456789abcdef"
    True
    """
    if token is None:
        token = envvars.text(TOKEN_ENV)
        if not token:
            raise ValueError(f"no cluster token: pass token=... or set ${TOKEN_ENV}")
    if isinstance(token, str):
        token = token.encode()
    if not isinstance(token, bytes):
        raise TypeError(f"token must be bytes or str, got {type(token).__name__}")
    if len(token) < _MIN_TOKEN:
        raise ValueError(f"cluster token must be at least {_MIN_TOKEN} bytes, got {len(token)}")
    return token


def _tag(token: bytes, role: bytes, context: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(token, b"%s\x00%s\x00%s%s" % (role, context, a, b), hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise HandshakeTimeout("handshake timed out")
        sock.settimeout(remaining)
        try:
            k = sock.recv_into(view[got:])
        except TimeoutError:
            raise HandshakeTimeout("handshake timed out") from None
        if k == 0:
            raise AuthError("peer closed the connection during the handshake")
        got += k
    return bytes(buf)


def _send(sock: socket.socket, data: bytes, deadline: float) -> None:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise HandshakeTimeout("handshake timed out")
    sock.settimeout(remaining)
    try:
        sock.sendall(data)
    except TimeoutError:
        raise HandshakeTimeout("handshake timed out") from None


def server_handshake(sock: socket.socket, token: bytes, context: bytes, timeout: float) -> None:
    """Challenge the client on ``sock``; return if it proved the token, else raise
    :class:`AuthError` (the caller closes the socket). Leaves a timeout set on ``sock``."""
    deadline = time.monotonic() + timeout
    server_nonce = secrets.token_bytes(_NONCE)
    _send(sock, _MAGIC + server_nonce, deadline)
    reply = _recv_exact(sock, _NONCE + _TAG, deadline)
    client_nonce, tag = reply[:_NONCE], reply[_NONCE:]
    if not hmac.compare_digest(tag, _tag(token, b"client", context, server_nonce, client_nonce)):
        raise AuthError("client failed the cluster-token challenge")
    _send(sock, _tag(token, b"server", context, client_nonce, server_nonce), deadline)


def client_handshake(sock: socket.socket, token: bytes, context: bytes, timeout: float) -> None:
    """Answer the server's challenge on ``sock`` and check the server's proof; raise
    :class:`AuthError` on any mismatch. Leaves a timeout set on ``sock``."""
    deadline = time.monotonic() + timeout
    hello = _recv_exact(sock, len(_MAGIC) + _NONCE, deadline)
    if hello[: len(_MAGIC)] != _MAGIC:
        raise AuthError("peer does not speak the hiradix handshake")
    server_nonce = hello[len(_MAGIC) :]
    client_nonce = secrets.token_bytes(_NONCE)
    _send(sock, client_nonce + _tag(token, b"client", context, server_nonce, client_nonce), deadline)
    try:
        proof = _recv_exact(sock, _TAG, deadline)
    except HandshakeTimeout:
        raise
    except AuthError as e:
        raise AuthError(f"server refused the cluster token ({e})") from None
    if not hmac.compare_digest(proof, _tag(token, b"server", context, client_nonce, server_nonce)):
        raise AuthError("server failed to prove the cluster token")
