"""The training commands' losses and shared pass, on the tiny model with real LoRA slots:
hand-computed losses, runs sharing a pass equal to each run alone, NaN kept out of gradients."""

from __future__ import annotations

import math

import pytest
import torch

from schemas.training import Datum, ForwardBackwardRequest
from services.model.loader import load_model
from services.model.lora import MultiLoRA
from services.trainer.supervised import (
    CommandError,
    check_request,
    elementwise_loss,
    forward_backward,
)


def _request(
    loss_fn: str = "cross_entropy", n: int = 2, seed: int = 0, **kw
) -> ForwardBackwardRequest:
    g = torch.Generator().manual_seed(seed)
    data = []
    for i in range(n):
        tokens = torch.randint(3, 30, (6 + i,), generator=g).tolist()
        inputs: dict[str, list[float]] = {"target_tokens": [float(t) for t in [*tokens[1:], 5]]}
        if loss_fn == "cross_entropy":
            inputs["weights"] = [0.0, 1.0, 1.0, 0.5] + [1.0] * (len(tokens) - 4)
        else:
            inputs["logprobs"] = [-1.5] * len(tokens)
            inputs["advantages"] = [0.7 - 0.4 * i] * len(tokens)
        data.append(Datum(model_input=tokens, loss_fn_inputs=inputs))
    return ForwardBackwardRequest(
        request_id=f"r{seed}", run_id="run_x", data=data, loss_fn=loss_fn, **kw
    )


@pytest.fixture
def model_and_slots(tiny_dir):
    torch.manual_seed(0)
    model, _ = load_model(tiny_dir)
    slots = MultiLoRA.attach(model, n_adapters=3, max_rank=4)
    for idx in range(3):
        slots.reset_slot(idx, 4, 8.0, seed=idx)
        with torch.no_grad():  # B = 0 would make every slot the base model
            for p in slots.slot_parameters(idx):
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(idx)))
    return model, slots


def _grads(slots, idx):
    return [None if p.grad is None else p.grad.clone() for p in slots.slot_parameters(idx)]


def _clear(slots):
    for idx in range(3):
        for p in slots.slot_parameters(idx):
            p.grad = None


def test_losses_match_a_hand_computed_example():
    lp = torch.tensor([-1.0, -2.0, -0.5])
    q = torch.tensor([-1.2, -1.0, -0.5])
    adv = torch.tensor([1.0, -2.0, 0.5])
    w = torch.tensor([1.0, 0.0, 2.0])
    data = [Datum(model_input=[1, 2, 3])]
    ce = ForwardBackwardRequest(request_id="a", run_id="run_x", data=data)
    assert elementwise_loss(ce, lp, {"weights": w}).tolist() == pytest.approx([1.0, 0.0, 1.0])
    ratio = [math.exp(0.2), math.exp(-1.0), 1.0]
    is_ = ForwardBackwardRequest(
        request_id="b", run_id="run_x", data=data, loss_fn="importance_sampling"
    )
    got = elementwise_loss(is_, lp, {"logprobs": q, "advantages": adv}).tolist()
    assert got == pytest.approx([-ratio[0] * 1.0, ratio[1] * 2.0, -0.5])
    ppo = ForwardBackwardRequest(request_id="c", run_id="run_x", data=data, loss_fn="ppo")
    got = elementwise_loss(ppo, lp, {"logprobs": q, "advantages": adv}).tolist()
    # token 0: r = 1.221 > 1.2 with A > 0 -> clipped at 1.2; token 1: r = 0.368 < 0.8 with
    # A < 0 -> min(-0.736, -1.6) = -1.6 (the clipped term); token 2: r = 1.
    assert got == pytest.approx([-1.2, 1.6, -0.5])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"loss_fn": "dro"}, "not supported"),
        ({"loss_fn_config": {"beta": 1.0}}, "does not apply"),
        (
            {"data": [Datum(model_input=[1, 2], loss_fn_inputs={"target_tokens": [1.0]})]},
            "1 values for 2",
        ),
        ({"data": [Datum(model_input=[1, 2])]}, "needs loss_fn_inputs"),
        (
            {"data": [Datum(model_input=[1, 999], loss_fn_inputs={"target_tokens": [1.0, 2.0]})]},
            "vocabulary",
        ),
        (
            {
                "data": [
                    Datum(
                        model_input=[1],
                        loss_fn_inputs={"target_tokens": [1.0], "weights": [math.nan]},
                    )
                ]
            },
            "NaN",
        ),
    ],
)
def test_bad_requests_are_refused_before_any_compute(change, message):
    base = ForwardBackwardRequest(
        request_id="a",
        run_id="run_x",
        data=[Datum(model_input=[1], loss_fn_inputs={"target_tokens": [2.0]})],
    )
    req = ForwardBackwardRequest(
        **{**{f: getattr(base, f) for f in base.__struct_fields__}, **change}
    )
    with pytest.raises(CommandError, match=message):
        check_request(req, vocab_size=64)


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "importance_sampling", "ppo"])
def test_runs_sharing_a_pass_equal_each_run_alone(model_and_slots, loss_fn):
    model, slots = model_and_slots
    a, b = _request(loss_fn, n=3, seed=1), _request(loss_fn, n=2, seed=2)
    for req in (a, b):
        check_request(req, vocab_size=64)
    cpu = torch.device("cpu")
    alone = []
    for slot, req in ((0, a), (1, b)):
        _clear(slots)
        [outcome] = forward_backward(
            model, slots, [(slot, req)], token_budget=32, pad_id=0, device=cpu
        )
        alone.append((outcome, _grads(slots, slot)))
    _clear(slots)
    together = forward_backward(
        model, slots, [(0, a), (1, b)], token_budget=32, pad_id=0, device=cpu
    )
    for (outcome, grads), shared, slot in zip(alone, together, (0, 1), strict=True):
        assert shared.error is None and shared.runs_in_pass == 2
        assert shared.loss == pytest.approx(outcome.loss, abs=1e-5)
        for x, y in zip(shared.outputs, outcome.outputs, strict=True):
            assert x["logprobs"] == pytest.approx(y["logprobs"], abs=1e-5)
            assert x["elementwise_loss"] == pytest.approx(y["elementwise_loss"], abs=1e-5)
        for g1, g2 in zip(_grads(slots, slot), grads, strict=True):
            torch.testing.assert_close(g1, g2, atol=1e-5, rtol=1e-5)
    assert all(p.grad is None for p in slots.slot_parameters(2))


