"""Multi-adapter LoRA: one frozen base model, one LoRA adapter slot per run.

Every target ``nn.Linear`` y = W x + b (or transformers' ``Conv1D``, GPT-2's y = x W + b with W
stored [in, out]; see targets.py) becomes a ``MultiLoRALinear`` with ``n_adapters`` slots.
Slot s holds A_s in R^{R x in} and B_s in R^{out x R} (R = ``max_rank``), a rank r_s <= R and an
alpha_s. A token t of a sequence that uses slot s gets

    y_t = W x_t + b + (alpha_s / r_s) * B_s A_s x_t

and a token of slot -1 gets W x_t + b alone, bit for bit, which makes the base model the KL
reference policy at no extra memory. This is PEFT's LoRA (scaling lora_alpha / r, no dropout,
no rsLoRA, no DoRA); ``slot_state_dict`` exports a slot under PEFT's key names so PEFT and vLLM
load it as a plain adapter. A slot over a Conv1D has the same A [R, in] and B [out, R] as over
a Linear: only the base weight is stored transposed, which PEFT records as ``fan_in_fan_out``.

Rank below R. Rows r_s.. of A_s and columns r_s.. of B_s are zero, so the padded product equals
the rank-r_s one. They stay zero without a mask: dL/dA_s[j] = scale * (B_s[:, j]^T g) x^T vanishes
when column j of B_s is zero, dL/dB_s[:, j] = scale * g (A_s[j] x) vanishes when row j of A_s is
zero, and AdamW moves a parameter whose gradient and moments are zero by -lr * wd * 0 = 0.
``reset_slot`` and ``load_slot_state_dict`` write those zeros.

Computation. The shared ``AdapterContext`` sorts the adapter tokens by slot once per model
forward (see routing.py). Each layer gathers its input rows in that order, stacks A and B of the
slots actually used and runs one grouped matmul for A and one for B over the slot segments:

    H = grouped_mm(X_sorted, [A_s^T], offs)              # [N, R]
    Y = grouped_mm(H, [(alpha_s / r_s) * B_s^T], offs)    # [N, out]

then adds Y to the base output rows (index_add where some rows use no adapter). Departure from PEFT: the scale is folded
into the stacked B instead of the output, which changes only float rounding. Slots that no token
uses take no part in the graph, so their parameters get no gradient and an optimizer that owns
one slot's parameters never moves another slot.

Kernels. ``torch._grouped_mm`` needs rows aligned to 16 bytes (in, out and max_rank times the
element size); it runs on CPU for float32/bfloat16/float16 and on CUDA for bfloat16 on a
Hopper-class GPU. Elsewhere the layer pads the segments to the largest one and uses
``torch.bmm``, which gives the same result. On CPU the two cost about the same when every slot
has as many tokens as the others, and bmm loses as soon as they differ (it computes the padding),
which is the trainer's usual mix; so ``auto`` prefers grouped_mm. ``AdapterContext.kernel``
forces one.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Literal

import torch
from torch import nn

from schemas.config import DEFAULT_TARGET_MODULES
from services.model import lora_gather
from services.model.lora_segments import SegmentLoRA
from services.model.peft_io import peft_adapter_config
from services.model.routing import NO_ADAPTER, AdapterContext, Route
from services.model.targets import SUPPORTED_LAYERS, find_targets, is_conv1d, lora_dims

__all__ = [
    "DEFAULT_TARGET_MODULES",
    "NO_ADAPTER",
    "AdapterContext",
    "MultiLoRA",
    "MultiLoRALinear",
    "peft_key",
]

_GROUPED_MM_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def peft_key(module_name: str, matrix: str) -> str:
    """PEFT's saved key of ``matrix`` ('lora_A' or 'lora_B') of the module at ``module_name``."""
    return f"base_model.model.{module_name}.{matrix}.weight"


