"""The documented server flags through SGLang 0.5.23's command line: the tests of
:mod:`sglang_command_line`, collected here."""

from __future__ import annotations

import sglang_unified_env  # noqa: F401 - skips this module without SGLang 0.5.23
from sglang_command_line import (  # noqa: F401 - collected here
    test_hiradix_only_names_are_refused_by_sglangs_parser,
    test_readmes_flags_pass_as_printed,
)
