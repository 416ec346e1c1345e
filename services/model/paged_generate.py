"""Continuous batching over the paged KV cache: the torch engine's generator.

Sequences join and leave between decode steps. :meth:`PagedGenerator.add` admits a group of
sequences (one request's) when rows and KV blocks are free: it takes each a row of the decode
state and the blocks for its prompt plus its ``max_tokens``, prefills the prompts together and
samples each first token. :meth:`PagedGenerator.step` decodes one token for every row and
returns the sequences that finished; a finished sequence gives its row and blocks back at once.

The decode state lives on the device in buffers of ``max_seqs`` rows that never move: the last
token, its position, the adapter slot, the block table, the sampling settings and each row's
uniform numbers. A step computes the first ``bucket`` rows (the active span rounded up, see
decode_graphs.py), samples on the device and feeds the tokens back into the state itself, so
the host's only work is one copy of the new tokens and log-probabilities (the step's single
synchronisation) and the bookkeeping of what finished. Rows left empty by finished sequences
compute garbage on the scratch block until a new sequence takes them or the active rows are
compacted into a smaller bucket.

Each row also carries its ``top_k``; a step computes the most likely tokens of every row (the
row's ``top_logprobs`` of them are kept) only while some active row asks for them, and a
prompt asked to be scored gets the logits of all its positions from its prefill (scoring.py).

Sampling is the static sampler's (sampling.py), with the same streams: each sequence's uniform
numbers are drawn up front from its seeded CPU generator (``torch.rand(max_tokens)`` gives the
numbers that many one-at-a-time draws give) and read on the device by step. A sequence therefore
gets the same tokens here as from :func:`services.model.sampling.generate_batch`, whatever
shares its batch, up to float rounding of its logits.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from services.model.decode_graphs import DecodeGraphs, bucket_for
from services.model.decoder import PagedDecoder
from services.model.lora import MultiLoRA
from services.model.paged_kv import SCRATCH_BLOCK, PagedKVCache
from services.model.sampling import (
    GREEDY,
    SequenceOutput,
    SequenceSpec,
    StepHook,
    _generator,
    draw,
    model_device,
    sampled_logprobs,
)
from services.model.scoring import MAX_TOP, TopEntries, prompt_scores, rows_of


@dataclass(eq=False)
class ActiveSequence:
    """A sequence the generator holds: its spec, output so far, row and KV blocks."""

    spec: SequenceSpec
    output: SequenceOutput
    row: int
    blocks: list[int]
    tag: Any = None


class _State:
    """The decode state's device buffers, ``rows`` rows each (see the module docstring)."""

    def __init__(self, rows: int, pages: int, width: int, device: torch.device) -> None:
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slot_ids = torch.full((rows,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.full(
            (rows, pages), SCRATCH_BLOCK, dtype=torch.int32, device=device
        )
        self.temperature = torch.ones(rows, dtype=torch.float32, device=device)
        self.top_p = torch.ones(rows, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(rows, dtype=torch.long, device=device)
        self.uniforms = torch.zeros(rows, width, dtype=torch.float32, device=device)
        self.drawn = torch.zeros(rows, dtype=torch.long, device=device)
        self.out_tokens = torch.zeros(rows, dtype=torch.long, device=device)
        self.out_logprobs = torch.zeros(rows, dtype=torch.float32, device=device)
        self.out_top_ids = torch.zeros(rows, MAX_TOP, dtype=torch.long, device=device)
        self.out_top_logprobs = torch.zeros(rows, MAX_TOP, dtype=torch.float32, device=device)

    def per_row(self) -> list[torch.Tensor]:
        return [
            self.input_ids, self.positions, self.slot_ids, self.block_tables, self.temperature,
            self.top_p, self.top_k, self.uniforms, self.drawn,
        ]  # fmt: skip


class PagedGenerator:
    """Continuous-batching generation for one model (see the module docstring)."""

    def __init__(
        self,
        model: Any,
        lora: MultiLoRA | None,
        *,
        eos_ids: Collection[int],
        max_seqs: int = 256,
        cache_tokens: int = 16384,
        block_size: int = 16,
        cuda_graphs: bool | None = None,
    ) -> None:
        config = model.config
        self.device = model_device(model)
        self.dtype = next(model.parameters()).dtype
        self.eos = frozenset(int(t) for t in eos_ids)
        self.max_seqs = max_seqs
        self.block_size = block_size
        num_blocks = -(-cache_tokens // block_size) + max_seqs + 1
        max_positions = int(getattr(config, "max_position_embeddings", 0) or cache_tokens)
        self.max_seq_len = min(max_positions, cache_tokens)
        self.lora = lora
        if lora is not None and next(iter(lora.layers.values())).stacked is None:
            lora.stack_slots()
        head_dim = int(model.model.layers[0].self_attn.head_dim)
        self.cache = PagedKVCache(
            num_layers=int(config.num_hidden_layers),
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=int(config.num_key_value_heads),
            head_dim=head_dim,
            device=self.device,
            dtype=self.dtype,
        )
        self.decoder = PagedDecoder(model, lora, self.cache)
        self.pages = self.cache.blocks_for(self.max_seq_len)
        self._width = 64
        self.state = _State(max_seqs, self.pages, self._width, self.device)
        self.rows: list[ActiveSequence | None] = [None] * max_seqs
        use_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.graphs = DecodeGraphs(self._decode_step, enabled=use_graphs)
        pin = self.device.type == "cuda"
        self._host_tokens = torch.zeros(max_seqs, dtype=torch.long, pin_memory=pin)
        self._host_logprobs = torch.zeros(max_seqs, dtype=torch.float32, pin_memory=pin)
        self.num_steps = 0

    # --- what it holds ------------------------------------------------------------------------

    @property
    def active(self) -> list[ActiveSequence]:
        return [seq for seq in self.rows if seq is not None]

    @property
    def busy_slots(self) -> set[int]:
        return {seq.spec.slot for seq in self.rows if seq is not None}

    def blocks_needed(self, specs: Sequence[SequenceSpec]) -> int:
        return sum(self.cache.blocks_for(len(s.prompt_ids) + s.max_tokens) for s in specs)

    def check(self, specs: Sequence[SequenceSpec], together: bool = True) -> None:
        """ValueError when ``specs`` could never be admitted (``together``: in one :meth:`add`),
        however long they waited."""
        if together and len(specs) > self.max_seqs:
            raise ValueError(f"{len(specs)} sequences in one request, at most {self.max_seqs}")
        for spec in specs:
            if not spec.prompt_ids:
                raise ValueError("every prompt needs at least one token (start it with <bos>)")
            if spec.max_tokens < 1:
                raise ValueError(f"max_tokens must be at least 1, got {spec.max_tokens}")
            if not 0 <= spec.top_logprobs <= MAX_TOP:
                raise ValueError(f"top_logprobs must be 0..{MAX_TOP}, got {spec.top_logprobs}")
            if len(spec.prompt_ids) + spec.max_tokens > self.max_seq_len:
                raise ValueError(
                    f"a prompt of {len(spec.prompt_ids)} tokens plus {spec.max_tokens} new ones "
                    f"exceeds the {self.max_seq_len} tokens a sequence may hold here"
                )
        needed = self.blocks_needed(specs) if together else 0
        if needed > self.cache.num_blocks - 1:
            raise ValueError(
                f"{len(specs)} sequences need {self.blocks_needed(specs)} KV blocks of "
                f"{self.block_size} tokens, the cache holds {self.cache.num_blocks - 1}"
            )

    def fits(self, specs: Sequence[SequenceSpec]) -> bool:
        free_rows = sum(seq is None for seq in self.rows)
        return len(specs) <= free_rows and (
            self.blocks_needed(specs) <= self.cache.allocator.num_free
        )

    # --- joining ----------------------------------------------------------------------------

    @torch.inference_mode()
    def add(
        self, specs: Sequence[SequenceSpec], tags: Sequence[Any] | None = None
    ) -> list[ActiveSequence]:
        """Admit ``specs`` (they must fit): prefill them and sample their first tokens.

        Returns one ActiveSequence per spec (carrying ``tags[i]``); those already finished (a
        stop token first, or ``max_tokens`` 1) hold no row any more.
        """
        self.check(specs)
        if not self.fits(specs):
            raise MemoryError("not enough free rows or KV blocks for these sequences")
        width = max(s.max_tokens for s in specs)
        if width > self._width:
            self._grow_uniforms(width)
        free = [r for r, seq in enumerate(self.rows) if seq is None][: len(specs)]
        table = torch.full((len(specs), self.pages), SCRATCH_BLOCK, dtype=torch.int32)
        uniforms = torch.zeros(len(specs), self._width)
        seqs = []
        for i, (spec, row) in enumerate(zip(specs, free, strict=True)):
            blocks = self.cache.allocator.allocate(
                self.cache.blocks_for(len(spec.prompt_ids) + spec.max_tokens)
            )
            table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            if spec.temperature > GREEDY:
                uniforms[i, : spec.max_tokens] = torch.rand(
                    spec.max_tokens, generator=_generator(spec.seed)
                )
            seq = ActiveSequence(spec, SequenceOutput(), row, blocks, tags[i] if tags else None)
            self.rows[row] = seq
            seqs.append(seq)
        st, device = self.state, self.device
        rows_t = torch.tensor(free, device=device)
        st.block_tables.index_copy_(0, rows_t, table.to(device))
        st.uniforms.index_copy_(0, rows_t, uniforms.to(device))
        st.slot_ids.index_copy_(0, rows_t, torch.tensor([s.slot for s in specs], device=device))
        temperature = torch.tensor([s.temperature for s in specs], device=device)
        top_p = torch.tensor([s.top_p for s in specs], device=device)
        top_k = torch.tensor([s.top_k for s in specs], dtype=torch.long, device=device)
        st.temperature.index_copy_(0, rows_t, temperature)
        st.top_p.index_copy_(0, rows_t, top_p)
        st.top_k.index_copy_(0, rows_t, top_k)
        scored = {i: torch.empty(0) for i, s in enumerate(specs) if s.score_prompt}
        logits = self.decoder.prefill(
            [list(s.prompt_ids) for s in specs],
            table.to(device),
            [s.slot for s in specs],
            every_position=scored,
        )
        for i, rows in scored.items():
            spec, out = specs[i], seqs[i].output
            out.prompt_logprobs, top = prompt_scores(rows, spec.prompt_ids, spec.top_logprobs)
            out.prompt_top_logprobs = top if spec.top_logprobs else None
        filtered = any(s.top_p < 1.0 or s.top_k > 0 for s in specs)
        logprobs_BV = sampled_logprobs(logits, temperature, top_p, filtered, top_k)
        tokens, logprobs = draw(logprobs_BV, temperature, uniforms[:, 0].to(device))
        k = max(s.top_logprobs for s in specs)
        tops = None
        if k:
            values, ids = logprobs_BV.topk(min(k, logprobs_BV.shape[-1]), dim=-1)
            tops = rows_of(ids.tolist(), values.tolist(), k)
        st.input_ids.index_copy_(0, rows_t, tokens)
        prompt_lengths = torch.tensor([len(s.prompt_ids) for s in specs], device=device)
        st.positions.index_copy_(0, rows_t, prompt_lengths)
        st.drawn.index_fill_(0, rows_t, 1)
        self._record(seqs, tokens.tolist(), logprobs.tolist(), tops)
        return seqs

    def _grow_uniforms(self, width: int) -> None:
        """Wider uniform rows for a longer ``max_tokens``: new buffer, so captured graphs go."""
        grown = torch.zeros(self.max_seqs, width, dtype=torch.float32, device=self.device)
        grown[:, : self._width] = self.state.uniforms
        self.state.uniforms = grown
        self._width = width
        self.graphs.clear()

    # --- decoding ---------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[ActiveSequence]:
        """Decode one token for every active sequence; returns those that finished."""
        span = max((r + 1 for r, seq in enumerate(self.rows) if seq is not None), default=0)
        if not span:
            return []
        count = sum(seq is not None for seq in self.rows)
        if bucket_for(count, self.max_seqs) < bucket_for(span, self.max_seqs):
            self._compact()
            span = count
        bucket = bucket_for(span, self.max_seqs)
        live = [seq for seq in self.rows[:span] if seq is not None]
        nucleus = any(seq.spec.top_p < 1.0 or seq.spec.top_k > 0 for seq in live)
        top = any(seq.spec.top_logprobs > 0 for seq in live)
        pages: int | None = None
        if not self.decoder.triton_attention:
            longest = max(
                len(seq.spec.prompt_ids) + len(seq.output.token_ids)
                for seq in self.rows[:span]
                if seq is not None
            )
            # A captured step reads a fixed number of blocks: round up to a power of two.
            pages = min(self.pages, bucket_for(self.cache.blocks_for(longest), 1 << 30))
        self.graphs.run((bucket, nucleus, pages, top))
        self.num_steps += 1
        st = self.state
        self._host_tokens[:bucket].copy_(st.out_tokens[:bucket], non_blocking=True)
        self._host_logprobs[:bucket].copy_(st.out_logprobs[:bucket], non_blocking=True)
        top_rows = None
        if top:  # rare: copied only while a row asks for alternatives
            top_rows = (st.out_top_ids[:bucket].cpu(), st.out_top_logprobs[:bucket].cpu())
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        tokens = self._host_tokens[:bucket].tolist()
        logprobs = self._host_logprobs[:bucket].tolist()
        active = [seq for seq in self.rows[:span] if seq is not None]
        tops = None
        if top_rows is not None:
            ids, values = top_rows[0].tolist(), top_rows[1].tolist()
            tops = rows_of([ids[s.row] for s in active], [values[s.row] for s in active], MAX_TOP)
        return self._record(
            active, [int(tokens[s.row]) for s in active], [logprobs[s.row] for s in active], tops
        )

    def _decode_step(self, key: Hashable) -> None:
        bucket, nucleus, pages, top = cast(tuple[int, bool, int | None, bool], key)
        st = self.state
        lora_slots = st.slot_ids[:bucket] if self.lora is not None else None
        logits = self.decoder.decode(
            st.input_ids[:bucket],
            st.positions[:bucket],
            st.block_tables[:bucket],
            lora_slots,
            pages,
        )
        drawn = st.drawn[:bucket].clamp(max=self._width - 1).unsqueeze(1)
        uniform = st.uniforms[:bucket].gather(1, drawn).squeeze(1)
        logprobs_BV = sampled_logprobs(
            logits, st.temperature[:bucket], st.top_p[:bucket], nucleus, st.top_k[:bucket]
        )
        tokens, logprobs = draw(logprobs_BV, st.temperature[:bucket], uniform)
        if top:
            values, ids = logprobs_BV.topk(min(MAX_TOP, logprobs_BV.shape[-1]), dim=-1)
            st.out_top_ids[:bucket, : ids.shape[1]].copy_(ids)
            st.out_top_logprobs[:bucket, : values.shape[1]].copy_(values)
        st.out_tokens[:bucket].copy_(tokens)
        st.out_logprobs[:bucket].copy_(logprobs)
        st.input_ids[:bucket].copy_(tokens)
        st.positions[:bucket].add_(1)
        st.drawn[:bucket].add_(1)

    def _record(
        self,
        seqs: list[ActiveSequence],
        tokens: list[int],
        logprobs: list[float],
        tops: list[TopEntries] | None = None,
    ) -> list[ActiveSequence]:
        finished = []
        for i, (seq, token, logprob) in enumerate(zip(seqs, tokens, logprobs, strict=True)):
            out = seq.output
            out.token_ids.append(token)
            out.logprobs.append(float(logprob))
            if seq.spec.top_logprobs and tops is not None:
                out.top_logprobs.append(tops[i][: seq.spec.top_logprobs])
            if token in self.eos and not seq.spec.ignore_eos:
                out.finish_reason = "stop"
            elif len(out.token_ids) >= seq.spec.max_tokens:
                out.finish_reason = "length"
            else:
                continue
            finished.append(seq)
        if finished:
            self._release(finished)
        return finished

    def _release(self, finished: list[ActiveSequence]) -> None:
        rows = [seq.row for seq in finished]
        for seq in finished:
            self.cache.allocator.release(seq.blocks)
            self.rows[seq.row] = None
        rows_t = torch.tensor(rows, device=self.device)
        st = self.state
        st.block_tables.index_fill_(0, rows_t, SCRATCH_BLOCK)
        st.positions.index_fill_(0, rows_t, 0)
        st.slot_ids.index_fill_(0, rows_t, -1)

    def _compact(self) -> None:
        """Move the active rows to the front, keeping their order, so a smaller bucket serves."""
        active = [r for r, seq in enumerate(self.rows) if seq is not None]
        order = torch.tensor(active, device=self.device)
        for buffer in self.state.per_row():
            buffer[: len(active)] = buffer.index_select(0, order)
        moved = [self.rows[r] for r in active]
        self.rows = [None] * self.max_seqs
        for new_row, seq in enumerate(moved):
            assert seq is not None
            seq.row = new_row
            self.rows[new_row] = seq
        holes = torch.arange(len(active), max(active) + 1, device=self.device)
        st = self.state
        st.block_tables.index_fill_(0, holes, SCRATCH_BLOCK)
        st.positions.index_fill_(0, holes, 0)
        st.slot_ids.index_fill_(0, holes, -1)

    def release(self, seqs: Sequence[ActiveSequence]) -> None:
        """Stop ``seqs`` before they finish (their caller gave up): their rows and blocks are
        free for the next :meth:`add`."""
        held = [seq for seq in seqs if self.rows[seq.row] is seq]
        if held:
            self._release(held)

    def reset(self) -> None:
        """Drop every sequence (after a failed step), giving back all rows and blocks."""
        held = self.active
        if held:
            self._release(held)

    # --- everything at once -------------------------------------------------------------------

    def generate(
        self, specs: Sequence[SequenceSpec], step_hook: StepHook | None = None
    ) -> list[SequenceOutput]:
        """Generate every sequence of ``specs``, outputs in their order: the sequences join as
        rows and blocks free up, and ``step_hook(busy_slots)`` runs between decode steps."""
        self.check(specs, together=False)
        pending = list(enumerate(specs))
        outputs: list[SequenceOutput | None] = [None] * len(specs)
        first = True
        while pending or self.active:
            if not first and step_hook is not None:
                step_hook(self.busy_slots)
            first = False
            take, rows, blocks = 0, sum(seq is None for seq in self.rows), 0
            free_blocks = self.cache.allocator.num_free
            while take < len(pending) and take < rows:
                blocks += self.blocks_needed([pending[take][1]])
                if blocks > free_blocks:
                    break
                take += 1
            if take:
                batch, pending = pending[:take], pending[take:]
                for (i, _), seq in zip(batch, self.add([s for _, s in batch]), strict=True):
                    outputs[i] = seq.output
            if self.active:
                self.step()
        return [o if o is not None else SequenceOutput() for o in outputs]