def _grouped_mm_fits(x: torch.Tensor, dims: Sequence[int], kernel: str) -> bool:
    if kernel != "auto":
        return kernel == "grouped_mm"
    # Every operand's rows must start on 16-byte boundaries, on every device.
    if any(d * x.element_size() % 16 for d in dims):
        return False
    if x.device.type == "cpu":
        return x.dtype in _GROUPED_MM_CPU_DTYPES
    if x.device.type == "cuda" and x.dtype == torch.bfloat16:
        return torch.cuda.get_device_capability(x.device) >= (9, 0)
    return False


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient.

    ``torch._grouped_mm``'s backward rejects a stride-0 gradient, which is what a caller's
    ``out.sum()`` produces; every other gradient passes through untouched (no copy).
    """

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad if grad.is_contiguous() else grad.contiguous()


class MultiLoRALinear(nn.Module):
    """A frozen ``nn.Linear`` or ``Conv1D`` plus ``n_adapters`` LoRA slots routed by an
    AdapterContext.

    Each slot owns two Parameters, ``lora_A[s]`` [max_rank, in] and ``lora_B[s]`` [out,
    max_rank], so each run's optimizer can own exactly its slot. Layers of one model share one
    context; a layer built without one gets its own.
    """

    def __init__(
        self,
        base: nn.Module,
        n_adapters: int,
        max_rank: int,
        context: AdapterContext | None = None,
    ) -> None:
        super().__init__()
        dims = lora_dims(base)
        if dims is None:
            raise TypeError(f"MultiLoRALinear wraps {SUPPORTED_LAYERS}, got {type(base)}")
        context = context if context is not None else AdapterContext(n_adapters, max_rank)
        if (context.n_adapters, context.max_rank) != (n_adapters, max_rank):
            raise ValueError(
                f"adapter context has {context.n_adapters} slots of max rank {context.max_rank}, "
                f"the layer wants {n_adapters} of max rank {max_rank}"
            )
        self.base_layer = base.requires_grad_(False)
        self.in_features, self.out_features = dims
        self.fan_in_fan_out = is_conv1d(base)
        """True over a Conv1D, whose weight is stored [in, out] (PEFT's ``fan_in_fan_out``)."""
        self.n_adapters = n_adapters
        self.max_rank = max_rank
        self.adapter_context = context
        weight: torch.Tensor = base.weight  # type: ignore[assignment]
        device, dtype = weight.device, weight.dtype
        self.lora_A = nn.ParameterList(
            nn.Parameter(torch.zeros(max_rank, self.in_features, device=device, dtype=dtype))
            for _ in range(n_adapters)
        )
        self.lora_B = nn.ParameterList(
            nn.Parameter(torch.zeros(self.out_features, max_rank, device=device, dtype=dtype))
            for _ in range(n_adapters)
        )
        self.stacked: lora_gather.StackedSlots | None = None
        """The slots stacked for the gather path (lora_gather.py); None until stacked."""

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"n_adapters={self.n_adapters}, max_rank={self.max_rank}"
        )

    @torch.no_grad()
    def reset_slot(self, idx: int, rank: int, generator: torch.Generator | None = None) -> None:
        """PEFT's initialisation at ``rank``: A kaiming-uniform(a=sqrt(5)), B zero, padding zero."""
        a_init = torch.empty(rank, self.in_features)
        nn.init.kaiming_uniform_(a_init, a=math.sqrt(5), generator=generator)
        self.load_slot(idx, a_init, torch.zeros(self.out_features, rank))

    @torch.no_grad()
    def load_slot(self, idx: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Set slot ``idx`` from A [r, in] and B [out, r]; the rows and columns past r get zero."""
        rank = a.shape[0]
        if not 1 <= rank <= self.max_rank or a.shape[1:] != (self.in_features,):
            raise ValueError(
                f"lora_A of shape {list(a.shape)} does not fit [r <= {self.max_rank}, "
                f"{self.in_features}]"
            )
        if tuple(b.shape) != (self.out_features, rank):
            raise ValueError(
                f"lora_B of shape {list(b.shape)}, expected [{self.out_features}, {rank}]"
            )
        lora_a, lora_b = self.lora_A[idx], self.lora_B[idx]
        lora_a.zero_()
        lora_b.zero_()
        lora_a[:rank].copy_(a)
        lora_b[:, :rank].copy_(b)
        lora_a.grad = None
        lora_b.grad = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_layer(x)
        if self.adapter_context.gather_slots is not None:
            return lora_gather.add_gathered(out, x, self)
        route = self.adapter_context.route(x)
        if route is None:
            return out
        x_rows = x.reshape(-1, self.in_features)
        if route.perm is not None:
            x_rows = x_rows.index_select(0, route.perm)
        dims = (self.in_features, self.out_features, self.max_rank)
        grouped = _grouped_mm_fits(x, dims, self.adapter_context.kernel)
        if grouped:
            weights = [self.lora_A[s] for s in route.slots] + [self.lora_B[s] for s in route.slots]
            delta = SegmentLoRA.apply(x_rows, route.offs, route.scale_rows(x.dtype), *weights)
        else:
            a = torch.stack([self.lora_A[s] for s in route.slots]).to(x.dtype)
            b = torch.stack([self.lora_B[s] for s in route.slots]) * route.scales.view(-1, 1, 1)
            delta = self._padded(x_rows, a, b.to(x.dtype), route)
        # Out of place. Adding into the base output in place would save no memory (a linear
        # layer keeps its input for backward, not its output, and the base output is freed
        # right after the sum), but autograd routes the gradient of an in-place update of a
        # view through an as_strided copy of the whole output gradient: one extra pass over
        # [tokens, out] per layer, 30% of the layer's backward on CPU.
        out_rows = out.reshape(-1, self.out_features)
        if route.perm is None:
            summed = out_rows + delta.to(out.dtype)
        else:
            summed = out_rows.index_add(0, route.perm, delta.to(out.dtype))
        summed = summed.view(out.shape)
        # SegmentLoRA makes its gradient contiguous itself; the padded path's bmm needs it done.
        return _ContiguousGrad.apply(summed) if summed.requires_grad and not grouped else summed

    @staticmethod
    def _padded(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, route: Route) -> torch.Tensor:
        num_slots, width, rows = len(route.slots), route.max_count, route.padded_rows()
        padded = x.new_zeros(num_slots * width, x.shape[1]).index_copy(0, rows, x)
        h = torch.bmm(padded.view(num_slots, width, -1), a.transpose(1, 2))
        y = torch.bmm(h, b.transpose(1, 2))
        return y.reshape(num_slots * width, -1).index_select(0, rows)


class MultiLoRA:
    """The multi-LoRA layers of one model and the per-slot operations a run needs.

    ``attach`` puts the layers in place; afterwards the trainer creates each run's optimizer from
    ``slot_parameters(idx)``, resets a slot when its run starts, exports it with
    ``slot_state_dict`` and chooses the slot of every sequence with ``use`` / ``set_slot_ids``.
    """

    kind: Literal["lora"] = "lora"
    """what a slot is published and checkpointed as (``WeightsReady.kind``)"""

    def __init__(
        self,
        model: nn.Module,
        layers: Mapping[str, MultiLoRALinear],
        context: AdapterContext,
        target_modules: Sequence[str],
    ) -> None:
        self.model = model
        self.layers = dict(layers)
        self.context = context
        self.target_modules = tuple(target_modules)

    @classmethod
    def attach(
        cls,
        model: nn.Module,
        n_adapters: int,
        max_rank: int,
        target_modules: Sequence[str] | None = None,
    ) -> MultiLoRA:
        """Replace the target layers of ``model`` in place and freeze every base parameter.

        A module is a target when its name equals an entry or ends with ``.`` + entry, as in
        PEFT; every target must be an ``nn.Linear`` or a ``Conv1D`` (ValueError naming the
        module otherwise). ``target_modules`` None takes the family's default
        (:func:`services.model.families.default_target_modules` of ``model.config``; a model
        without a config gets ``DEFAULT_TARGET_MODULES``). Every slot starts initialised at
        ``max_rank`` with alpha = max_rank.
        """
        if any(isinstance(m, MultiLoRALinear) for m in model.modules()):
            raise ValueError("the model already carries multi-LoRA layers")
        if target_modules is None:
            target_modules = _family_targets(model)
        context = AdapterContext(n_adapters, max_rank)
        found = find_targets(model, target_modules)
        model.requires_grad_(False)
        layers = {}
        for name, module in found:
            parent_name, _, child = name.rpartition(".")
            layer = MultiLoRALinear(module, n_adapters, max_rank, context)
            setattr(model.get_submodule(parent_name), child, layer)
            layers[name] = layer
        lora = cls(model, layers, context, target_modules)
        for idx in range(n_adapters):
            lora.reset_slot(idx, max_rank, float(max_rank))
        return lora

    # --- shape ---------------------------------------------------------------------------------

    @property
    def n_adapters(self) -> int:
        return self.context.n_adapters

    @property
    def fan_in_fan_out(self) -> bool:
        """Whether the wrapped layers store their weight [in, out] (Conv1D): what a published
        ``adapter_config.json`` must say for PEFT to load the adapter as it is."""
        return any(layer.fan_in_fan_out for layer in self.layers.values())

    def adapter_config(self, idx: int, base_model_path: str = "") -> dict[str, object]:
        """The ``adapter_config.json`` of slot ``idx`` as it stands (rank, alpha, targets)."""
        return peft_adapter_config(
            self.slot_rank(idx),
            self.context.alpha(idx),
            self.target_modules,
            base_model_path,
            fan_in_fan_out=self.fan_in_fan_out,
        )

    @property
    def max_rank(self) -> int:
        return self.context.max_rank

    def slot_rank(self, idx: int) -> int:
        return self.context.rank(idx)

    # --- choosing slots ------------------------------------------------------------------------

    def set_slot_ids(self, slot_ids: torch.Tensor | Sequence[int] | None) -> None:
        """Slot of each sequence ([B]) or token ([B, T]) of the next forwards; -1 is the base."""
        self.context.set_slot_ids(slot_ids)

    @contextmanager
    def use(self, slot_ids: torch.Tensor | Sequence[int] | None) -> Iterator[None]:
        """Run the block with these slot ids, then restore the previous ones."""
        previous = self.context.slot_ids
        self.context.set_slot_ids(slot_ids)
        try:
            yield
        finally:
            self.context.set_slot_ids(previous)

    # --- one slot ------------------------------------------------------------------------------

    def reset_slot(self, idx: int, rank: int, alpha: float, seed: int | None = None) -> None:
        """Re-initialise slot ``idx`` as a fresh PEFT adapter: it then behaves as the base model.

        With a seed the initialisation is reproducible; without, it draws from torch's global RNG.
        """
        self.context.configure_slot(idx, rank, alpha)
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        for layer in self.layers.values():
            layer.reset_slot(idx, rank, generator)
        lora_gather.refresh_slots(self, [idx])

    def slot_named_parameters(self, idx: int) -> list[tuple[str, nn.Parameter]]:
        """Slot ``idx``'s parameters under their names in ``model.named_parameters()``."""
        self.context.check_slot(idx)
        named = []
        for name, layer in self.layers.items():
            named.append((f"{name}.lora_A.{idx}", layer.lora_A[idx]))
            named.append((f"{name}.lora_B.{idx}", layer.lora_B[idx]))
        return named

    def slot_parameters(self, idx: int) -> list[nn.Parameter]:
        return [p for _, p in self.slot_named_parameters(idx)]

    def slot_state_dict(self, idx: int) -> dict[str, torch.Tensor]:
        """Slot ``idx`` under PEFT key names, trimmed to its rank, as detached CPU copies."""
        rank = self.slot_rank(idx)
        state: dict[str, torch.Tensor] = {}
        for name, layer in self.layers.items():
            a = layer.lora_A[idx].detach()[:rank]
            b = layer.lora_B[idx].detach()[:, :rank]
            state[peft_key(name, "lora_A")] = a.to("cpu", copy=True).contiguous()
            state[peft_key(name, "lora_B")] = b.to("cpu", copy=True).contiguous()
        return state

    def load_slot_state_dict(
        self, idx: int, state_dict: Mapping[str, torch.Tensor], rank: int, alpha: float
    ) -> None:
        """The inverse of ``slot_state_dict``; checks every key and shape before changing anything."""
        self.context.check_slot(idx)
        if not 1 <= rank <= self.max_rank:
            raise ValueError(f"rank {rank} of slot {idx} must be in 1..{self.max_rank} (max_rank)")
        expected = {}
        for name, layer in self.layers.items():
            expected[peft_key(name, "lora_A")] = (rank, layer.in_features)
            expected[peft_key(name, "lora_B")] = (layer.out_features, rank)
        missing = sorted(set(expected) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(expected))
        if missing or unexpected:
            raise ValueError(
                f"adapter for slot {idx} does not fit this model: "
                f"missing keys {preview_keys(missing)}, unexpected keys {preview_keys(unexpected)}"
            )
        for key, shape in expected.items():
            got = tuple(state_dict[key].shape)
            if got != shape:
                raise ValueError(
                    f"adapter for slot {idx}: {key} has shape {list(got)}, expected {list(shape)} "
                    f"(rank {rank})"
                )
        self.context.configure_slot(idx, rank, alpha)
        for name, layer in self.layers.items():
            layer.load_slot(
                idx, state_dict[peft_key(name, "lora_A")], state_dict[peft_key(name, "lora_B")]
            )
        lora_gather.refresh_slots(self, [idx])

    def stack_slots(self) -> None:
        """Keep stacked copies of every slot for the gather path (see lora_gather.py)."""
        lora_gather.stack_slots(self)


def _family_targets(model: nn.Module) -> tuple[str, ...]:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if not model_type:
        return DEFAULT_TARGET_MODULES
    from services.model.families import default_target_modules

    return default_target_modules(model_type)


def preview_keys(keys: list[str], limit: int = 4) -> str:
    """The first ``limit`` of ``keys`` and how many more, for an error message."""
    if not keys:
        return "none"
    shown = ", ".join(keys[:limit])
    return f"{shown} (+{len(keys) - limit} more)" if len(keys) > limit else shown
