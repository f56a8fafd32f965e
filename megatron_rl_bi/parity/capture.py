"""One side's activations (the engine's or the trainer's), captured by forward hooks on the shared
module, each row keyed by (sequence, position): the two sides' rows of one token meet whatever
batch each computed it in (a decode step of many requests, a packed micro-batch of a few).

Components, in the order a forward runs them: the embedding; in each decoder layer its input
norm, its mixer (self-attention, or GDN), its pre-MLP norm and its MLP (or MoE) where the layer
has them (not an IdentityOp), then the layer's output; the final norm; the LM head's logits.
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.utils import unwrap_model

RowKey = tuple[int, int]
"""(sequence, position): the index of the request (engine) or of the packed sequence counted over
every micro-batch (trainer), which are the same generation, and the token's position in it."""

RowKeys = Callable[[tuple, dict], tuple[list[RowKey | None], list[int | None]]]
"""Called at the start of each forward with its args and kwargs: the key of each row it is about
to compute (None for a padding row) and the token id each row feeds."""

LAYER_PARTS = ("input_layernorm", "self_attention", "pre_mlp_layernorm", "mlp")


def components(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The hooked modules by component name ("embedding", "layers.3.mlp", "layers.3",
    "final_norm", "output_layer"), in forward order."""
    language_model = unwrap_model(model)
    decoder = language_model.decoder
    found = {"embedding": language_model.embedding}
    for index, layer in enumerate(decoder.layers):
        for part in LAYER_PARTS:
            module = getattr(layer, part, None)
            if module is not None and not isinstance(module, IdentityOp):
                found[f"layers.{index}.{part}"] = module
        found[f"layers.{index}"] = layer
    # GPTModel's TransformerBlock calls it final_layernorm, HybridModel's stack final_norm
    final_norm = getattr(decoder, "final_layernorm", None) or getattr(decoder, "final_norm", None)
    if final_norm is not None:
        found["final_norm"] = final_norm
    found["output_layer"] = language_model.output_layer
    return found


def _rows(name: str, output) -> torch.Tensor:
    """A module's output ([tokens, 1, width], or a tuple led by it) as CPU rows [tokens, width]."""
    tensor = output[0] if isinstance(output, tuple) else output
    if tensor.dim() != 3 or tensor.shape[1] != 1:
        raise RuntimeError(f"{name} returned shape {tuple(tensor.shape)}: the doctor reads packed "
                           "[tokens, 1, width] activations (one GPU, no sequence parallelism)")
    return tensor[:, 0].detach().to("cpu", copy=True)


@dataclass
class Captured:
    """One component's rows on one side."""

    module: str  # the module's class, for the report
    keys: list[RowKey]
    rows: torch.Tensor  # [len(keys), width], the module's output dtype


class Capture:
    """`with Capture(model, row_keys) as side:` hooks every component of `model` while the block
    runs; `side.captured()` then holds each component's rows and keys, `side.tokens` the token
    each key fed. A module's calls within one forward (the trainer's LM head runs in chunks,
    after the decoder returns) are joined in call order."""

    def __init__(self, model: torch.nn.Module, row_keys: RowKeys):
        self.model, self.row_keys = model, row_keys
        self.parts = components(model)
        self.rows = {name: [] for name in self.parts}
        self.keys = {name: [] for name in self.parts}
        self.tokens: dict[RowKey, int] = {}
        self._pending = None  # (keys of the forward, {component: [row chunks]})
        self._handles = []

    def __enter__(self) -> "Capture":
        self._handles.append(self.model.register_forward_pre_hook(self._start, with_kwargs=True))
        for name, module in self.parts.items():
            self._handles.append(module.register_forward_hook(functools.partial(self._keep, name)))
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if exc_type is None:
            self._commit()

    def _start(self, module, args, kwargs) -> None:
        self._commit()
        keys, tokens = self.row_keys(args, kwargs)
        self.tokens.update((key, token) for key, token in zip(keys, tokens) if key is not None)
        self._pending = (keys, {})

    def _keep(self, name: str, module, inputs, output) -> None:
        if self._pending is None:
            raise RuntimeError(f"{name} ran outside a forward of the captured model")
        self._pending[1].setdefault(name, []).append(_rows(name, output))

    def _commit(self) -> None:
        if self._pending is None:
            return
        keys, outputs = self._pending
        self._pending = None
        kept = [i for i, key in enumerate(keys) if key is not None]
        for name, chunks in outputs.items():
            rows = torch.cat(chunks)
            if rows.shape[0] != len(keys):
                raise RuntimeError(f"{name} gave {rows.shape[0]} rows in a forward of {len(keys)} tokens")
            self.rows[name].append(rows[kept])
            self.keys[name].extend(keys[i] for i in kept)

    def captured(self) -> dict[str, Captured]:
        """Each component that ran, in forward order."""
        return {name: Captured(type(module).__name__, self.keys[name], torch.cat(self.rows[name]))
                for name, module in self.parts.items() if self.rows[name]}

    def check_tokens(self, sequences: list[list[int]], side: str) -> None:
        """Every key names the token its row fed: a wrong reading of the batch layout raises here
        rather than comparing rows of different tokens."""
        for (sequence, position), token in self.tokens.items():
            expected = sequences[sequence][position] if sequence < len(sequences) and position < len(
                sequences[sequence]) else None
            if token != expected:
                raise RuntimeError(f"the {side}'s row keyed (sequence {sequence}, position {position}) fed "
                                   f"token {token}, but that position holds {expected}: its row keys are wrong")


class TrainerRows:
    """Row keys of the trainer's packed forwards (`forward_logprobs`): the generations in order,
    micro-batch after micro-batch (`packing.micro_batches` keeps them consecutive)."""

    def __init__(self):
        self.next_sequence = 0

    def __call__(self, args: tuple, kwargs: dict) -> tuple[list[RowKey], list[int]]:
        positions = kwargs["position_ids"][0].tolist()
        bounds = kwargs["packed_seq_params"].cu_seqlens_q.tolist()
        keys = [(self.next_sequence + sequence, positions[row])
                for sequence, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])) for row in range(start, end)]
        self.next_sequence += len(bounds) - 1
        return keys, kwargs["input_ids"][0].tolist()


def engine_row_keys(context) -> tuple[list[RowKey | None], list[int | None]]:
    """Row keys of the engine's forward about to run, from megatron-core's DynamicInferenceContext
    (its CPU bookkeeping of the step): (request id, position) for each active token, None for
    the padding rows after them. Request ids are prompt indices for a fresh `Generator.generate`."""
    active, padded = context.active_token_count, context.padded_active_token_count
    requests = context.request_ids[context.token_to_request_idx[:active].long()].tolist()
    positions = context.token_to_pos_ids[:active].tolist()
    padding = [None] * (padded - active)
    return list(zip(requests, positions)) + padding, context.token_to_input_ids[:active].tolist() + padding
