"""The authenticated-connection layer, shared by the directory RPC and the TCP transport.

- :mod:`~hiradix.net.auth`: the cluster-token handshake (mutual HMAC-SHA256
  challenge/response, one ``context`` per service) and :func:`~hiradix.net.auth.load_token`;
- :mod:`~hiradix.net.listener`: both ends of an authenticated TCP connection:
  :class:`~hiradix.net.listener.AuthListener` (accept, cap, authenticate, one thread per
  connection) and :func:`~hiradix.net.listener.dial` / :func:`~hiradix.net.listener.hang_up`;
- :mod:`~hiradix.net.rpc`: the msgpack control plane over it
  (:class:`~hiradix.net.rpc.RpcServer`, :class:`~hiradix.net.rpc.RpcClient`), which the peer
  cache's directory, membership and reads call.

:mod:`hiradix.transport`'s TCP and RDMA transports and :mod:`hiradix.peer` build on these
modules; nothing is imported here, so ``import hiradix.net`` stays cheap and no import
cycle runs through this package.
"""
