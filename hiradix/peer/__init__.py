"""The peer cache (the default L3): control-plane RPC now; ring, directory, pool, disk
and metrics join it here."""
