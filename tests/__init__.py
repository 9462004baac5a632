"""hiradix's tests, one folder a package of ``hiradix/`` (see docs/development.md)."""
