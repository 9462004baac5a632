"""Backend registry and dynamic loading (SGLang's ``--hicache-storage-backend dynamic``
with ``--hicache-storage-backend-extra-config`` as a JSON string or a file)."""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from hiradix.storage import (
    MemoryStorage,
    StorageBackend,
    StorageConfig,
    StorageConfigError,
    backend_names,
    create_backend,
    load_backend_class,
    parse_extra_config,
    register_backend,
)
from hiradix.storage import registry as registry_mod

PLUGIN = textwrap.dedent(
    '''
    from hiradix.storage import MemoryStorage

    class PluginStorage(MemoryStorage):
        """A test-only third-party backend."""
        name = "plugin"

        def __init__(self, config=None, *, tag=None):
            super().__init__(config)
            self.tag = tag if tag is not None else config.extra_config.get("tag")

    class NotABackend:
        pass
    '''
)


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    (tmp_path / "hiradix_test_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "hiradix_test_plugin"
    sys.modules.pop("hiradix_test_plugin", None)


@pytest.fixture
def clean_registry() -> Iterator[None]:
    saved = dict(registry_mod._REGISTRY)
    yield
    registry_mod._REGISTRY.clear()
    registry_mod._REGISTRY.update(saved)


def test_builtins_registered() -> None:
    assert {"memory", "file", "dynamic"} <= set(backend_names())
    assert isinstance(create_backend("memory"), MemoryStorage)


def test_register_and_create(clean_registry: None) -> None:
    register_backend("mine", lambda cfg, **kw: MemoryStorage(cfg, **kw))
    b = create_backend("mine", StorageConfig(tp_rank=1, tp_size=2), capacity_bytes=10)
    assert isinstance(b, MemoryStorage) and b.capacity_bytes == 10 and b.config.tp_rank == 1
    with pytest.raises(StorageConfigError, match="already registered"):
        register_backend("mine", MemoryStorage)
    register_backend("mine", MemoryStorage, replace=True)
    with pytest.raises(StorageConfigError):
        register_backend("dynamic", MemoryStorage)
    with pytest.raises(TypeError):
        register_backend("x", 3)  # type: ignore[arg-type]
    register_backend("liar", lambda cfg: object())
    with pytest.raises(StorageConfigError, match="not a StorageBackend"):
        create_backend("liar")


def test_unknown_name() -> None:
    with pytest.raises(StorageConfigError, match=r"unknown storage backend 'nfs'.*memory"):
        create_backend("nfs")


def test_extra_config_merges_and_registers_pool() -> None:
    from tests.storage.test_contract import make_pool

    pool = make_pool("page_first", False)
    b = create_backend(
        "memory",
        StorageConfig(extra_config={"capacity_bytes": 5}),
        extra_config='{"capacity_bytes": 7}',
        mem_pool_host=pool,
    )
    assert b.capacity_bytes == 7 and b.mem_pool_host is pool  # type: ignore[attr-defined]


def test_dynamic_from_json_string(plugin: str) -> None:
    spec = json.dumps({"backend_name": "p", "module_path": plugin, "class_name": "PluginStorage", "tag": "t1"})
    b = create_backend("dynamic", StorageConfig(tp_rank=0), extra_config=spec)
    assert type(b).__name__ == "PluginStorage" and b.tag == "t1"  # type: ignore[attr-defined]
    assert dict(b.config.extra_config) == {"tag": "t1"}  # loader keys are consumed
    assert b.set("k", b"v") and b.exists("k")


@pytest.mark.parametrize("prefix", ["", "@"])
def test_dynamic_from_json_file(plugin: str, tmp_path: Path, prefix: str) -> None:
    f = tmp_path / "storage.json"
    f.write_text(json.dumps({"module_path": plugin, "class_name": "PluginStorage", "tag": "t2"}))
    b = create_backend("dynamic", extra_config=prefix + str(f))
    assert b.tag == "t2"  # type: ignore[attr-defined]
    assert load_backend_class(plugin, "PluginStorage").name == "plugin"


def test_dynamic_errors(plugin: str, tmp_path: Path) -> None:
    def dyn(**spec: object) -> StorageBackend:
        return create_backend("dynamic", extra_config=json.dumps(spec))

    with pytest.raises(StorageConfigError, match="module_path"):
        dyn(class_name="PluginStorage")
    with pytest.raises(StorageConfigError, match="class_name"):
        dyn(module_path=plugin)
    with pytest.raises(StorageConfigError, match="cannot import"):
        dyn(module_path="hiradix_no_such_module", class_name="X")
    with pytest.raises(StorageConfigError, match="has no class 'Missing'"):
        dyn(module_path=plugin, class_name="Missing")
    with pytest.raises(StorageConfigError, match="not a subclass"):
        dyn(module_path=plugin, class_name="NotABackend")
    with pytest.raises(StorageConfigError, match="not a subclass"):
        dyn(module_path="json", class_name="dumps")


def test_parse_extra_config_errors(tmp_path: Path) -> None:
    assert parse_extra_config(None) == {} and parse_extra_config({"a": 1}) == {"a": 1}
    with pytest.raises(StorageConfigError, match="not valid JSON"):
        parse_extra_config('{"a": ')
    with pytest.raises(StorageConfigError, match="JSON object"):
        parse_extra_config(str(_write(tmp_path / "list.json", "[1, 2]")))
    with pytest.raises(StorageConfigError, match="not valid JSON"):
        parse_extra_config(str(_write(tmp_path / "bad.json", "{nope")))
    with pytest.raises(StorageConfigError, match="neither a JSON object nor a readable file"):
        parse_extra_config(str(tmp_path / "missing.json"))
    with pytest.raises(StorageConfigError):
        parse_extra_config(12)  # type: ignore[arg-type]


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        StorageConfig(tp_rank=2, tp_size=2)
    with pytest.raises(ValueError):
        StorageConfig(tp_size=0)
    with pytest.raises(TypeError):
        StorageConfig(extra_config=[1])  # type: ignore[arg-type]
    cfg = StorageConfig(extra_config={"a": 1})
    with pytest.raises(TypeError):
        cfg.extra_config["a"] = 2  # type: ignore[index]
    with pytest.raises(TypeError):
        MemoryStorage(config={"a": 1})  # type: ignore[arg-type]


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path
