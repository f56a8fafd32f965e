"""The parity doctor: where engine and trainer part. The engine generates with every component
hooked (`capture.Capture`), the trainer recomputes the same tokens hooked too, and each
component's rows are compared at the positions the engine computed, prefill and decode rows
alike; the logprobs (the `bit_wise/*` comparison) close the table. The first component with a
differing row is where the two sides part: everything after it inherits the difference.
"""

import dataclasses
from dataclasses import asdict, dataclass

import torch

from megatron_rl_bi.inference import Generation, Generator, Sampling
from megatron_rl_bi.packing import pack_completions
from megatron_rl_bi.parity.capture import Capture, Captured, RowKey, TrainerRows, engine_row_keys
from megatron_rl_bi.parity.harness import compared_metrics, trainer_vs_engine

LOGPROBS = "logprobs"
UNMASKED = "logprobs without the reported mask"
REPORTED_MASK = "reported_mask"


@dataclass
class ComponentDiff:
    """One component's engine rows against the trainer's rows of the same tokens."""

    component: str
    module: str
    rows: int  # rows compared
    rows_different: int  # rows whose bits differ anywhere
    prefill_rows_different: int  # of them, rows of prompt tokens (the engine's prefill)
    decode_rows_different: int  # and rows of generated tokens (its decode steps)
    max_abs_diff: float
    mean_abs_diff: float  # over every element of the rows compared


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(values: torch.Tensor) -> torch.Tensor:
    return values.contiguous().view(_SAME_SIZE_INT[values.element_size()])


def diff_rows(component: str, module: str, engine: torch.Tensor, trainer: torch.Tensor, prefill: torch.Tensor
              ) -> ComponentDiff:
    """engine, trainer: [N, width] rows of the same N tokens; prefill: [N] bool. An element
    differs when its bits do (a NaN equals a NaN of the same bits, -0.0 differs from 0.0), a row
    when any element does; absolute differences in fp64, a NaN against anything else infinite."""
    if engine.shape != trainer.shape or engine.dtype != trainer.dtype:
        raise RuntimeError(f"{component}: the engine's rows are {tuple(engine.shape)} {engine.dtype}, the trainer's "
                           f"{tuple(trainer.shape)} {trainer.dtype}")
    same = _bits(engine) == _bits(trainer)
    different = ~same.all(dim=1)
    abs_diff = (engine.double() - trainer.double()).abs().nan_to_num(nan=float("inf"))
    abs_diff = torch.where(same, torch.zeros_like(abs_diff), abs_diff)
    return ComponentDiff(
        component=component, module=module, rows=engine.shape[0], rows_different=int(different.sum()),
        prefill_rows_different=int((different & prefill).sum()), decode_rows_different=int((different & ~prefill).sum()),
        max_abs_diff=abs_diff.max().item() if abs_diff.numel() else 0.0,
        mean_abs_diff=abs_diff.mean().item() if abs_diff.numel() else 0.0,
    )


def _prefill(keys: list[RowKey], prompt_lengths: list[int]) -> torch.Tensor:
    return torch.tensor([position < prompt_lengths[sequence] for sequence, position in keys], dtype=torch.bool)


def _packed_prefill(generations: list[Generation]) -> torch.Tensor:
    """Which packed positions (every generation's, in order) hold prompt tokens."""
    keys = [(index, position) for index, generation in enumerate(generations)
            for position in range(len(generation.tokens))]
    return _prefill(keys, [len(generation.prompt_tokens) for generation in generations])


def compare_components(engine: dict[str, Captured], trainer: dict[str, Captured], prompt_lengths: list[int]
                       ) -> list[ComponentDiff]:
    """Each component the engine ran, in forward order, at the rows both sides computed (the
    trainer also runs each sequence's last token, which the engine never feeds); one the trainer
    computed none of those rows of raises."""
    diffs = []
    for name, theirs in engine.items():
        ours = trainer.get(name)
        index = {key: row for row, key in enumerate(ours.keys)} if ours else {}
        pairs = [(row, index[key]) for row, key in enumerate(theirs.keys) if key in index]
        if theirs.keys and not pairs:  # a row count of 0 would read as agreement
            raise RuntimeError(f"{name}: the trainer computed none of the engine's {len(theirs.keys)} rows")
        engine_rows = torch.tensor([e for e, _ in pairs], dtype=torch.long)
        trainer_rows = torch.tensor([t for _, t in pairs], dtype=torch.long)
        width = theirs.rows.shape[1:]
        diffs.append(diff_rows(
            name, theirs.module, theirs.rows[engine_rows].reshape(len(pairs), *width),
            (ours.rows[trainer_rows] if ours else theirs.rows[:0]).reshape(len(pairs), *width),
            _prefill([theirs.keys[e] for e, _ in pairs], prompt_lengths)))
    return diffs


def logprob_diff(compared: dict[str, torch.Tensor], generations: list[Generation]) -> ComponentDiff:
    """The logprobs at the positions the engine reported (harness.trainer_vs_engine's packed
    tensors: every generation's positions in order)."""
    reported = compared["reported"]
    prefill = _packed_prefill(generations)[reported]
    return diff_rows(LOGPROBS, "log_softmax", compared["engine"][reported].unsqueeze(1),
                     compared["train"][reported].unsqueeze(1), prefill)