def test_gradients_add_up_until_cleared_and_forward_only_adds_none(model_and_slots):
    model, slots = model_and_slots
    req = _request(n=2, seed=3)
    cpu = torch.device("cpu")
    _clear(slots)
    forward_backward(model, slots, [(0, req)], token_budget=64, pad_id=0, device=cpu)
    once = _grads(slots, 0)
    forward_backward(model, slots, [(0, req)], token_budget=64, pad_id=0, device=cpu)
    peek = ForwardBackwardRequest(request_id="p", run_id="run_x", data=req.data, forward_only=True)
    [out] = forward_backward(model, slots, [(0, peek)], token_budget=64, pad_id=0, device=cpu)
    assert out.error is None and len(out.outputs) == 2
    for g1, g2 in zip(_grads(slots, 0), once, strict=True):
        torch.testing.assert_close(g1, 2 * g2)


def test_a_non_finite_loss_adds_no_gradient_and_spares_the_other_run(model_and_slots):
    model, slots = model_and_slots
    good = _request(n=2, seed=4)
    huge = ForwardBackwardRequest(
        request_id="h",
        run_id="run_y",
        data=[
            Datum(
                model_input=[4, 5, 6, 7],
                loss_fn_inputs={"target_tokens": [5.0, 6.0, 7.0, 8.0], "weights": [3e38] * 4},
            )
        ],
    )
    check_request(huge, vocab_size=64)
    cpu = torch.device("cpu")
    _clear(slots)
    [alone] = forward_backward(model, slots, [(0, good)], token_budget=16, pad_id=0, device=cpu)
    expected = _grads(slots, 0)
    _clear(slots)
    for p in slots.slot_parameters(1):
        p.grad = torch.ones_like(p)
    out_good, out_huge = forward_backward(
        model, slots, [(0, good), (1, huge)], token_budget=16, pad_id=0, device=cpu
    )
    assert out_good.error is None and out_good.loss == pytest.approx(alone.loss, abs=1e-5)
    assert out_huge.error is not None and "non-finite" in out_huge.error
    assert out_huge.outputs == []
    for g1, g2 in zip(_grads(slots, 0), expected, strict=True):
        torch.testing.assert_close(g1, g2, atol=1e-5, rtol=1e-5)
    for p in slots.slot_parameters(1):  # what was accumulated before is kept as it was
        assert torch.equal(p.grad, torch.ones_like(p))
