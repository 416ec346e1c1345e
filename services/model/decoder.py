"""The forward pass of a Llama-family decoder over the paged KV cache: prefill and decode.

It walks the Hugging Face model's own modules (embeddings, norms, projections, MLP, head), so
the weights, the multi-LoRA layers and any in-place full-weights install are the ones the
trainer's forward uses; only attention and the cache are plexrl's. That is what keeps a
completion's log-probabilities equal to the trainer's forward of the same tokens (to rounding).

    h = embed(ids)
    per layer: x = norm1(h); q, k, v = proj(x); [qwen3: per-head norms of q and k]
               q, k = rope(q, k, position); cache[position] = k, v
               h += o_proj(attention(q, cache[0..position])); h += mlp(norm2(h))
    logits = lm_head(norm(h))

Families: ``llama``, ``mistral``, ``qwen2``, ``qwen3`` (the layout above), with every layer at
full attention (a sliding window shorter than the longest sequence would change the result)
and a rotary embedding computed from fixed inverse frequencies (not the dynamic or long-rope
kinds, whose frequencies depend on the sequence length). :func:`unsupported_reason` says why
another model is not, and the caller falls back to the static sampler (sampling.py).

Decode runs one token per row with static shapes and no host synchronisation (a CUDA graph
captures it); the LoRA layers then add their deltas by gather (lora_gather.py). Prefill runs the
new prompts right-padded as one batch under causal attention (a real query never sees a padded
key, which lies after it) and routes LoRA the trainer's way, by sorted segments.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F

from services.model import triton_kernels
from services.model.lora import MultiLoRA
from services.model.paged_kv import PagedKVCache, paged_attention_reference, reference_layout

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
STATIC_ROPE = ("default", "llama3", "linear", "yarn")


def unsupported_reason(model: Any, max_seq_len: int) -> str | None:
    """None when :class:`PagedDecoder` can run ``model``, else why not."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        return f"model_type {model_type!r} is not one of {', '.join(FAMILIES)}"
    layer_types = getattr(config, "layer_types", None) or []
    if "sliding_attention" in layer_types:
        return "it has sliding-window layers"
    window = getattr(config, "sliding_window", None)
    if model_type == "mistral" and window is not None and window < max_seq_len:
        return f"its sliding window ({window}) is shorter than {max_seq_len} tokens"
    rope_type = getattr(model.model.rotary_emb, "rope_type", "default")
    if rope_type not in STATIC_ROPE:
        return f"its rotary embedding is of type {rope_type!r}"
    return None


