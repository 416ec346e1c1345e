"""The orchestrator: one per run, from prompts to RolloutBatch events.

- :mod:`.run_loop`: :class:`~.run_loop.RunOrchestrator`, admission, resume and the step loop;
- :mod:`.step`: one step end to end (generate, score, publish, record);
- :mod:`.rollouts`: the pure part of a step (prompt positions, seeds, replies, batches);
- :mod:`.client`: GenerateRequest / GenerateResponse with retries;
- :mod:`.lifecycle`: the run's admission by the registry and its eviction;
- :mod:`.versions`: the policy versions the trainer has announced (the off-policy clock);
- :mod:`.state`: the checkpoint and where a restarted orchestrator resumes;
- :mod:`.metrics`: ``metrics.jsonl``;
- :mod:`.advantages`: group-relative advantages.
"""
