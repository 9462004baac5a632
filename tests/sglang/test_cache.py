"""hiradix.sglang's cache on the installed SGLang (every SGLang venv), built as its
scheduler builds it (:func:`make_hiradix <tests.sglang.conftest.make_hiradix>`): what does
not depend on the generation's request API. Each generation's own behaviours, and the
checks whose results differ (0.5.18's matches carry the device slots, 0.5.23's the device
prefix's length), are in ``v18/test_cache.py`` and ``v23/test_cache.py``."""

from __future__ import annotations

import pytest

from tests.sglang import require_sglang

require_sglang()  # before the imports below, which need SGLang

from tests.sglang.pools import LAYERS, device_len, insert, match  # noqa: E402


def test_has_everything_sglangs_server_reads_from_a_tree_cache(make_hiradix) -> None:
    """Every attribute and method the installed SGLang's scheduler, metrics and entry
    points read from ``tree_cache`` and its ``cache_controller`` (scanned from its source;
    0.5.23's start-up read of ``cache_controller.storage_backend`` stopped every server
    before it was there), or a path hiradix's cache never takes
    (:data:`tests.sglang.contract.NOT_APPLICABLE`)."""
    from tests.sglang.contract import missing_names

    assert missing_names(make_hiradix().cache) == []


@pytest.mark.parametrize("mla", [False, True])
def test_device_buffers_are_sglangs_in_place(make_hiradix, mla: bool) -> None:
    env = make_hiradix(mla=mla)
    pool = env.cache.core.device_pool
    for layer in range(LAYERS):
        if mla:
            assert pool.kv_buffer(layer).data_ptr() == env.kv.kv_buffer[layer].data_ptr()
        else:
            assert pool.k_buffer(layer).data_ptr() == env.kv.k_buffer[layer].data_ptr()
            assert pool.v_buffer(layer).data_ptr() == env.kv.v_buffer[layer].data_ptr()


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"layout": "page_last"}, "hicache-mem-layout"),
        ({"write_policy": "write_sometimes"}, "write-policy"),
        ({"storage": "nosuch"}, "hicache-storage-backend"),
        ({"storage": "memory", "extra_config": '{"prefetch_threshold": "many"}'}, "prefetch_threshold"),
    ],
)
def test_unsupported_options_are_startup_errors_naming_the_option(make_hiradix, kwargs, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        make_hiradix(**kwargs)


def test_page_alignment_truncates_keys(make_hiradix) -> None:
    env = make_hiradix(4)
    assert insert(env, list(range(10))) == 0  # 8 tokens go in
    assert env.cache.total_size() == 8
    assert device_len(match(env, list(range(10)))) == 8
    assert device_len(match(env, list(range(3)))) == 0
    env.cache.check_invariants()


def test_limit_caps_the_match(make_hiradix) -> None:
    env = make_hiradix(1)
    insert(env, list(range(20)))
    assert device_len(match(env, list(range(20)), limit=7)) == 7
