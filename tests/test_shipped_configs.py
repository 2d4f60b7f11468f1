"""Every file in `configs/` passes `kvtier check-config`, and each names a module path and class that import
(the paths users put in their configs keep working whatever the package's layout: re-exports)."""

from __future__ import annotations

import importlib
import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

REPO = Path(__file__).resolve().parent.parent
SHIPPED = sorted(p.name for p in (REPO / "configs").iterdir() if p.suffix in (".yaml", ".json"))


@pytest.fixture
def configs(tmp_path, monkeypatch):
    """A copy of `configs/` whose SSD paths point into tmp_path (vLLM JSONs name the YAML relative to the cwd)."""
    out = tmp_path / "configs"
    shutil.copytree(REPO / "configs", out)
    for p in out.iterdir():
        if p.suffix in (".yaml", ".json"):
            p.write_text(p.read_text().replace("/var/cache/kvtier", str(tmp_path / "ssd")))
    monkeypatch.chdir(tmp_path)
    return out


def test_every_kind_of_config_is_shipped():
    assert {"lmcache-kvtier.yaml", "lmcache-mp-l2-kvtier.json", "vllm-kv-transfer.json",
            "vllm-offloading-kvtier.json"} <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_config_passes_check_config(configs, name):
    from kvtier.cli.check_config import check

    assert check(str(configs / name)).startswith("OK: ")


def _named_classes(text: str, suffix: str) -> list[tuple[str, str]]:
    """(module path, class name) pairs a shipped config asks its loader to import."""
    if suffix == ".yaml":
        extra = yaml.safe_load(text).get("extra_config") or {}
        return [(extra[k], extra[k.replace(".module_path", ".class_name")]) for k in extra
                if k.startswith("storage_plugin.") and k.endswith(".module_path")]
    spec = json.loads(text)
    if spec.get("kv_connector") == "OffloadingConnector":
        extra = spec["kv_connector_extra_config"]
        named = [(t["module_path"], t["type"]) for t in extra.get("secondary_tiers", []) if "module_path" in t]
        if "cache_policy_module_path" in extra:
            named.append((extra["cache_policy_module_path"], extra["eviction_policy"]))
        return named
    if "kv_connector" in spec:
        return [(spec["kv_connector_module_path"], spec["kv_connector"])]
    return [(spec["module_path"], spec["class_name"])] if spec.get("type") == "plugin" else []


@pytest.mark.parametrize("name", SHIPPED)
def test_module_paths_named_in_shipped_configs_import(name):
    path = REPO / "configs" / name
    for module, cls in _named_classes(path.read_text(), path.suffix):
        assert isinstance(getattr(importlib.import_module(module), cls), type), f"{name}: {module}.{cls}"
