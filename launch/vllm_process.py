"""The end of a vLLM engine's processes, and what vLLM's in-process mode needs on CPU: for the demos' engine and
replica processes (`kvtier.cli.demo_vllm_engine`, `kvtier.cli.demo_shared`) and the tests' engines
(`kvtier.testing.vllm_engine`).

An engine process is started with `start_new_session=True`, so that `end_process_group` ends it together with
whatever it started (vLLM's engine core), whatever state it is in.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from typing import Any


def end_process_group(proc: subprocess.Popen) -> None:
    """Kill a process started with `start_new_session=True` and everything it started (vLLM's engine core runs in
    a process of its own: killing only the child would leave it running, holding memory and CPU), then reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def guard_llvmlite_for_vllm_kernel_scan() -> bool:
    """Let vLLM's in-process mode (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) load LMCache's MP connector on CPU.

    vLLM 0.32's kernel-override scan (`vllm/triton_utils/dispatcher.py::_rebind_kernels`) walks every module's
    namespace and calls `vars(value)` on each object that answers `hasattr(value, "__dict__")`. LMCache's connector
    imports numba, and llvmlite's `ffi.lib` (a `__slots__` class whose `__getattr__` turns any name into a C-symbol
    wrapper) answers `__dict__` with such a wrapper, so the scan dies with `'_lib_fn_wrapper' object has no
    attribute 'get'` and the worker with it. Here dunder names raise AttributeError (as for any object without
    them); real symbol names are untouched. Test and demo tooling only: it changes llvmlite in this process.
    Returns whether the guard is in place (False without llvmlite)."""
    try:
        from llvmlite.binding import ffi
    except ImportError:
        return False
    cls = ffi._lib_wrapper
    original = cls.__getattr__
    if getattr(original, "_kvtier_guard", False):
        return True

    def __getattr__(self: Any, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return original(self, name)

    __getattr__._kvtier_guard = True  # type: ignore[attr-defined]
    cls.__getattr__ = __getattr__
    return True
