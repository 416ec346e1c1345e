"""The inference service: completions with per-token log-probabilities under each run's adapter.

- ``service``: :class:`InferenceService`, the replica: request/reply on
  ``plexrl.inference.generate`` (queue group ``inference``), a run mirror, a weights follower.
- ``jobs``: what the service asks of an engine (:class:`Engine`, :class:`Job`).
- ``torch_engine``: the default engine, one multi-LoRA model batching every run together
  (the KV-cache sampler is ``services.model.sampling``; ``adapters``: slot swaps at
  generation-step boundaries).
- ``vllm_engine``: the GPU engine on vLLM, one LoRARequest per run.
- ``weights_follower``: loads every announced adapter on every replica.
- ``settings`` and ``cli``: ``plexrl inference``.

Nothing heavy is imported here, so ``plexrl --help`` stays instant.
"""
