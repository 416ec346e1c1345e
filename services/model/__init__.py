"""The language model shared by the trainer and the inference services.

- ``tiny``: writes the default tiny Llama with a character tokenizer (``plexrl model tiny DIR``).
- ``loader``: loads any Hugging Face causal LM from a local directory.
- ``sampling``: batched KV-cache sampling (one sampler for inference and the warm start).
- ``lora``: the multi-adapter LoRA layer, one adapter slot per run.
- ``targets``: which modules carry LoRA (``nn.Linear`` and GPT-2's ``Conv1D``).
- ``families``: the supported model families, their default targets and the admission check.
- ``peft_io``: adapters as safetensors bytes and as PEFT directories.

This package imports nothing heavy on its own so that ``plexrl --help`` stays instant; import
the submodule you need.
"""
