"""``bench/long_context.py --quick`` on SGLang 0.5.18: the test of
:mod:`sglang_bench_long_context`, collected here."""

from __future__ import annotations

import sglang_env  # noqa: F401 - skips this module without a supported SGLang
from sglang_bench_long_context import test_long_context_quick_run_checks_every_scenario_and_cache  # noqa: F401