class PagedDecoder:
    """Prefill and decode of one model over one :class:`PagedKVCache`."""

    def __init__(self, model: Any, lora: MultiLoRA | None, cache: PagedKVCache) -> None:
        self.model = model
        self.lora = lora
        self.cache = cache
        inner = model.model
        self.embed = inner.embed_tokens
        self.layers = list(inner.layers)
        self.norm = inner.norm
        self.lm_head = model.lm_head
        rotary = inner.rotary_emb
        self.inv_freq: torch.Tensor = rotary.inv_freq
        self.rope_scaling = float(getattr(rotary, "attention_scaling", 1.0))
        attn = self.layers[0].self_attn
        config = model.config
        self.head_dim = int(attn.head_dim)
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(config.num_key_value_heads)
        self.scaling = float(attn.scaling)
        self.has_qk_norm = hasattr(attn, "q_norm")
        self.triton_attention = triton_kernels.usable(cache.keys.device) and (
            triton_kernels.attention_fits(
                self.num_heads, self.num_kv_heads, self.head_dim, cache.block_size
            )
        )

    def _rope(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.unsqueeze(-1).float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.rope_scaling).to(dtype), (emb.sin() * self.rope_scaling).to(dtype)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def _qkv(
        self, attn: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Projected, normed and rotated q, k, v as [..., heads, D] (cos/sin [..., 1, D])."""
        lead = x.shape[:-1]
        q = attn.q_proj(x).view(*lead, self.num_heads, self.head_dim)
        k = attn.k_proj(x).view(*lead, self.num_kv_heads, self.head_dim)
        v = attn.v_proj(x).view(*lead, self.num_kv_heads, self.head_dim)
        if self.has_qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin), v

    # --- decode ---------------------------------------------------------------------------------

    def decode(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        block_tables: torch.Tensor,
        slot_ids: torch.Tensor | None,
        num_pages: int | None = None,
    ) -> torch.Tensor:
        """Logits [B, V] of one token per row at ``positions`` [B]; writes its keys and values.

        ``slot_ids`` [B] (trusted ids, -1 for the base) choose each row's adapter; ``num_pages``
        bounds the blocks the reference attention reads (None: the whole table, as a captured
        step must). No host synchronisation.
        """
        cache = self.cache
        h = self.embed(input_ids)
        cos, sin = self._rope(positions, h.dtype)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        rows = cache.rows(block_tables, positions)
        lengths = positions + 1
        if not self.triton_attention:
            read_rows, bias = reference_layout(block_tables, lengths, cache.block_size, num_pages)
        context = self.lora.context if self.lora is not None else None
        if context is not None:
            context.set_gather_slots(slot_ids)
        try:
            for i, layer in enumerate(self.layers):
                attn = layer.self_attn
                q, k, v = self._qkv(attn, layer.input_layernorm(h), cos, sin)
                cache.write(i, rows, k, v)
                if self.triton_attention:
                    o = triton_kernels.paged_decode_attention(
                        q, cache.keys[i], cache.values[i], block_tables, lengths,
                        self.scaling, cache.block_size,
                    )  # fmt: skip
                else:
                    o = paged_attention_reference(
                        q, cache.keys[i], cache.values[i], read_rows, bias, self.scaling
                    )
                h = h + attn.o_proj(o.reshape(o.shape[0], -1))
                h = h + layer.mlp(layer.post_attention_layernorm(h))
            # inside the adapters' routing: lm_head may carry LoRA (train_unembed)
            return self.lm_head(self.norm(h))
        finally:
            if context is not None:
                context.set_gather_slots(None)

    # --- prefill --------------------------------------------------------------------------------

    def prefill(
        self,
        prompts: list[list[int]],
        block_tables: torch.Tensor,
        slot_ids: list[int],
        every_position: dict[int, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Logits [n, V] of each prompt's last token; writes every prompt token's keys and values
        into the blocks of ``block_tables`` [n, max_blocks]. The logits of every position [len,
        V] of the prompts whose index is a key of ``every_position`` are put there (their
        scores: services/model/scoring.py)."""
        cache = self.cache
        device = block_tables.device
        n, width = len(prompts), max(len(p) for p in prompts)
        ids = torch.tensor([list(p) + [0] * (width - len(p)) for p in prompts], device=device)
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        positions = torch.arange(width, device=device).expand(n, width)
        real = positions < lengths.unsqueeze(1)
        rows = cache.rows(block_tables, positions)[real]
        h = self.embed(ids)
        cos, sin = self._rope(positions, h.dtype)
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        use = (
            self.lora.use(torch.tensor(slot_ids, dtype=torch.long))
            if self.lora is not None
            else nullcontext()
        )
        with use:
            for i, layer in enumerate(self.layers):
                attn = layer.self_attn
                q, k, v = self._qkv(attn, layer.input_layernorm(h), cos, sin)
                cache.write(i, rows, k[real], v[real])
                o = F.scaled_dot_product_attention(
                    q.transpose(1, 2),
                    k.transpose(1, 2),
                    v.transpose(1, 2),
                    is_causal=True,
                    scale=self.scaling,
                    enable_gqa=self.num_heads != self.num_kv_heads,
                )
                h = h + attn.o_proj(o.transpose(1, 2).reshape(n, width, -1))
                h = h + layer.mlp(layer.post_attention_layernorm(h))
            # inside the adapters' routing: lm_head may carry LoRA (train_unembed)
            last = self.lm_head(self.norm(h[torch.arange(n, device=device), lengths - 1]))
        if every_position is not None:
            for i in list(every_position):
                one = self.lora.use([slot_ids[i]]) if self.lora is not None else nullcontext()
                with one:
                    rows = self.lm_head(self.norm(h[i : i + 1, : len(prompts[i])]))
                every_position[i] = rows[0]
        return last
