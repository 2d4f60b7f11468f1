"""kvtier without LMCache (`pip install kvtier`, no `[lmcache]` extra): vLLM's offloading path, check-config and
every module outside the LMCache integration import and run; each LMCache-only entry point stops in one line that
names `kvtier[lmcache]`; kvtier's vLLM plugin entry points load cleanly.

Each check runs in a subprocess that hides LMCache (`sys.modules["lmcache"] = None`: `import lmcache` fails as if
it were not installed). In the matrix's row without LMCache (vLLM 0.34) nothing is hidden: the absence is real.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.compat

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HIDE = "import sys\nsys.modules['lmcache'] = None  # as if LMCache were not installed\n"
EXTRA = "pip install 'kvtier[lmcache]'"
#: what users name (LMCache's YAML and --l2-adapter JSON, the GPU connector): the one-line message
ENTRY_POINTS = {
    "kvtier.storage_backends.lmcache.backend": "kvtier's LMCache storage plugin",
    "kvtier.storage_backends.lmcache.gpu_connector": "kvtier's LMCache storage plugin",
    "kvtier.storage_backends.lmcache.mp_adapter": "kvtier's LMCache MP-mode L2 adapter",
    "kvtier.storage_backends.lmcache_mp_adapter": "kvtier's LMCache MP-mode L2 adapter",
}
#: internal modules of the LMCache integration, imported only through the entry points
INTERNAL = {"kvtier.storage_backends.lmcache.dense_cpu_connector", "kvtier.storage_backends.lmcache.mp_config",
            "kvtier.storage_backends.lmcache.mp_keys", "kvtier.launch.lmcache_engine",
            "kvtier.testing.engine_factory"}


def python(code: str, *args: str, cwd: str = REPO) -> subprocess.CompletedProcess:
    env = dict(os.environ, LMCACHE_TRACK_USAGE="false", VLLM_TARGET_DEVICE="cpu")
    return subprocess.run([sys.executable, "-c", HIDE + code, *args], capture_output=True, text=True, timeout=600,
                          cwd=cwd, env=env)


def test_lmcache_only_entry_points_stop_in_one_line_naming_the_extra():
    for module, component in ENTRY_POINTS.items():
        proc = python(f"import {module}")
        assert proc.returncode != 0, module
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith("kvtier.compat.extras.MissingExtra: ") and component + " needs LMCache" in last, \
            (module, proc.stderr[-1500:])
        assert EXTRA in last, last


def test_every_other_module_imports_without_lmcache():
    code = """
import importlib, json, pkgutil
import kvtier
skip = ("kvtier.tests", "kvtier.benchmarks", "kvtier.out", "kvtier.scripts", "kvtier.cli.__main__")
failed = {}
for m in pkgutil.walk_packages(kvtier.__path__, "kvtier."):
    if m.name.startswith(skip):
        continue
    try:
        importlib.import_module(m.name)
    except Exception as e:
        failed[m.name] = f"{type(e).__name__}: {e}"
print("RESULT " + json.dumps(failed))
"""
    proc = python(code)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    failed = json.loads(line[0][len("RESULT "):])
    unexpected = {m: why for m, why in failed.items() if m not in ENTRY_POINTS and m not in INTERNAL}
    assert not unexpected, f"these need LMCache but should not: {unexpected}"
    for m in ENTRY_POINTS:
        assert failed.get(m, "").startswith("MissingExtra: ") and EXTRA in failed[m], (m, failed.get(m))
    for m in INTERNAL:
        assert m in failed and "lmcache" in failed[m], (m, failed.get(m))


@pytest.mark.needs("vllm_tiering")
def test_check_config_passes_vllms_offloading_path_and_refuses_lmcache_files_in_one_line(tmp_path):
    spec = json.load(open(os.path.join(REPO, "configs", "vllm-offloading-kvtier.json")))
    spec["kv_connector_extra_config"]["secondary_tiers"][0]["ssd_path"] = str(tmp_path / "ssd")
    spec["kv_connector_extra_config"]["secondary_tiers"][0]["ssd_capacity_gb"] = 1
    offload = tmp_path / "offload.json"
    offload.write_text(json.dumps(spec))
    cli = "from kvtier.cli.main import main\nsys.exit(main(sys.argv[1:]))\n"
    proc = python(cli, "check-config", str(offload))
    assert proc.returncode == 0 and proc.stdout.startswith("OK: "), proc.stdout + proc.stderr[-2000:]
    assert "kvtier's SSD tier" in proc.stdout and "(tested)" in proc.stdout, proc.stdout
    for name in ("lmcache-kvtier.yaml", "vllm-kv-transfer.json", "lmcache-mp-l2-kvtier.json"):
        proc = python(cli, "check-config", os.path.join(REPO, "configs", name))
        errors = [x for x in proc.stderr.splitlines() if "ERROR" in x or "Traceback" in x]
        assert proc.returncode == 1 and len(errors) == 1 and EXTRA in errors[0], (name, proc.stderr[-2000:])


@pytest.mark.needs("vllm")
def test_kvtiers_vllm_plugin_entry_points_load_cleanly_without_lmcache():
    """vLLM loads `vllm.general_plugins` in every process: kvtier's must not fail there without LMCache."""
    code = """
from importlib.metadata import entry_points
eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.value.startswith("kvtier.")]
for ep in eps:
    ep.load()()
print("LOADED " + " ".join(sorted(ep.name for ep in eps)))
"""
    proc = python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LOADED kvtier_connector kvtier_host_policies" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
