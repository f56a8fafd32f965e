"""Per-step metrics: one console progress line, a JSONL file, TensorBoard, and W&B on request.

JSONL lines are `{"run": {...}}` headers (provenance and flags) and `{"step": N, ...}` records.

Only the caller decides which rank logs (rank 0 in pretrain_rl.py); every sink is optional
except the console. TensorBoard and W&B are imported only when asked for.
"""

import argparse
import ast
import json
import math
import os
import shlex
from typing import TYPE_CHECKING

from megatron_rl_bi.jsonfile import read_jsonl
from megatron_rl_bi.reporting.samples import SampleWriter

if TYPE_CHECKING:  # Triton is imported by the runs that count its compilations, not by the tools
    from megatron_rl_bi.reporting.compiles import TritonCompiles


# Measurements of the machine, not of the run: they differ between runs that repeat each other bit
# for bit (the seconds environments took among them)
MACHINE_PREFIXES = ("time/", "throughput/", "memory/")
MACHINE_METRICS = ("rollouts/env_seconds",)


def is_machine_measurement(key: str) -> bool:
    return key.startswith(MACHINE_PREFIXES) or key in MACHINE_METRICS


class MetricsLogger:
    def __init__(
        self,
        total_steps: int,
        jsonl_path: str | None = None,
        tensorboard_dir: str | None = None,
        wandb_project: str | None = None,
        run_config: dict | None = None,
        run_info: dict | None = None,
        samples: SampleWriter | None = None,
        doctor_argv: list[str] | None = None,
        compiles: "TritonCompiles | None" = None,
    ):
        """run_info (device, commit, versions) and run_config (the flags) open the JSONL as a
        `{"run": ...}` record, once per start of the process (a resumed run appends one);
        `samples` writes a few of each step's rollouts (--rl-samples-jsonl). `doctor_argv`, the
        flags of a batch-invariant run: the first step whose logprobs differ says so and names the
        parity doctor's command for them. `compiles`: each record carries Triton's compilations
        since the record before."""
        self.total_steps, self.samples, self.compiles = total_steps, samples, compiles
        self.doctor_command = doctor_command(doctor_argv) if doctor_argv is not None else None
        self._jsonl = None
        self._for_next_record = {}
        if jsonl_path:
            os.makedirs(os.path.dirname(os.path.abspath(jsonl_path)), exist_ok=True)
            self._jsonl = open(jsonl_path, "a", buffering=1)
            header = {**(run_info or {}), "config": run_config or {}}
            self._jsonl.write(json.dumps({"run": header}) + "\n")
        self._tensorboard = None
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise ImportError("--tensorboard-dir needs `pip install tensorboard`") from exc
            self._tensorboard = SummaryWriter(tensorboard_dir)
        self._wandb = None
        if wandb_project:
            try:
                import wandb
            except ImportError as exc:
                raise ImportError("--wandb-project needs `pip install wandb`") from exc
            self._wandb = wandb.init(project=wandb_project, config=run_config or {})

    def add_to_next_record(self, metrics: dict) -> None:
        """Metrics of what came before the next step (the start-up's phases): its record carries them."""
        self._for_next_record.update(metrics)

    def log(self, step: int, metrics: dict, rollouts: list = ()) -> None:
        compiled = self.compiles.take() if self.compiles else {}
        metrics, self._for_next_record = {**self._for_next_record, **compiled, **metrics}, {}
        record = {"step": step, **metrics}
        print(self.progress_line(step, metrics), flush=True)
        if self.doctor_command and metrics.get("bit_wise/logprob_diff/max", math.nan) > 0:
            print(f"parity: bit_wise/logprob_diff/max {metrics['bit_wise/logprob_diff/max']:.3g} at step {step} in "
                  "batch-invariant mode, where it is 0 unless something differs between engine and trainer. "
                  f"Where they part, component by component:\n  {self.doctor_command}", flush=True)
            self.doctor_command = None  # once a run
        if self._jsonl:
            self._jsonl.write(json.dumps(record) + "\n")
        if self.samples:
            self.samples.write(step, rollouts)
        scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        if self._tensorboard:
            for name, value in scalars.items():
                self._tensorboard.add_scalar(name, value, step)
        if self._wandb:
            self._wandb.log(scalars, step=step)

    def progress_line(self, step: int, m: dict) -> str:
        eta = m.get("time/eta_s", math.nan)
        eta_text = "?" if math.isnan(eta) else f"{int(eta // 60)}m{int(eta % 60):02d}s"
        return (
            f"step {step}/{self.total_steps} | reward {m.get('reward/task_mean', math.nan):.3f}"
            f" | loss {m.get('loss', math.nan):+.4f}"
            f" | parity abs_mean {m.get('bit_wise/logprob_diff/abs_mean', math.nan):.3g}"
            f" max {m.get('bit_wise/logprob_diff/max', math.nan):.3g}"
            f" | {m.get('throughput/tokens_per_s', math.nan):.0f} tok/s"
            f" | {m.get('time/step_s', math.nan):.2f} s/step | ETA {eta_text}"
        )

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
        if self.samples:
            self.samples.close()
        if self._tensorboard:
            self._tensorboard.close()
        if self._wandb:
            self._wandb.finish()


def doctor_command(argv: list[str]) -> str:
    """The parity doctor's command line for a run's flags (it takes pretrain_rl.py's), BI mode."""
    return shlex.join(["python", "tools/parity_doctor.py", *argv, "--parity-modes", "bi"])


def read_segments(path: str) -> list[list[dict]]:
    """The step records of a metrics JSONL, one list per process that wrote to it (each
    `{"run": ...}` header opens one), in the order written: a resumed run's second list starts
    at the step after its checkpoint, where a restarted one starts at step 1 again."""
    segments = []
    for record in read_jsonl(path):
        if "run" in record or not segments:
            segments.append([])
        if "step" in record:
            segments[-1].append(record)
    return [segment for segment in segments if segment]


def read_step_records(path: str) -> dict[int, dict]:
    """The `{"step": ...}` records of a metrics JSONL by step (a resumed run's later record of a
    step wins). A file without any is an error: every reader would compare or draw nothing."""
    steps = {r["step"]: r for segment in read_segments(path) for r in segment}
    if not steps:
        raise ValueError(f"{path}: no step records")
    return steps


def read_run_header(path: str) -> dict:
    """The first `{"run": ...}` header of a metrics JSONL: device, commit, memory plan, flags."""
    run = next((record["run"] for record in read_jsonl(path) if "run" in record), None)
    if run is None or "config" not in run:
        raise ValueError(f"{path}: no run header with the run's flags")
    return run


def header_flags(run: dict) -> argparse.Namespace:
    """A run header's flags with their types back (the header writes each as str()): a value that
    reads as a Python literal is that literal, any other stays the string it was."""
    def typed(text: str):
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError):
            return text
    return argparse.Namespace(**{name: typed(value) for name, value in run["config"].items()})
