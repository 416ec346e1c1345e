"""The trainer service: many runs' LoRA adapters on one shared base model.

- ``settings``: the service's settings (``plexrl trainer`` flags, TOML, ``PLEXRL_*``).
- ``packer``, ``loss``, ``schedule``: the pure pieces of a step (packing, the importance-sampled
  loss, the learning-rate schedule).
- ``state``: per-run state (adapter slot, AdamW, schedule, progress), created and dropped by the
  run mirror's hooks.
- ``step``: one multi-run trainer step on the model.
- ``intake``: the rollout consumer, holding batches until their run's turn.
- ``commit``: checkpoint, step log, WeightsReady, progress and ack after a run's step.
- ``checkpoint``: atomic per-run checkpoints and the step log.
- ``distributed``: data-parallel ranks (broadcast of the work, all-reduce of the gradients).
- ``service``: the loop that ties them together; ``cli``: ``plexrl trainer``.

Importing this package imports nothing heavy, so ``plexrl --help`` stays instant.
"""
