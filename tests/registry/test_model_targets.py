"""The registry checks the deployment's LoRA targets against its model, before any run is admitted.

A run names neither the model nor the targets (both are the deployment's), so the check runs
once: a registry told a model (``--model`` / ``PLEXRL_MODEL``, with ``--target-modules`` /
``PLEXRL_TARGET_MODULES`` when the trainer has them) whose targets include a layer the trainer's
multi-LoRA layer cannot wrap refuses to start, naming the module and its type. Only the model's
``config.json`` is read: the directories here hold nothing else.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from schemas import subjects as sj
from schemas.events import RunDiscovered, RunSubmitted
from services.bus import Bus, free_port
from services.cli import main
from services.model.families import FAMILIES, tiny_family_config
from services.registry.service import Registry
from services.registry.settings import RegistrySettings
from services.registry.validation import DeploymentError, check_model_targets, make_validator

from .conftest import RegistryFactory
from .helpers import events_on, eventually

# Qwen3-MoE's experts are one module holding fused 3-D weights: gate_up_proj there is a
# parameter, not a layer (in Phi-3 the same name is an nn.Linear).
MOE_EXPERTS = (
    r"model\.layers\.0\.mlp\.experts\.gate_up_proj is a parameter of shape \[4, 128, 64\] "
    r"inside a <class '[\w.]*Qwen3MoeExperts'>, not a layer; plexrl's LoRA wraps nn\.Linear "
    r"and Conv1D .*: remove 'gate_up_proj' from target_modules"
)


def config_only_model(path: Path, family: str) -> Path:
    """A model directory holding ``family``'s tiny ``config.json`` and no weights."""
    tiny_family_config(family).save_pretrained(str(path))
    assert [p.name for p in path.iterdir()] == ["config.json"]
    return path


@pytest.fixture
def moe_dir(tmp_path: Path) -> Path:
    return config_only_model(tmp_path / "qwen3-moe", "qwen3_moe")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_familys_default_targets_pass(tmp_path: Path, family: str) -> None:
    model = config_only_model(tmp_path / family, family)
    names = check_model_targets(model)
    # two layers; each wrapped name is one of the family's defaults
    assert names and {n.rpartition(".")[2] for n in names} <= set(_defaults(family))
    assert sum(".0." in n for n in names) == sum(".1." in n for n in names) == len(names) // 2
    assert make_validator(16, 4, model=model).check_dict({"env": "copy"}).ok


@pytest.mark.parametrize(
    ("targets", "message"),
    [
        (["q_proj", "gate_up_proj"], MOE_EXPERTS),
        (["mlp"], r"model\.layers\.0\.mlp is a <class '[\w.]*Qwen3MoeSparseMoeBlock'>; "),
        (["c_attn"], r"no nn\.Linear or Conv1D module .* matches target_modules \['c_attn'\]"),
    ],
)
def test_targets_the_trainer_cannot_wrap_are_named(
    moe_dir: Path, targets: list[str], message: str
) -> None:
    with pytest.raises(DeploymentError, match=f"model {moe_dir}: {message}") as caught:
        make_validator(16, 4, model=moe_dir, target_modules=targets)
    assert "no run could train on this deployment" in str(caught.value)


@pytest.mark.parametrize(
    ("write", "message"),
    [
        (lambda p: None, r"no model config at .*: expected a directory with config\.json"),
        (lambda p: _json(p, {"model_type": "zebra"}), "cannot read this 'zebra' config"),
        # transformers knows T5, but not as a causal LM
        (lambda p: _json(p, {"model_type": "t5"}), "cannot build a causal LM of model_type 't5'"),
    ],
)
def test_a_model_the_registry_cannot_read_is_refused(tmp_path: Path, write, message) -> None:
    model = tmp_path / "model"
    model.mkdir()
    write(model)
    with pytest.raises(DeploymentError, match=message):
        check_model_targets(model)


async def test_the_registry_refuses_to_start_in_process(
    rbus: Bus, out: Path, moe_dir: Path
) -> None:
    settings = RegistrySettings(
        output_dir=out, max_runs=2, model=moe_dir, target_modules=["q_proj", "gate_up_proj"]
    )
    with pytest.raises(DeploymentError, match=MOE_EXPERTS):
        Registry(rbus, settings)


@pytest.mark.parametrize("how", ["flags", "environment"])
def test_plexrl_registry_exits_2_before_connecting(
    tmp_path: Path,
    moe_dir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    how: str,
) -> None:
    # Nothing listens at this address: a registry that got as far as connecting exits 1.
    monkeypatch.setenv("PLEXRL_CONNECT_WAIT_S", "0")
    argv = ["registry", "--output-dir", str(tmp_path / "out")]
    argv += ["--nats-url", f"nats://127.0.0.1:{free_port()}"]
    if how == "flags":
        argv += ["--model", str(moe_dir), "--target-modules", "q_proj,gate_up_proj"]
    else:  # the variables the trainer reads, set once for the whole deployment
        monkeypatch.setenv("PLEXRL_MODEL", str(moe_dir))
        monkeypatch.setenv("PLEXRL_TARGET_MODULES", "q_proj gate_up_proj")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"plexrl registry: model {moe_dir}: ")
    assert "mlp.experts.gate_up_proj is a parameter" in err and "Qwen3MoeExperts" in err


async def test_a_registry_told_a_model_it_can_train_admits_runs(
    make_registry: RegistryFactory, rbus: Bus, moe_dir: Path
) -> None:
    # The family's default (attention only) is what the trainer wraps in a mixture of experts.
    registry = await make_registry(model=moe_dir)
    await rbus.publish(
        sj.SUBMIT, RunSubmitted(run_id="run_moe", config={"env": "copy"}), msg_id="run_moe"
    )

    async def discovered() -> list[RunDiscovered]:
        return await events_on(rbus, sj.DISCOVERED, RunDiscovered)

    [event] = await eventually(discovered)
    assert (event.run_id, event.idx) == ("run_moe", 0)
    assert registry.idx_of("run_moe") == 0


def _defaults(family: str) -> tuple[str, ...]:
    from services.model.families import default_target_modules

    return default_target_modules(FAMILIES[family].model_type)


def _json(path: Path, data: dict[str, object]) -> None:
    (path / "config.json").write_text(json.dumps(data))
