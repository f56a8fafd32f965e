r"""GPU memory of each piece the planner predicts (megatron_rl_bi/memory.py), measured on the GPU
one piece at a time: weights, gradient buffer, optimizer state (fp32 main weights, then Adam's
moments after an update), the engine (KV cache and buffers), one packed micro-batch's forward
and backward (activations and LM head) without and with full recompute, and the LM head alone
(its chunks' forward and backward on final hidden states already in memory, which the plan's row
counts with their fp32 and bf16 copies: up to 6 bytes a hidden value above the measurement).
Each row: measured GiB, planned GiB, their ratio.

  python bench/memory.py --output results/bench_memory_NAME_h200.json --bench-memory-tokens 8192 \
      --bf16 --flash-attention-version 4 [pretrain_rl.py's model and engine flags]
"""

import argparse
import dataclasses
import json
import os
import sys

import torch
from megatron.core.utils import unwrap_model

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.report import peak_bytes, positive_int  # noqa: E402
from megatron_rl_bi import bi  # noqa: E402
from megatron_rl_bi.config import parse_rl_args, validate_installed_kernels  # noqa: E402
from megatron_rl_bi.config.from_args import (  # noqa: E402
    engine_config_from_args,
    levers_from_args,
    memory_run_from_args,
)
from megatron_rl_bi.distributed import initialize_distributed  # noqa: E402
from megatron_rl_bi.inference import Generator  # noqa: E402
from megatron_rl_bi.memory import GIB, Recompute, plan_memory  # noqa: E402
from megatron_rl_bi.models.build import build_model  # noqa: E402
from megatron_rl_bi.models.logprobs import forward_logprobs, head_logprobs  # noqa: E402
from megatron_rl_bi.optimizer import build_ddp_and_optimizer  # noqa: E402
from megatron_rl_bi.packing import pack_sequences  # noqa: E402
from megatron_rl_bi.reporting.provenance import provenance  # noqa: E402

FULL_RECOMPUTE = Recompute("full", "uniform", 1)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     add_help=False)
    parser.add_argument("--output", required=True, help="the report (JSON)")
    parser.add_argument("--bench-memory-tokens", type=positive_int, default=8192,
                        help="tokens of the packed micro-batch measured")
    parser.add_argument("--bench-memory-vocab", type=positive_int, default=151936, help="vocabulary size")
    return parser


def _allocated_by(action) -> tuple[object, int]:
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    result = action()
    torch.cuda.synchronize()
    return result, torch.cuda.memory_allocated() - before


def _micro_batch_peak(ddp, tokens: int, vocab: int, recompute: Recompute) -> int:
    """Peak memory above the start of one forward+backward of `tokens` packed tokens (4 sequences)."""
    config = ddp.config  # the model's TransformerConfig, which its blocks read at every forward
    config.recompute_granularity, config.recompute_method = recompute.granularity, recompute.method
    config.recompute_num_layers = recompute.num_layers if recompute.granularity else None
    generator = torch.Generator().manual_seed(0)
    batch = pack_sequences([torch.randint(0, vocab, (tokens // 4,), generator=generator).tolist()
                            for _ in range(4)]).to("cuda")
    return _backward_peak(ddp, lambda: forward_logprobs(ddp, batch))


def _head_peak(ddp, tokens: int, vocab: int) -> int:
    """Peak memory above the start of the LM head alone (forward+backward of its chunks) on
    `tokens` final hidden states: the micro-batch rows less the layers."""
    language_model = unwrap_model(ddp)
    generator = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(tokens, 1, language_model.config.hidden_size, device="cuda", generator=generator,
                         dtype=language_model.config.params_dtype, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,), device="cuda", generator=generator)
    return _backward_peak(ddp, lambda: head_logprobs(language_model, hidden, targets))


def _backward_peak(ddp, forward) -> int:
    """Peak memory above the start of `forward()`'s logprobs and their backward."""
    ddp.zero_grad_buffer()

    def forward_and_backward():
        logprobs, _ = forward()
        (-logprobs.sum()).backward()

    return peak_bytes(forward_and_backward)


def measure(args, tokens: int, vocab: int) -> dict[str, int]:
    measured = {}
    model, measured["weights"] = _allocated_by(lambda: build_model(args, vocab))
    (ddp, optimizer), both = _allocated_by(lambda: build_ddp_and_optimizer(args, model))
    measured["gradients"] = sum(buffer.grad_data.numel() * buffer.grad_data.element_size() for buffer in ddp.buffers)
    main_weights = both - measured["gradients"]
    _micro_batch_peak(ddp, 256, vocab, Recompute())  # gradients to update with
    _, moments = _allocated_by(optimizer.step)
    measured["optimizer"] = main_weights + moments
    for name, recompute in (("micro-batch, no recompute", Recompute()), ("micro-batch, full recompute", FULL_RECOMPUTE)):
        measured[name] = _micro_batch_peak(ddp, tokens, vocab, recompute)
    measured["LM head"] = _head_peak(ddp, tokens, vocab)
    _, measured["engine"] = _allocated_by(lambda: Generator(model, engine_config_from_args(args)))
    return measured


def planned(args, tokens: int, vocab: int) -> dict[str, int]:
    run = dataclasses.replace(memory_run_from_args(args, vocab, 1, torch.cuda.get_device_properties(0).total_memory),
                              micro_batch_tokens=tokens)
    levers = levers_from_args(args)
    rows = {}
    for name, recompute in (("micro-batch, no recompute", Recompute()), ("micro-batch, full recompute", FULL_RECOMPUTE)):
        plan = plan_memory(run, dataclasses.replace(levers, recompute=recompute))
        rows[name] = plan.item("activations").bytes + plan.item("LM head").bytes
    plan = plan_memory(run, levers)
    rows.update({name: plan.item(name).bytes for name in ("weights", "gradients", "optimizer", "LM head")})
    rows["engine"] = plan.item("KV cache + GDN states").bytes + plan.item("engine logits buffer").bytes
    return rows


def main() -> None:
    own, rest = build_parser().parse_known_args()
    args = parse_rl_args(rest + ["--inference-max-seq-length", str(own.bench_memory_tokens // 4)])
    validate_installed_kernels(args)
    initialize_distributed(args.seed, cuda_graphs=args.cuda_graph_impl == "local")
    with bi.batch_invariant(args.batch_invariant_mode):
        measured = measure(args, own.bench_memory_tokens, own.bench_memory_vocab)
    plan = planned(args, own.bench_memory_tokens, own.bench_memory_vocab)
    rows = [{"component": name, "measured_gib": measured[name] / GIB, "planned_gib": plan[name] / GIB,
             "planned_over_measured": plan[name] / measured[name] if measured[name] else None}
            for name in measured]
    for row in rows:
        print(f"{row['component']:30} measured {row['measured_gib']:8.3f} GiB  planned {row['planned_gib']:8.3f}",
              flush=True)
    with open(own.output, "w") as f:
        json.dump({**provenance(), "argv": rest, "tokens": own.bench_memory_tokens, "rows": rows}, f, indent=2)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
