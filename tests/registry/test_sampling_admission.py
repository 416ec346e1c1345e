"""The registry refuses sampling and loss settings the trainer cannot train on correctly.

Greedy sampling (temperature 0) gives a group identical completions and so zero advantages;
top_p < 1 samples from a nucleus the trainer does not score under; a dual clip of at most 1
stops every negative advantage from teaching. Each is refused at admission with a
RunConfigInvalid that says why and what to use, uses no index, and writes nothing.
"""

from __future__ import annotations

from pathlib import Path

from schemas import subjects as sj
from schemas.config import parse_orch_config
from schemas.events import RunConfigInvalid, RunDiscovered, RunSubmitted
from services.bus import Bus

from .conftest import RegistryFactory
from .helpers import VALID_TOML, events_on, eventually, table, write_orch

BAD_FILES = {
    "run_greedy": "[sampling]\ntemperature = 0.0\n",
    "run_nucleus": "[sampling]\ntop_p = 0.9\n",
}


async def test_refused_sampling_settings_in_orch_toml(
    make_registry: RegistryFactory, rbus: Bus, out: Path
) -> None:
    for run_id, text in BAD_FILES.items():
        write_orch(out, run_id, VALID_TOML + text)
    registry = await make_registry(max_runs=2)
    events = {e.run_id: e.error for e in await events_on(rbus, sj.INVALID, RunConfigInvalid)}
    assert events.keys() == BAD_FILES.keys()
    assert events["run_greedy"].startswith("sampling.temperature: ")
    assert "every advantage is zero" in events["run_greedy"]
    assert "use temperature > 0 for training" in events["run_greedy"]
    assert events["run_nucleus"].startswith("sampling.top_p: ")
    assert "use top_p = 1 for training" in events["run_nucleus"]
    for run_id in BAD_FILES:
        error_file = out / run_id / "control" / "config_validation_error.txt"
        assert error_file.read_text().strip() == events[run_id]
        assert registry.idx_of(run_id) is None
    assert registry.pool.num_free == 2
    records = await table(rbus)
    assert {records[r].status for r in BAD_FILES} == {"invalid"}
    assert await events_on(rbus, sj.DISCOVERED, RunDiscovered) == []


async def test_refused_settings_in_a_submission(
    make_registry: RegistryFactory, rbus: Bus, out: Path
) -> None:
    await make_registry(max_runs=2)
    good = parse_orch_config(VALID_TOML).to_dict()
    greedy = good | {"sampling": good["sampling"] | {"temperature": 0.0}}
    nucleus = good | {"sampling": good["sampling"] | {"top_p": 0.95}}
    dual = good | {"loss": good["loss"] | {"dual_clip": 1.0}}
    for run_id, config in (("run_greedy", greedy), ("run_nucleus", nucleus), ("run_dual", dual)):
        await rbus.publish(sj.SUBMIT, RunSubmitted(run_id=run_id, config=config))
    # A good run after them shows the bad ones were handled (in order) and did not block it.
    await rbus.publish(sj.SUBMIT, RunSubmitted(run_id="run_good", config=good))
    [discovered] = await eventually(lambda: events_on(rbus, sj.DISCOVERED, RunDiscovered))
    assert discovered.run_id == "run_good"
    events = await events_on(rbus, sj.INVALID, RunConfigInvalid)
    assert [(e.run_id, e.error.split(":")[0]) for e in events] == [
        ("run_greedy", "sampling.temperature"),
        ("run_nucleus", "sampling.top_p"),
        ("run_dual", "loss.dual_clip"),
    ]
    assert "or 0 to turn it off" in events[2].error
    assert sorted(p.name for p in out.iterdir()) == ["run_good"]
