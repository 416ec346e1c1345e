"""The gateway holds no training state: restart it and a Tinker client carries on."""

from __future__ import annotations

import pytest
import tinker
from tinker import types

pytestmark = pytest.mark.timeout(300)


def test_a_training_client_carries_on_across_a_gateway_restart(stack) -> None:
    with tinker.ServiceClient(base_url=stack.url, api_key="tml-plexrl-test") as service:
        trainer = service.create_lora_training_client(base_model="tiny-base", rank=4).result()
        datum = types.Datum(
            model_input=types.ModelInput.from_ints([1, 5, 6, 7]),
            loss_fn_inputs={"target_tokens": [5, 6, 7, 2]},
        )
        adam = types.AdamParams(learning_rate=5e-3)
        before = trainer.forward_backward([datum], "cross_entropy").result(timeout=120)
        trainer.optim_step(adam).result(timeout=120)

        port = int(stack.url.rsplit(":", 1)[1])
        assert stack.stop("gateway") == 0, stack.log("gateway")
        stack.start_gateway(port)
        # no wait for the new process: the SDK retries while nothing listens
        after = trainer.forward_backward([datum], "cross_entropy").result(timeout=120)
        trainer.optim_step(adam).result(timeout=120)
        assert after.metrics["loss:sum"] < before.metrics["loss:sum"]  # the first step was kept
        saved = trainer.save_weights_for_sampler("after-restart").result(timeout=120)
        assert saved.path.endswith("@2")  # two optimizer steps, one on each side of the restart
        stack.wait_http()
