"""The language model shared by the trainer and the inference services.

- ``tiny``: writes the default tiny Llama with a character tokenizer (``plexrl model tiny DIR``).
- ``loader``: loads any Hugging Face causal LM from a local directory.
- ``sampling``: the static sampler (the warm start; families the paged decoder does not run)
  and the device-side sampling step both share.
- ``paged_kv``, ``decoder``, ``paged_generate``, ``decode_graphs``, ``triton_kernels``: the
  inference engine's continuous batching over a paged KV cache, CUDA graphs and kernels.
- ``lora``: the multi-adapter LoRA layer, one adapter slot per run (``lora_segments``: its
  training delta as one autograd node; ``lora_gather``: its decode path by gather).
- ``targets``: which modules carry LoRA (``nn.Linear`` and GPT-2's ``Conv1D``).
- ``families``: the supported model families, their default targets and the admission check.
- ``peft_io``: adapters as safetensors bytes and as PEFT directories.

This package imports nothing heavy on its own so that ``plexrl --help`` stays instant; import
the submodule you need.
"""
