"""The warm start trains reproducibly, records what it did, and samples the way RL will."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from services.cli import main
from services.envs import decode_ids, load_environment, prompt_token_ids
from services.model.loader import load_model
from services.model.pretrain import (
    DEFAULT_ENVS,
    PRETRAIN_FILE,
    DemonstrationStream,
    corrupt_answer,
    evaluate,
    pretrain,
    readout_parameters,
)
from services.model.sampling import SequenceSpec, generate_batch

ENVS = DEFAULT_ENVS
# The optional noisy phase on, so that both phases run.
SHORT = {"steps": 24, "eval_prompts": 16, "noise": 0.7, "noisy_fraction": 0.3}


@pytest.fixture(autouse=True)
def one_thread() -> Any:
    """Run each test's own forwards on one thread, as pretrain does.

    Tiny forwards gain nothing from a second thread, and on a shared two-core machine two
    OpenMP threads spin-wait on each other, which made these tests several times slower.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _copy(tiny_dir: Path, dest: Path) -> Path:
    shutil.copytree(tiny_dir, dest)
    return dest


@pytest.fixture(scope="module")
def short_runs(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    """Two short pre-trainings of the same random model with the same seed."""
    threads = torch.get_num_threads()
    runs = []
    for name in ("first", "second"):
        model_dir = _copy(tiny_dir, tmp_path_factory.mktemp(name) / "model")
        lines: list[str] = []
        report = pretrain(model_dir, seed=3, log=lines.append, **SHORT)  # type: ignore[arg-type]
        runs.append(SimpleNamespace(dir=model_dir, report=report, lines=lines))
    assert torch.get_num_threads() == threads
    assert not torch.are_deterministic_algorithms_enabled()
    return runs


def test_same_seed_gives_bit_identical_weights(short_runs, tiny_dir):
    first, second = (run.dir for run in short_runs)
    weights = (first / "model.safetensors").read_bytes()
    assert (second / "model.safetensors").read_bytes() == weights
    assert (first / PRETRAIN_FILE).read_bytes() == (second / PRETRAIN_FILE).read_bytes()
    assert weights != (tiny_dir / "model.safetensors").read_bytes()
    assert short_runs[0].report.losses == short_runs[1].report.losses


def test_the_clean_phase_lowers_the_loss(short_runs):
    losses = short_runs[0].report.losses
    assert len(losses) == 24
    # Steps 0..16 are clean (noisy_fraction 0.3 leaves the last 7 noisy); a random model starts
    # near ln(90) = 4.5 nats.
    assert losses[0] > 4.0
    assert sum(losses[13:17]) / 4 < losses[0] - 1.0
    lines = short_runs[0].lines
    assert len(lines) == 12 and lines[-1].startswith("pretrain step 24/24 (read-out, noisy) loss ")


def test_the_noisy_phase_moves_only_the_read_out(tiny_dir, tmp_path):
    model_dir = _copy(tiny_dir, tmp_path / "model")
    pretrain(model_dir, steps=3, noisy_fraction=1.0, eval_prompts=2)
    before, _ = load_model(tiny_dir)
    after, _ = load_model(model_dir)
    readout = {id(p) for p in readout_parameters(after)}
    assert len(readout) == 4  # gate, up and down projections of the last MLP, the final norm
    pairs = zip(after.parameters(), before.parameters(), strict=True)
    changed = {id(p) for p, q in pairs if not torch.equal(p, q)}
    assert changed == readout


def test_pretrain_json_records_the_run_and_the_tokenizer_is_untouched(short_runs, tiny_dir):
    run = short_runs[0]
    record = json.loads((run.dir / PRETRAIN_FILE).read_text())
    assert (record["steps"], record["seed"], record["envs"]) == (24, 3, list(ENVS))
    assert record["noise"] == run.report.noise
    assert record["final_loss"] == pytest.approx(sum(run.report.losses[-2:]) / 2)
    assert record["rewards"] == run.report.rewards
    assert set(record["rewards"]) == set(ENVS)
    assert all(0.0 <= r <= 1.0 for r in record["rewards"].values())
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (run.dir / name).read_bytes() == (tiny_dir / name).read_bytes()
    assert sorted(p.name for p in run.dir.parent.iterdir()) == ["model"]
    model, _ = load_model(run.dir)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_corrupt_answer_keeps_the_alphabet_and_jitters_the_length():
    rng = random.Random(0)
    assert corrupt_answer("hello", "abc", 0.0, rng) == "hello"
    outs = [corrupt_answer("abcab", "abc", 0.6, rng) for _ in range(3000)]
    assert all(set(out) <= set("abc") and 4 <= len(out) <= 6 for out in outs)
    assert sum(len(out) != 5 for out in outs) / len(outs) == pytest.approx(0.2, abs=0.03)
    # A replaced character is drawn from the whole alphabet, so it stays right 1/3 of the time.
    wrong = sum(a != b for out in outs for a, b in zip(out, "abcab", strict=False))
    assert wrong / sum(min(len(out), 5) for out in outs) == pytest.approx(0.4, abs=0.03)


def test_demonstrations_are_bos_prompt_answer_eos(tiny_dir):
    _, tokenizer = load_model(tiny_dir)
    envs = [load_environment(name, seed=5) for name in ENVS]
    n = len(envs)
    stream = DemonstrationStream(tokenizer, envs, batch_size=2 * n, seed=0)
    ids_BT, answer_BT = stream.batch(step=2, noise=0.0)
    for row in range(2 * n):
        prompt = envs[row % n].train_prompt(2 * 2 + row // n)
        real = ids_BT[row][ids_BT[row] != tokenizer.pad_token_id].tolist()
        assert (
            decode_ids(tokenizer, real, skip_special_tokens=False)
            == f"<bos>{prompt.text}{prompt.target}<eos>"
        )
        answer = decode_ids(tokenizer, ids_BT[row][answer_BT[row]].tolist(), False)
        assert answer == prompt.target + "<eos>"
    again, _ = stream.batch(step=2, noise=0.0)
    assert torch.equal(again, ids_BT)


def test_demonstrations_show_the_slip_at_the_slip_rate_and_never_a_held_out_prompt(tiny_dir):
    _, tokenizer = load_model(tiny_dir)
    envs = [load_environment(name, seed=5) for name in ENVS]
    n = len(envs)
    always = DemonstrationStream(tokenizer, envs, batch_size=2 * n, seed=0, slip_rate=1.0)
    ids_BT, answer_BT = always.batch(step=1, noise=0.0)
    for row in range(2 * n):
        env = envs[row % n]
        prompt = env.train_prompt(2 + row // n)
        answer = decode_ids(tokenizer, ids_BT[row][answer_BT[row]].tolist(), False)
        assert answer == f"{env.slip(prompt)}<eos>"
    mixed = DemonstrationStream(tokenizer, envs[:2], batch_size=48, seed=0, slip_rate=0.65)
    slipped = shown = 0
    for step in range(40):
        ids_BT, answer_BT = mixed.batch(step=step, noise=0.0)
        for row in range(48):
            env = envs[row % 2]
            prompt = env.train_prompt(step * 24 + row // 2)
            assert not env.is_heldout(prompt)
            answer = decode_ids(tokenizer, ids_BT[row][answer_BT[row]].tolist(), False)
            slipped += answer == f"{env.slip(prompt)}<eos>"
            shown += 1
    assert slipped / shown == pytest.approx(0.65, abs=0.04)
    with pytest.raises(ValueError, match="slip_rate"):
        DemonstrationStream(tokenizer, envs, batch_size=6, seed=0, slip_rate=1.5)


def test_sampling_without_adapters_matches_step_by_step_decoding(tiny_dir):
    model, tokenizer = load_model(tiny_dir)
    prompts = [
        prompt_token_ids(tokenizer, t) for t in ("add: 1+2=", "reverse: abcde=", "copy: xy=")
    ]
    specs = [SequenceSpec(prompt_ids=p, slot=-1, max_tokens=6, temperature=0.0) for p in prompts]
    got = generate_batch(model, None, specs, eos_ids=[2], pad_id=0)
    for prompt, out in zip(prompts, got, strict=True):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(6):
                ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
                if ids[-1] == 2:
                    break
        assert out.token_ids == ids[len(prompt) :]


class _Seen(list):
    """The oracle's "KV cache": the ids each row has been fed, dropped with its row."""

    def batch_select_indices(self, rows: torch.Tensor) -> None:
        self[:] = [self[i] for i in rows.tolist()]


class _Oracle(torch.nn.Module):
    """A stand-in model that writes the right answer and <eos>, reading the ids it was fed."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.vocab = len(tokenizer)
        self.device_marker = torch.nn.Parameter(torch.zeros(()))

    def forward(self, input_ids, attention_mask, past_key_values=None, **_: Any) -> Any:
        seen = past_key_values if isinstance(past_key_values, _Seen) else _Seen()
        seen.extend([] for _ in range(len(input_ids) - len(seen)))
        logits = torch.zeros(len(input_ids), 1, self.vocab)
        for i, row in enumerate(input_ids.tolist()):
            real = [
                t
                for t, keep in zip(row, attention_mask[i, -len(row) :].tolist(), strict=True)
                if keep
            ]
            seen[i] = seen[i] + real
            assert seen[i][0] == self.tokenizer.bos_token_id
            text = decode_ids(self.tokenizer, seen[i][1:], skip_special_tokens=False)
            prompt, _, written = text.partition("=")
            task, _, operand = prompt.partition(": ")
            answer = {
                "reverse": operand[::-1],
                "copy": operand,
                "upper": operand.upper(),
                "rotate": operand[1:] + operand[:1],
            }.get(task)
            answer = answer if answer is not None else str(sum(map(int, operand.split("+"))))
            full = [*self.tokenizer.encode(answer, add_special_tokens=False), 2]
            logits[i, 0, full[len(written)]] = 100.0
        return SimpleNamespace(logits=logits, past_key_values=seen)


def test_evaluate_scores_sampled_completions_per_env(tiny_dir):
    model, tokenizer = load_model(tiny_dir)
    assert evaluate((_Oracle(tokenizer), tokenizer), ENVS, n_prompts=8) == dict.fromkeys(ENVS, 1.0)
    random_model = evaluate((model, tokenizer), ENVS, n_prompts=16, seed=1)
    assert set(random_model) == set(ENVS)
    # A random model rambles past the answer, which the built-in rewards punish.
    assert all(0.0 <= r < 0.15 for r in random_model.values())
    assert evaluate(tiny_dir, ENVS, n_prompts=16, seed=1) == random_model


def test_cli_no_pretrain_writes_the_random_model_and_drops_a_stale_record(
    tiny_dir, tmp_path, capsys
):
    out = tmp_path / "plain"
    out.mkdir()
    (out / PRETRAIN_FILE).write_text("{}")
    assert main(["model", "tiny", str(out), "--no-pretrain"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"wrote tiny Llama to {out}: ")
    assert (out / "model.safetensors").read_bytes() == (tiny_dir / "model.safetensors").read_bytes()
    assert not (out / PRETRAIN_FILE).exists()


def test_cli_pretrains_by_default(tiny_dir, tmp_path, capsys):
    out = tmp_path / "warm"
    assert main(["model", "tiny", str(out), "--pretrain-steps", "10"]) == 0
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    assert len(lines) == 2 and lines[0].endswith("vocab 90, seed 0")
    assert lines[1].startswith("pre-trained for 10 steps in ")
    assert "sampled reward reverse " in lines[1]
    assert "pretrain step 10/10 (all weights) loss " in captured.err
    record = json.loads((out / PRETRAIN_FILE).read_text())
    assert (record["steps"], record["seed"]) == (10, 0)
    assert (out / "model.safetensors").read_bytes() != (tiny_dir / "model.safetensors").read_bytes()
