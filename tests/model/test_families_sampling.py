"""For every family, the sampler's log-probabilities are the ones the trainer's forward computes.

The sampler runs left-padded prompts through a KV cache, one token at a time; the trainer runs
the packed, right-padded full sequences in one forward (services/trainer/packer.py and the
executor's ``model(input_ids, attention_mask)``, then ``selected_logprobs``). Any difference
beyond rounding is an off-policy error the importance ratio would silently absorb.
"""

from __future__ import annotations

import pytest
import torch

from schemas.events import RolloutBatch, Sample
from services.model.families import FAMILIES, tiny_family_model
from services.model.lora import MultiLoRA
from services.model.sampling import SequenceSpec, generate_batch
from services.trainer.loss import selected_logprobs
from services.trainer.packer import pack_step

PROMPTS = [[1, 40, 41, 42], [1, 50], [1, 60, 61, 62, 63, 64, 65], [1, 70, 71]]
SLOT_OF_PROMPT = [0, 1, -1, 1]
PAD, EOS = 0, 2


@pytest.mark.parametrize("family", list(FAMILIES))
def test_sampler_logprobs_equal_the_trainers_forward(family, randomize):
    model = tiny_family_model(family)
    vocab = model.get_input_embeddings().num_embeddings
    lora = MultiLoRA.attach(model, n_adapters=2, max_rank=8)
    randomize(lora, 0, 8, 16.0, seed=1)
    randomize(lora, 1, 4, 8.0, seed=2)
    specs = [
        SequenceSpec(prompt_ids=p, slot=s, max_tokens=9, temperature=1.0, seed=10 + i)
        for i, (p, s) in enumerate(zip(PROMPTS, SLOT_OF_PROMPT, strict=True))
    ]
    outputs = generate_batch(model, lora, specs, eos_ids=[EOS], pad_id=PAD)
    # The longest sequence reaches past the 8-token sliding window of Mistral and Gemma 3.
    assert (
        max(len(s.prompt_ids) + len(o.token_ids) for s, o in zip(specs, outputs, strict=True)) > 8
    )

    # Slot -1 (the base model) is not a run; its rows go to the trainer under a spare slot whose
    # adapter is a fresh PEFT one (B = 0), which computes exactly the base model.
    batches = []
    for slot in (0, 1):
        samples = [
            Sample(
                prompt_ids=list(spec.prompt_ids),
                completion_ids=out.token_ids,
                completion_logprobs=out.logprobs,
                reward=0.0,
                advantage=0.0,
            )
            for spec, out in zip(specs, outputs, strict=True)
            if spec.slot == slot or (slot == 0 and spec.slot == -1)
        ]
        batches.append(
            (slot, RolloutBatch(run_id=f"run_{slot}", step=0, policy_version=0, samples=samples))
        )
    packed = pack_step(batches, token_budget=4096, pad_id=PAD, vocab_size=vocab)
    assert not packed.rejected
    (mb,) = packed.micro_batches
    base_rows = [
        i
        for i, (run, j) in enumerate(zip(mb.sample_run, mb.sample_index, strict=True))
        if run == "run_0" and batches[0][1].samples[j].prompt_ids == PROMPTS[2]
    ]
    slot_ids = mb.slot_ids_B.clone()
    slot_ids[base_rows] = -1
    with torch.no_grad(), lora.use(slot_ids):
        logits = model(input_ids=mb.input_ids_BT, attention_mask=mb.attention_mask_BT).logits
    trainer_lp = selected_logprobs(logits, mb.target_ids_BT)
    mask = mb.loss_mask_BT
    torch.testing.assert_close(trainer_lp[mask], mb.old_logprobs_BT[mask], atol=1e-4, rtol=0)
    assert int(mask.sum()) == sum(len(o.token_ids) for o in outputs)
