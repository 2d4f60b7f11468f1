"""`kvtier.io_engine`: what `auto`, `posix` and `kvikio` resolve to, given what kvikio says about the machine.

`auto` reads straight into GPU memory only with GPUDirect Storage; in kvikio's compat mode the host path measured
faster (docs/results/2026-12-04-first-gpu-run.md), so `auto` stays on POSIX there and says why in the log."""

from __future__ import annotations

import logging
import sys
import types

import pytest

from kvtier.storage_backends.config import ConfigError
from kvtier.storage_backends.ssd import kvikio_io


@pytest.fixture
def machine(monkeypatch):
    """Set what kvikio reports: machine(kvikio_runs, gds)."""

    def set_(kvikio_runs: bool, gds: bool) -> None:
        monkeypatch.setattr(kvikio_io, "kvikio_status",
                            lambda: (kvikio_runs, "kvikio with a CUDA driver" if kvikio_runs else "no CUDA driver"))
        monkeypatch.setattr(kvikio_io, "gds_status", lambda: (gds, "GDS" if gds else "compat mode"))
    return set_


@pytest.mark.parametrize(("kvikio_runs", "gds", "want"), [
    (False, False, "posix"),
    (True, False, "posix"),  # compat mode: the host path
    (True, True, "kvikio"),
])
def test_auto(machine, caplog, kvikio_runs, gds, want):
    machine(kvikio_runs, gds)
    with caplog.at_level(logging.INFO, logger="kvtier"):
        assert kvikio_io.select_engine("auto") == want
    assert f"io_engine=auto chose {want}" in caplog.text
    if kvikio_runs and not gds:
        assert "compat mode" in caplog.text and "io_engine: kvikio" in caplog.text


def test_explicit_choices(machine):
    machine(True, False)
    assert kvikio_io.select_engine("kvikio") == "kvikio"  # compat mode when asked for
    assert kvikio_io.select_engine("posix") == "posix"
    machine(False, False)
    with pytest.raises(ConfigError, match="kvikio was requested"):
        kvikio_io.select_engine("kvikio")


@pytest.mark.parametrize(("answer", "gds"), [(False, True), (True, False), (RuntimeError("no cuFile"), False)])
def test_gds_status_follows_kvikio(monkeypatch, answer, gds):
    defaults = types.ModuleType("kvikio.defaults")

    def preferred() -> bool:
        if isinstance(answer, Exception):
            raise answer
        return answer
    defaults.is_compat_mode_preferred = preferred  # type: ignore[attr-defined]
    pkg = types.ModuleType("kvikio")
    pkg.defaults = defaults  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvikio", pkg)
    monkeypatch.setitem(sys.modules, "kvikio.defaults", defaults)
    assert kvikio_io.gds_status()[0] is gds
