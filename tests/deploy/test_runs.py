"""deploy/runs/*.toml: the demo runs' configs, valid against the run config schema."""

from __future__ import annotations

from schemas.config import load_orch_config
from services.registry.settings import RegistrySettings

from .contract import RUNS


def test_demo_run_configs_load_and_name_their_environment() -> None:
    paths = sorted(RUNS.glob("*.toml"))
    assert [p.stem for p in paths] == ["add", "copy", "reverse"]
    seeds = set()
    for path in paths:
        config = load_orch_config(path)
        assert config.env == path.stem
        assert config.max_steps == 40
        assert config.batch_size == 8 and config.group_size == 8
        assert config.max_async_level == 1
        assert config.model.lora.rank == 8
        assert config.optim.lr == 2e-3
        seeds.add(config.seed)
    assert len(seeds) == len(paths)  # every run draws its own prompts


def test_demo_run_configs_pass_the_registry_limits() -> None:
    limits = RegistrySettings()
    for path in RUNS.glob("*.toml"):
        config = load_orch_config(path)
        assert config.model.lora.rank <= 16  # PLEXRL_MAX_LORA_RANK in local.yml and env.yaml
        assert config.model.lora.rank <= limits.max_lora_rank
        assert config.max_async_level <= limits.max_async_level
