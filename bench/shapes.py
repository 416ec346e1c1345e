"""Model shapes the benchmarks run at, with random weights from the config (no download), and the
decode roofline: what a decode step must read from memory, over the device's bandwidth.

Shapes (``--shape``):

- ``tiny``: plexrl's default tiny Llama (hidden 64, 2 layers, character vocabulary);
- ``llama-1b``: Llama-3.2-1B (hidden 2048, 16 layers, 32 heads, 8 KV heads, MLP 8192,
  vocabulary 128,256, tied embeddings, llama3 rope scaling);
- ``llama-8b``: Llama-3.1-8B (hidden 4096, 32 layers, 32 heads, 8 KV heads, MLP 14,336);
- ``qwen2.5-0.5b``: Qwen2.5-0.5B (hidden 896, 24 layers, 14 heads, 2 KV heads, MLP 4,864,
  vocabulary 151,936, q/k/v biases, tied embeddings).

Roofline. A decode step reads every weight once (the embedding table only where it is also the
output head, tied; otherwise just the rows looked up, which are negligible), the active runs'
adapters, and the keys and values of every cached position of every row. At B rows of average
cached length L:  bytes_step = weights + adapters + B * L * kv_bytes_per_token, and the roofline
is B tokens per bytes_step / bandwidth seconds. Bandwidth: the spec sheet's figure for the GPUs
named in :data:`SPEC_BANDWIDTH`, else a measured device-to-device copy (named so in the output).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.model.tiny import TinySpec, tiny_config
from services.model.tokenizer import save_char_tokenizer

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

SHAPES: dict[str, dict[str, Any]] = {
    "llama-1b": {
        "model_type": "llama",
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 8192,
        "vocab_size": 128256,
        "tie_word_embeddings": True,
        "rope_theta": 500000.0,
        "rope_scaling": LLAMA3_ROPE,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
    },
    "llama-8b": {
        "model_type": "llama",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
        "rope_theta": 500000.0,
        "rope_scaling": {**LLAMA3_ROPE, "factor": 8.0},
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
    },
    "qwen2.5-0.5b": {
        "model_type": "qwen2",
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "intermediate_size": 4864,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "use_sliding_window": False,
    },
}
NAMES = ("tiny", *SHAPES)

SPEC_BANDWIDTH = {
    "H200": 4.8e12,
    "H100 SXM": 3.35e12,
    "H100 80GB HBM3": 3.35e12,
    "H100 PCIe": 2.0e12,
    "H100 NVL": 3.9e12,
    "A100-SXM4-80GB": 2.039e12,
    "A100 80GB PCIe": 1.935e12,
    "A100-SXM4-40GB": 1.555e12,
    "L40S": 0.864e12,
    "L4": 0.3e12,
}


def config_for(shape: str) -> Any:
    """The transformers config of ``shape`` (special ids 0/1/2, as the character tokenizer)."""
    if shape == "tiny":
        return tiny_config(TinySpec())
    from transformers import AutoConfig

    fields = dict(SHAPES[shape])
    model_type = fields.pop("model_type")
    # Both spellings of the rope settings: transformers 4 reads rope_theta and rope_scaling,
    # transformers 5 rope_parameters (and converts the old ones with a warning).
    rope = {"rope_type": "default", **fields.get("rope_scaling", {})}
    rope["rope_theta"] = fields["rope_theta"]
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return AutoConfig.for_model(
            model_type,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            rope_parameters=rope,
            **fields,
        )


def build_model(shape: str, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Any:
    """A random-weight causal LM of ``shape``, initialised directly on ``device`` (a GPU
    initialises 8B parameters in a second), in eval mode."""
    from transformers import AutoModelForCausalLM

    config = config_for(shape)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        with device:
            model: Any = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def write_model_dir(shape: str, out_dir: Path, device: torch.device, dtype: torch.dtype) -> Path:
    """A model directory of ``shape`` (random weights, the character tokenizer) for the engines
    that load one; written once per directory."""
    from services.model.loader import quiet_progress_bars

    if (out_dir / "config.json").is_file():
        return out_dir
    model = build_model(shape, device, dtype)
    with quiet_progress_bars():
        model.save_pretrained(str(out_dir), safe_serialization=True)
    save_char_tokenizer(out_dir)
    del model
    return out_dir


@dataclass(frozen=True)
class Roofline:
    weight_bytes: int
    kv_bytes_per_token: int
    bandwidth: float
    bandwidth_source: str

    def tokens_per_s(self, rows: int, mean_cached: float, adapter_bytes: int = 0) -> float:
        step = self.weight_bytes + adapter_bytes + rows * mean_cached * self.kv_bytes_per_token
        return rows * self.bandwidth / step


def roofline_for(config: Any, dtype: torch.dtype, device: torch.device) -> Roofline:
    """The decode roofline of a model of ``config`` in ``dtype`` on ``device`` (counted on a
    meta-device build: no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model: Any = AutoModelForCausalLM.from_config(config, dtype=dtype)
    embed = model.get_input_embeddings().weight
    tied = bool(getattr(config, "tie_word_embeddings", False))
    size = dtype.itemsize
    weights = sum(p.numel() for p in model.parameters()) * size
    if not tied:
        weights -= embed.numel() * size
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * size
    bandwidth, source = device_bandwidth(device)
    return Roofline(weights, kv, bandwidth, source)


def device_bandwidth(device: torch.device) -> tuple[float, str]:
    """Bytes/s of ``device``'s memory and where the figure comes from."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in SPEC_BANDWIDTH.items():
            if key in name:
                return value, f"{name}: {value / 1e12:.2f} TB/s spec sheet"
    measured = measure_copy_bandwidth(device)
    return measured, f"{device.type}: {measured / 1e9:.1f} GB/s measured copy (read + write)"


def measure_copy_bandwidth(device: torch.device, mib: int = 256) -> float:
    src = torch.empty(mib << 18, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / best
