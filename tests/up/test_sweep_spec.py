"""A sweep spec expands into validated run configs with readable, legal, distinct run ids; every
mistake is refused, naming what was wrong, before anything starts."""

from __future__ import annotations

import tomllib

import pytest

from schemas.config import ConfigError
from schemas.run_id import in_sweep, is_valid_run_id
from services.config import SettingsError, load_settings
from services.up.settings import UpSettings
from services.up.sweep import SweepSpec, distinct_ids, expand, id_token, shorten

GRID = """
steps = 12
max_runs = 2
[sweep]
"optim.lr" = [1e-3, 2e-3]
seed = [0, 1]
"""


def settings(text: str) -> UpSettings:
    return UpSettings.model_validate(tomllib.loads(text))


def test_a_grid_is_the_cartesian_product_with_readable_ids() -> None:
    runs = settings(GRID).planned_runs()
    assert [r.run_id for r in runs] == [
        "run_reverse-lr1e-3-s0",
        "run_reverse-lr1e-3-s1",
        "run_reverse-lr2e-3-s0",
        "run_reverse-lr2e-3-s1",
    ]
    assert [(r.config.optim.lr, r.config.seed) for r in runs] == [
        (1e-3, 0),
        (1e-3, 1),
        (2e-3, 0),
        (2e-3, 1),
    ]
    assert runs[3].values == {"optim.lr": 2e-3, "seed": 1}
    # the rest of the config is the `plexrl up` base: steps, [run] tables, tuned defaults
    assert {r.config.max_steps for r in runs} == {12}
    assert {r.config.model.lora.rank for r in runs} == {8}


def test_a_sweep_may_exceed_max_runs_and_its_runs_wait() -> None:
    s = settings(GRID)
    assert len(s.planned_runs()) == 4
    assert s.slots == 2  # the registry queues the other two
    assert settings("runs = 3\nmax_runs = 2").slots == 3  # demo runs all start at once


def test_variants_apply_on_top_of_each_grid_point_and_only_varied_keys_name_runs() -> None:
    s = settings(
        """
        [sweep]
        name = "kl"
        env = ["copy"]
        variants = [{"loss.kl_coef" = 0.0}, {"loss.kl_coef" = 0.1, "model.lora.rank" = 4}]
        """
    )
    runs = s.planned_runs()
    assert [r.run_id for r in runs] == ["run_kl-kl0p0-r8", "run_kl-kl0p1-r4"]
    assert [(r.config.env, r.config.loss.kl_coef, r.config.model.lora.rank) for r in runs] == [
        ("copy", 0.0, 8),
        ("copy", 0.1, 4),
    ]


def test_max_async_level_and_env_can_be_swept_over_the_pinned_values() -> None:
    runs = settings('[sweep]\nmax_async_level = [0, 2]\nenv = ["reverse", "add"]').planned_runs()
    assert [r.run_id for r in runs] == [
        "run_reverse-async0-reverse",
        "run_reverse-async0-add",
        "run_reverse-async2-reverse",
        "run_reverse-async2-add",
    ]
    assert [(r.config.max_async_level, r.config.env) for r in runs][-1] == (2, "add")


def test_value_tokens_are_legal_run_id_characters() -> None:
    assert id_token(0.002) == "2e-3"
    assert id_token(1.5e-4) == "1p5e-4"
    assert id_token(0.5) == "0p5"
    assert id_token(3) == "3"
    assert id_token(True) == "on"
    assert id_token("pkg.mod:factory") == "pkg_mod_factory"