def unmasked_logprob_diff(compared: dict[str, torch.Tensor], generations: list[Generation]) -> ComponentDiff:
    """The logprobs compared as the RL step would compare them without the engine-reported mask:
    at every position that has a next token, the engine reporting no prompt logprobs (as in RL;
    its packed value there is 0)."""
    as_in_rl = pack_completions([dataclasses.replace(g, prompt_logprobs=None) for g in generations])
    has_target = as_in_rl.batch.has_target
    prefill = _packed_prefill(generations)[has_target]
    return diff_rows(UNMASKED, "log_softmax", as_in_rl.engine_logprobs[has_target].unsqueeze(1),
                     compared["train"][has_target].unsqueeze(1), prefill)


def first_differing(diffs: list[ComponentDiff]) -> str | None:
    return next((diff.component for diff in diffs if diff.rows_different), None)


def diagnose(model: torch.nn.Module, generator: Generator, prompts: list[list[int]], budgets: list[int],
             sampling: Sampling, micro_batch_tokens: int) -> dict:
    """Generates `prompts`, recomputes them with the trainer, both hooked; the report: every
    component's diff (`components`), the first that differs (`first_differing`, None when none
    does), the logprob and routing metrics (`metrics`, as tools/check_parity.py's) and the
    logprobs compared without the reported mask (`unmasked`)."""
    context = generator.engine.context
    with Capture(model, lambda args, kwargs: engine_row_keys(context)) as engine_side:
        generations = generator.generate(prompts, sampling, budgets)
    with Capture(model, TrainerRows()) as trainer_side:
        compared = trainer_vs_engine(model, generations, micro_batch_tokens, sampling.temperature)
    sequences = [generation.tokens for generation in generations]
    engine_side.check_tokens(sequences, "engine")
    trainer_side.check_tokens(sequences, "trainer")
    diffs = compare_components(engine_side.captured(), trainer_side.captured(), [len(p) for p in prompts])
    diffs.append(logprob_diff(compared, generations))
    return {"components": [asdict(diff) for diff in diffs], "first_differing": first_differing(diffs),
            "metrics": compared_metrics(compared), "unmasked": asdict(unmasked_logprob_diff(compared, generations))}


def format_report(title: str, report: dict) -> str:
    """The report as a table, under a line naming where the two sides part."""
    first = report["first_differing"]
    lines = [f"{title}: " + (f"engine and trainer part at {first}" if first else
                             "engine and trainer agree at every component"),
             f"{'component':<28} {'module':<24} {'rows':>7} {'differ':>7} {'prefill':>7} {'decode':>7} "
             f"{'max |diff|':>10} {'mean |diff|':>11}"]
    for row in report["components"]:
        lines.append(f"{row['component']:<28} {row['module'][:24]:<24} {row['rows']:>7} {row['rows_different']:>7} "
                     f"{row['prefill_rows_different']:>7} {row['decode_rows_different']:>7} "
                     f"{row['max_abs_diff']:>10.3g} {row['mean_abs_diff']:>11.3g}")
    return "\n".join(lines)


def ablation_entry(piece: str, does: str, report: dict) -> dict:
    """A run's row of the ablation table: its logprob tokens, those that differ, the largest
    |diff| and the first differing component."""
    logprobs = report["components"][-1]
    return {"piece": piece, "does": does, "tokens": logprobs["rows"], "tokens_different": logprobs["rows_different"],
            "max_abs_diff": logprobs["max_abs_diff"], "first_differing": report["first_differing"]}


def ablation_table(reports: dict[str, dict], pieces: dict[str, str], problems: dict[str, str | None]) -> list[dict]:
    """One row per piece (`pieces`: name -> what it does), from the reports of the all-on BI run
    ("bi") and of each "bi without <piece>" run: the logprob tokens that differ with that piece
    off, the largest |diff| and the first differing component; a piece that could not run
    carries its reason (`problems`). The reported mask's row is the all-on run's comparison
    without it."""
    rows = [ablation_entry("(none: all on)", "every piece on", reports["bi"])]
    for piece, does in pieces.items():
        if problems.get(piece):
            rows.append({"piece": piece, "does": does, "not_run": problems[piece]})
        else:
            rows.append(ablation_entry(piece, does, reports[f"bi without {piece}"]))
    unmasked = reports["bi"]["unmasked"]
    rows.append({"piece": REPORTED_MASK, "does": "logprobs compared only where the engine reported one",
                 "tokens": unmasked["rows"], "tokens_different": unmasked["rows_different"],
                 "max_abs_diff": unmasked["max_abs_diff"], "first_differing": UNMASKED if unmasked["rows_different"] else None})
    return rows


def format_ablation(rows: list[dict]) -> str:
    lines = ["[doctor] ablation: BI mode with one piece off",
             f"{'piece off':<18} {'tokens':>7} {'differ':>7} {'max |diff|':>10}  first differing component"]
    for row in rows:
        if "not_run" in row:
            lines.append(f"{row['piece']:<18} not run: {row['not_run']}")
        else:
            lines.append(f"{row['piece']:<18} {row['tokens']:>7} {row['tokens_different']:>7} "
                         f"{row['max_abs_diff']:>10.3g}  {row['first_differing'] or '-'}")
    return "\n".join(lines)
