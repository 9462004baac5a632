"""README's server flags through SGLang 0.5.23's command line (:mod:`sglang_command_line`)."""

from __future__ import annotations

import sglang_unified_env  # noqa: F401 - skips this module without SGLang 0.5.23
from sglang_command_line import (
    check_hiradix_only_names_are_refused_by_sglangs_parser,
    check_readmes_flags_pass_as_printed,
)


def test_readmes_flags_pass_as_printed() -> None:
    check_readmes_flags_pass_as_printed()


def test_hiradix_only_names_are_refused_by_sglangs_parser() -> None:
    check_hiradix_only_names_are_refused_by_sglangs_parser()