def test_long_ids_are_cut_and_ended_with_a_digest() -> None:
    body = "x" * 80
    a, b = shorten(body, "sha256:a"), shorten(body, "sha256:b")
    assert len(a) == 64 and a != b and a.startswith("x" * 55 + "-")
    runs = settings(
        '[sweep]\nname = "n' + "a" * 31 + '"\n"optim.lr" = [0.00123456, 0.00123457]\n'
        '"sampling.temperature" = [0.75, 0.8125]\n"loss.clip_high" = [0.25, 0.3125]'
    ).planned_runs()
    ids = [r.run_id for r in runs]
    assert all(is_valid_run_id(i) for i in ids) and len(set(ids)) == 8
    assert all(in_sweep(i, "n" + "a" * 31) for i in ids)


def test_a_bad_key_or_value_is_named() -> None:
    with pytest.raises(ConfigError, match=r"optim.lrr = 0.001.*optim.lrr: unknown key"):
        settings('[sweep]\n"optim.lrr" = [1e-3]').planned_runs()
    with pytest.raises(ConfigError, match=r"optim.lr = 5.0.*optim.lr: Input should be less"):
        settings('[sweep]\n"optim.lr" = [1e-3, 5.0]').planned_runs()


def test_identical_configs_are_refused() -> None:
    with pytest.raises(ConfigError, match="give the same run config"):
        settings('[sweep]\n"optim.lr" = [1e-3, 0.001]').planned_runs()
    with pytest.raises(ConfigError, match="give the same run config"):
        settings(
            '[run]\nseed = 3\n[sweep]\nseed = [3]\nvariants = [{}, {"seed" = 3}]'
        ).planned_runs()


def test_duplicate_envs_get_distinct_ids() -> None:
    s = settings('runs = 3\nenvs = ["reverse", "reverse", "copy"]')
    assert [r.run_id for r in s.planned_runs()] == ["run_reverse", "run_reverse_2", "run_copy"]
    cycled = settings('runs = 4\nenvs = ["reverse", "copy"]').planned_runs()
    assert [r.run_id for r in cycled] == ["run_reverse", "run_copy", "run_reverse_2", "run_copy_2"]
    with pytest.raises(ConfigError, match="run ids appear more than once: run_a_b"):
        distinct_ids(["a.b", "a:b"])


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ("[sweep]", "needs at least one axis"),
        ("[sweep]\nseed = []", "sweep axis 'seed' has no values"),
        ("[sweep]\nseed = 3", "sweep.grid.seed: Input should be a valid list"),
        ('[sweep]\nname = "a-b"\nseed = [1, 2]', "sweep.name: String should match pattern"),
        ("[sweep]\nseed = [1, 2]\n[sweep.early_stop]\nkeep = 0.5", "after_steps: Field required"),
        (
            "[sweep]\nseed = [1, 2]\n[sweep.early_stop]\nafter_steps = 2\nkeep = 1.0",
            "keep: Input should be less than 1",
        ),
    ],
)
def test_spec_mistakes_are_clear(tmp_path, table: str, message: str) -> None:
    path = tmp_path / "up.toml"
    path.write_text(table + "\n")
    with pytest.raises(SettingsError, match=message):
        load_settings(UpSettings, path, environ={})


def test_early_stop_must_come_before_the_last_step() -> None:
    with pytest.raises(ConfigError, match="after_steps = 12 is not before the last step"):
        settings(GRID + "[sweep.early_stop]\nafter_steps = 12").planned_runs()


def test_in_sweep_matches_the_name_exactly() -> None:
    assert in_sweep("run_lr-lr1e-3", "lr") and in_sweep("run_lr", "lr")
    assert not in_sweep("run_lr2-lr1e-3", "lr") and not in_sweep("run_lr_2", "lr")


def test_spec_parsing_keeps_reserved_keys_apart_from_axes() -> None:
    spec = SweepSpec.model_validate({"name": "a", "seed": [1, 2], "variants": [{"env": "add"}]})
    assert spec.grid == {"seed": [1, 2]} and spec.variants == [{"env": "add"}]
    assert [r.run_id for r in expand(spec, {"env": "reverse"}, "reverse")] == [
        "run_a-s1",
        "run_a-s2",
    ]
