"""bench/suite.py's arithmetic (CPU): ratios and headline keys from two modes' profiles, and
every model's flags parse."""

import cProfile
import dataclasses
import importlib.util
import os
import types

import pytest
import torch

from megatron_rl_bi.config import build_parser

from .. import REPO


def _module(relative_path):
    spec = importlib.util.spec_from_file_location(relative_path, os.path.join(REPO, relative_path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


suite = _module("bench/suite.py")
bench_report = _module("bench/report.py")
MODE = {"train_fwd_bwd_s": 1.0, "rl_update_s": 2.0, "generate_s": 4.0, "decode_step_ms_median": 30.0,
        "decode_interval_ms_median": 25.0, "decode_hbm_roofline_fraction": 0.02, "parity_max": 0.0,
        "decode_bytes_per_step": 3.5e9, "hbm_copy_bytes_per_s": 4.0e12}


def test_ratios_and_headline_keys():
    profile = {"bi": {**MODE, "train_fwd_bwd_s": 1.5, "rl_update_s": 2.2, "generate_s": 5.0,
                      "decode_step_ms_median": 40.0, "decode_interval_ms_median": 35.0,
                      "decode_hbm_roofline_fraction": 0.015},
               "default": MODE}
    summary = suite.summarize(profile)
    assert (summary["trainer_ratio"], summary["generation_ratio"]) == (1.5, 1.25)
    assert (summary["decode_roofline_fraction_bi"], summary["decode_roofline_fraction_default"]) == (0.015, 0.02)
    assert summary["update_ratio"] == pytest.approx(1.1)
    assert (summary["decode_ms_bi"], summary["decode_ms_default"]) == (40.0, 30.0)
    assert suite.headline({"dense16": summary, "dense4": summary}) == {
        "trainer_ratio_dense": 1.5, "update_ratio_dense": summary["update_ratio"],
        "generation_ratio_dense": 1.25, "decode_ms_dense_bi": 40.0, "decode_interval_ms_dense_bi": 35.0,
        "decode_roofline_fraction_dense_bi": 0.015}


def test_rounds_take_medians_and_the_worst_parity():
    rounds = [{"bi": {**MODE, "train_fwd_bwd_s": t, "parity_max": parity, "hbm_copy_bytes_per_s": rate},
               "default": MODE}
              for t, parity, rate in ((1.5, 0.0, 3.0e12), (3.0, 0.25, 2.0e12), (1.1, 0.0, 2.5e12))]
    summary = suite.summarize_rounds(rounds)
    assert summary["trainer_ratio"] == 1.5  # the median of 1.5, 3.0 and 1.1
    assert summary["train_fwd_bwd_s"] == {"bi": 1.5, "default": 1.0}
    assert summary["parity_max_bi"] == 0.25
    assert [r["trainer_ratio"] for r in summary["rounds"]] == [1.5, 3.0, 1.1]
    # each round's roofline is the copy rate its own processes measured
    assert (summary["hbm_copy_bytes_per_s_bi"], summary["hbm_copy_bytes_per_s_default"]) == (2.5e12, 4.0e12)
    assert [r["hbm_copy_bytes_per_s_bi"] for r in summary["rounds"]] == [3.0e12, 2.0e12, 2.5e12]
    assert suite.summarize_rounds(rounds[:1]) == {**suite.summarize(rounds[0]), "rounds": [
        {k: v for k, v in suite.summarize(rounds[0]).items() if isinstance(v, float)}]}


def test_each_modes_raw_times_are_their_medians_over_the_rounds_not_the_first_rounds():
    rounds = [{"bi": {**MODE, "generate_s": bi_s, "train_fwd_bwd_s": train_s},
               "default": {**MODE, "generate_s": default_s}}
              for bi_s, train_s, default_s in ((6.0, 3.0, 4.0), (5.0, 1.5, 8.0), (4.5, 1.1, 2.0))]
    summary = suite.summarize_rounds(rounds)
    assert summary["generate_s"] == {"bi": 5.0, "default": 4.0}
    assert summary["train_fwd_bwd_s"] == {"bi": 1.5, "default": 1.0}


def _model_args(name: str):
    """The flags bench/profile_steps.py parses for the suite's model `name`."""
    profile_steps = _module("bench/profile_steps.py")
    return build_parser(profile_steps.add_profile_args).parse_args(suite.COMMON + suite.MODELS[name])


@pytest.mark.parametrize("name", sorted(suite.MODELS))
def test_every_models_flags_parse(name):
    args = _model_args(name)
    assert args.flash_attention_version == 4 and not args.bench_default_first
    assert args.hidden_size == (2560 if name.startswith("qwen3_4b_long") else 2048)


def test_the_long_context_model_decodes_at_4k_to_8k_with_the_engine_alone():
    args = _model_args("qwen3_4b_long")
    assert args.bench_prompt_tokens == [4096, 8064] and args.bench_requests == 64
    assert 8064 + args.bench_new_tokens <= args.inference_max_seq_length == 8192
    assert args.bench_generation_only
    assert suite.build_parser().parse_args(["--output", "x.json"]).models == list(suite.RECORD)


def test_markdown_table_from_a_report():
    model = suite.summarize({"bi": {**MODE, "train_fwd_bwd_s": 1.5, "hbm_copy_bytes_per_s": 3.0e12}, "default": MODE})
    report = {"device": "NVIDIA H200", "git_commit": "0123456789abcdef", "extra_flags": "",
              "models": {"dense16": model}}
    assert suite.markdown_table(report).splitlines()[2] == (
        "| dense16 | 1.50x | 1.00x | 1.00x | 30.00 / 30.00 ms | 25.00 / 25.00 ms | 3.5 GB | 2.0% / 2.4% |")
    # the interval's fraction: the step's 2.0% of the roofline in 30 ms, the same bytes in 25 ms
    assert "commit 0123456, extra flags: none. HBM roofline: the copy rate measured in the run, dense16 3.00 TB/s." \
        in suite.markdown_table(report)  # BI mode's rate, whose fractions the table shows
    report["rounds"] = 3
    assert "extra flags: none, medians of 3 rounds." in suite.markdown_table(report)


@pytest.mark.parametrize("content,error", [
    (None, r"No such file or directory"),
    ('{"step": 1}\n{"step": 2}\n', r":2: not JSON \(Extra data\)"),
    ('{"kernels": []}', r"not a report of bench/suite.py \(it has no 'models'\)"),
])
def test_table_of_a_file_that_is_not_a_report_is_one_line_naming_it(tmp_path, monkeypatch, content, error):
    path = tmp_path / "report.json"
    if content is not None:
        path.write_text(content)
    monkeypatch.setattr("sys.argv", ["suite.py", "--table", str(path)])
    with pytest.raises(SystemExit, match=f"^--table {path}: .*{error}"):
        suite.main()


def test_a_generation_only_profile_has_no_trainer_ratios_and_says_so():
    engine_only = {key: value for key, value in MODE.items() if key not in ("train_fwd_bwd_s", "rl_update_s")}
    model = suite.summarize({"bi": {**engine_only, "generate_s": 5.0}, "default": engine_only})
    assert (model["trainer_ratio"], model["update_ratio"], model["generation_ratio"]) == (None, None, 1.25)
    assert suite.summarize_rounds([{"bi": engine_only, "default": engine_only}] * 3)["trainer_ratio"] is None
    report = {"device": "NVIDIA H200", "git_commit": "0123456789abcdef", "extra_flags": "",
              "models": {"qwen3_4b_long": model}}
    assert suite.markdown_table(report).splitlines()[2].startswith(
        "| qwen3_4b_long | not measured | not measured | 1.25x | 30.00 / 30.00 ms |")
    assert suite.headline({"qwen3_4b_long": model})["trainer_ratio_long"] is None


def _planned_gib(name: str, tokens: int) -> float:
    """The planner's weights + the engine's cache + the parity check's forward of `tokens` packed
    tokens (autograd on) for the suite's model `name`, in GiB."""
    from megatron_rl_bi.config.from_args import model_shape_from_args
    from megatron_rl_bi.memory import GIB, Recompute, activation_bytes, parameter_count

    args = _model_args(name)
    shape = model_shape_from_args(args, args.bench_vocab_size)
    recompute = Recompute(args.recompute_granularity, args.recompute_method, args.recompute_num_layers)
    cache = args.inference_dynamic_batching_buffer_size_gb * GIB  # megatron-core's "GB" are GiB
    return (parameter_count(shape) * 2 + cache + activation_bytes(shape, tokens, recompute)) / GIB


def test_the_long_decode_for_an_h100_fits_it_with_a_cache_for_its_requests():
    from megatron_rl_bi.memory import GIB

    args = _model_args("qwen3_4b_long_h100")
    assert args.bench_requests == 32 and args.bench_prompt_tokens == [4096, 8064]
    assert _planned_gib("qwen3_4b_long_h100", 16384) < 0.9 * 79.2  # an H100's 79.2 GiB
    # K and V of every layer's KV heads, bf16, for each request at its longest prompt and all its new tokens
    longest = (args.bench_requests * (args.bench_prompt_tokens[1] + args.bench_new_tokens)
               * args.num_layers * args.num_query_groups * args.kv_channels * 2 * 2)
    assert longest < 0.9 * args.inference_dynamic_batching_buffer_size_gb * GIB  # with room to spare


def test_the_long_workloads_parity_check_fits_an_h200_beside_the_engines_cache():
    """The parity check's trainer forward (autograd on, up to 16K packed tokens) runs while the
    engine holds its cache: weights + cache + that forward's activations, by the planner, must fit
    the H200 (139.8 GiB). Without recompute the plan is 138.2 GiB at the 12,288-token micro-batch where
    the bench ran out of memory at 4af7568 (torch: 138.17 GiB allocated), 160 GiB at 16K tokens."""
    from megatron_rl_bi.config.from_args import model_shape_from_args
    from megatron_rl_bi.memory import GIB, Recompute, activation_bytes

    assert _planned_gib("qwen3_4b_long", 16384) < 0.9 * 139.8
    args = _model_args("qwen3_4b_long")
    shape = model_shape_from_args(args, args.bench_vocab_size)
    assert activation_bytes(shape, 16384, Recompute()) > 60 * GIB  # what ran out of memory


def test_a_round_that_wrote_nothing_is_not_repeated(tmp_path, monkeypatch):
    calls = []

    def out_of_memory(script, flags, output_flag, path):
        calls.append(flags)
        return None, f"exit 1, wrote no {path}"

    monkeypatch.setattr(suite, "_run", out_of_memory)
    monkeypatch.setattr(suite.sys, "argv", ["suite.py", "--output", str(tmp_path / "b.json"), "--models",
                                            "qwen3_4b_long", "dense4", "--rounds", "3", "--skip-gemm"])
    with pytest.raises(SystemExit, match="qwen3_4b_long round 0: bi mode: exit 1.*dense4 round 0: bi mode: exit 1"):
        suite.main()
    assert len(calls) == 2 and suite.read_object(str(tmp_path / "b.json"))["rounds"] == 0


def test_the_suite_leaves_no_working_directory_behind(tmp_path, monkeypatch):
    """Each run's JSON is in the report; nothing is left under the temporary directory."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(suite.tempfile, "tempdir", str(scratch))

    def run(script, flags, output_flag, path):
        open(path, "w").close()
        if "--bench-mode" not in flags:  # bench/gemm.py
            return {"shapes": []}, None
        return {flags[flags.index("--bench-mode") + 1]: MODE}, None

    monkeypatch.setattr(suite, "_run", run)
    monkeypatch.setattr(suite, "plot", lambda models, path: None)
    monkeypatch.setattr(suite.sys, "argv", ["suite.py", "--output", str(tmp_path / "b.json"), "--models",
                                            "qwen3_4b_long", "--rounds", "2"])
    suite.main()
    assert os.listdir(scratch) == [] and suite.read_object(str(tmp_path / "b.json"))["rounds"] == 2


def test_a_run_stopped_between_rounds_keeps_the_rounds_it_finished(tmp_path, monkeypatch):
    output = tmp_path / "bench.json"
    calls = []

    def one_round_then_stopped(script, flags, output_flag, path):
        calls.append(flags)
        if len(calls) > 2:
            raise KeyboardInterrupt  # the device call's time limit, in the second round
        return {flags[flags.index("--bench-mode") + 1]: MODE}, None

    monkeypatch.setattr(suite, "_run", one_round_then_stopped)
    monkeypatch.setattr(suite.sys, "argv", ["suite.py", "--output", str(output), "--models", "qwen3_4b_long",
                                            "--rounds", "3", "--skip-gemm"])
    with pytest.raises(KeyboardInterrupt):
        suite.main()
    report = suite.read_object(str(output))
    assert report["rounds"] == 1 and len(report["models"]["qwen3_4b_long"]["rounds"]) == 1
    assert report["decode_ms_long_bi"] == 30.0 and report["failures"] == []
    assert [call[call.index("--bench-mode") + 1] for call in calls] == ["bi", "default", "default"]


def test_the_reports_rounds_are_the_fewest_any_model_finished(tmp_path, monkeypatch):
    def second_model_fails_its_second_round(script, flags, output_flag, path):
        if os.path.basename(path).startswith("dense4_1_"):
            return None, f"exit 1, wrote no {path}"
        return {flags[flags.index("--bench-mode") + 1]: MODE}, None

    monkeypatch.setattr(suite, "_run", second_model_fails_its_second_round)
    monkeypatch.setattr(suite, "plot", lambda models, path: None)
    monkeypatch.setattr(suite.sys, "argv", ["suite.py", "--output", str(tmp_path / "b.json"), "--models", "dense16",
                                            "dense4", "--rounds", "2", "--skip-gemm"])
    with pytest.raises(SystemExit, match="dense4 round 1: default mode: exit 1"):
        suite.main()
    report = suite.read_object(str(tmp_path / "b.json"))
    assert report["rounds"] == 1 and [len(m["rounds"]) for m in report["models"].values()] == [2, 1]


def test_each_mode_runs_in_a_process_of_its_own_the_second_on_the_first_s_weights(tmp_path, monkeypatch):
    """In one process a MoE model's first mode kept 25 GiB, and the second ran out of an H100's memory."""
    calls = []

    def run(script, flags, output_flag, path):
        mode = flags[flags.index("--bench-mode") + 1]
        calls.append((mode, flags[-2:]))
        if "--bench-save-weights" in flags:
            open(flags[-1], "w").close()
        return {"run": {"device": mode}, mode: {**MODE, "parity_max": 0.0 if mode == "bi" else 1.0}}, None

    monkeypatch.setattr(suite, "_run", run)
    profile, failures = suite.profile_round(["--x"], 1, str(tmp_path), "m")
    weights = str(tmp_path / "m_1_weights.pt")
    assert calls == [("default", ["--bench-save-weights", weights]), ("bi", ["--bench-weights", weights])]
    assert failures == [] and not (tmp_path / "m_1_weights.pt").exists()
    assert profile["run"] == {"device": "default"} and (profile["bi"]["parity_max"], profile["default"]["parity_max"]) == (0.0, 1.0)

    def second_fails(script, flags, output_flag, path):
        if "--bench-weights" in flags:
            return None, f"exit 1, wrote no {path}"
        return run(script, flags, output_flag, path)

    monkeypatch.setattr(suite, "_run", second_fails)
    profile, failures = suite.profile_round(["--x"], 0, str(tmp_path), "m")
    assert profile is None and failures == [f"default mode: exit 1, wrote no {tmp_path}/m_0_default.json"]
    assert not (tmp_path / "m_0_weights.pt").exists()


def test_markdown_table_of_a_file_without_decode_intervals_or_bytes():
    old = {key: value for key, value in MODE.items() if key != "decode_interval_ms_median"}
    model = suite.summarize({"bi": old, "default": old})
    del model["decode_gb_per_step"]  # files written before the bytes were recorded
    del model["hbm_copy_bytes_per_s_bi"], model["hbm_copy_bytes_per_s_default"]  # and before the copy rate was
    report = {"device": "NVIDIA H200", "git_commit": "0123456789abcdef", "extra_flags": "",
              "models": {"dense16": model}}
    assert "| 30.00 / 30.00 ms | not measured | not recorded | 2.0% / not measured |" in suite.markdown_table(report)
    assert suite.markdown_table(report).endswith(
        "HBM roofline: an H200's copy rate, 4.3 TB/s (a constant before the runs measured their own).")


class _Clock:
    """A host clock that moves only when a fake engine step says so."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


class _FakeContext:
    """The engine's context as the hook reads it: active requests and their summed contexts."""

    def __init__(self, active, context_tokens):
        self.active, self.context_tokens = active, context_tokens

    def get_active_request_count(self):
        return self.active

    def get_active_sequence_lengths(self):
        return torch.tensor([self.context_tokens])


class _FakeEngine:
    """An engine whose steps take known host times on a fake clock (no GPU, no sleeping). Its
    context has, before each step, the `active` requests of a schedule (all `requests` when none
    is given), and each step adds a token to every active request's context."""

    def __init__(self, clock, step_seconds, requests=2, active=None):
        self.clock, self.step_seconds, self.steps = clock, step_seconds, 0
        self.active = active or [requests] * len(step_seconds)
        self.context = _FakeContext(self.active[0], 100)

    def step_modern(self):
        self.clock.now += self.step_seconds[self.steps]
        self.context.context_tokens += self.context.active
        self.steps += 1
        if self.steps < len(self.active):
            self.context.active = self.active[self.steps]


class _FakeWork:
    def __init__(self, engine, requests=2):
        self.engine, self.prompts = engine, [[1]] * requests

    def generate(self, new_tokens):
        for _ in range(new_tokens):
            self.engine.step_modern()


@pytest.fixture
def profile_steps(monkeypatch):
    module = _module("bench/profile_steps.py")
    clock = _Clock()
    monkeypatch.setattr(module, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    monkeypatch.setattr(module.torch.cuda, "synchronize", lambda: None)
    module.clock = clock
    return module


def test_unsynchronized_hook_records_the_time_between_step_returns(profile_steps):
    engine = _FakeEngine(profile_steps.clock, [0.5, 0.125, 0.25, 1.0])  # binary fractions: exact sums
    hook = profile_steps.EngineStepHook(engine)
    profile_steps.clock.now = 3.0  # the generation starts later than the hook was made
    times = hook.run(_FakeWork(engine), 3, synchronize=False)
    assert engine.steps == 3 and times == [0.5, 0.125, 0.25]
    engine.step_modern()  # a step outside run (the bench's rollouts) is not one of the run's
    assert engine.steps == 4 and len(times) == 3


def test_caller_generations_take_the_median_wall_time(profile_steps):
    engine = _FakeEngine(profile_steps.clock, [0.25, 0.0, 1.0, 0.0, 0.5, 0.0])  # three generations of two steps
    hook = profile_steps.EngineStepHook(engine)
    generate_s, intervals, full_batch = profile_steps.caller_generations(hook, _FakeWork(engine), 2)
    assert intervals == [[0.25, 0.0], [1.0, 0.0], [0.5, 0.0]] and engine.steps == 6
    assert full_batch == [0.25, 0.0, 1.0, 0.0, 0.5, 0.0]
    assert generate_s == 0.5  # the middle one: the 1.0 s run does not move it


# The active requests before each step: four long prompts, one admitted (prefilled) a step in
# steps 0-3, the first finishing after step 6; steps 4-6 have all four and prefill none
LONG_PROMPTS = [0, 1, 2, 3, 4, 4, 4, 3, 2]


def test_only_full_batch_decode_steps_are_measured_each_with_its_context_tokens(profile_steps):
    """The context is counted before the step is timed: counting it moves no step's time."""
    seconds = [4.0, 4.0, 4.0, 4.0, 1.0, 2.0, 1.5, 0.5, 0.25]
    engine = _FakeEngine(profile_steps.clock, seconds, active=LONG_PROMPTS)
    counted = engine.context.get_active_sequence_lengths

    def slow_count():
        profile_steps.clock.now += 100.0
        return counted()

    engine.context.get_active_sequence_lengths = slow_count
    hook = profile_steps.EngineStepHook(engine)
    assert hook.run(_FakeWork(engine, requests=4), 9) == seconds
    assert hook.full_batch == [False] * 4 + [True] * 3 + [False] * 2  # step 3 admits the fourth
    assert hook.full_batch_times() == [1.0, 2.0, 1.5]
    # 100 + 0 + 1 + 2 + 3 tokens before step 4, then 4 more a step
    assert hook.context_tokens == [106, 110, 114]


def test_an_unsynchronized_run_counts_no_context_tokens(profile_steps):
    engine = _FakeEngine(profile_steps.clock, [1.0] * 9, active=LONG_PROMPTS)
    hook = profile_steps.EngineStepHook(engine)
    hook.run(_FakeWork(engine, requests=4), 9, synchronize=False)
    assert hook.full_batch_times() == [1.0] * 3 and hook.context_tokens == []


def test_a_generation_without_a_full_batch_decode_step_fails_naming_the_flag(profile_steps):
    engine = _FakeEngine(profile_steps.clock, [1.0] * 4, active=LONG_PROMPTS)
    with pytest.raises(RuntimeError, match="no full-batch decode step in 4 steps of 4 new tokens for 4 requests.*"
                                           "--bench-new-tokens"):
        profile_steps.EngineStepHook(engine).run(_FakeWork(engine, requests=4), 4)


class _CountingProfiler:
    def __init__(self, engine):
        self.engine, self.events = engine, []

    def start(self):
        self.events.append(("start", self.engine.steps))

    def stop(self):
        self.events.append(("stop", self.engine.steps))


def test_the_profilers_window_is_the_first_full_batch_decode_steps(profile_steps, monkeypatch):
    monkeypatch.setattr(profile_steps, "PROFILED_STEPS", 2)
    engine = _FakeEngine(profile_steps.clock, [0.0] * 9, active=LONG_PROMPTS)
    hook, profiler = profile_steps.EngineStepHook(engine), _CountingProfiler(engine)
    hook.run(_FakeWork(engine, requests=4), 9, profiler)
    assert profiler.events == [("start", 4), ("stop", 6)] and hook.profiled_steps == 2  # steps 4 and 5
    monkeypatch.setattr(profile_steps, "PROFILED_STEPS", 8)  # more than the generation has
    engine = _FakeEngine(profile_steps.clock, [0.0] * 9, active=LONG_PROMPTS)
    hook, profiler = profile_steps.EngineStepHook(engine), _CountingProfiler(engine)
    hook.run(_FakeWork(engine, requests=4), 9, profiler)
    assert profiler.events == [("start", 4), ("stop", 9)] and hook.profiled_steps == 3


def test_a_decode_steps_bytes_and_its_roofline_fraction_by_hand(profile_steps):
    """3 attention layers with MLPs, hidden 4, FFN 8, 2 heads of 2, one KV head, vocabulary 16, bf16:
    weights 16 x 4 + 3 x (52 + 100) + 4 = 524 parameters tied; per context token K and V x 1 x 2
    x 2 B = 8 B in each layer."""
    from megatron_rl_bi.memory import ModelShape

    tied = ModelShape(layers=("*-",) * 3, hidden=4, ffn=8, heads=2, kv_heads=1, head_dim=2, vocab=16, tied=True)
    assert profile_steps.decode_bytes(tied, 4, 10) == 524 * 2 + 3 * 10 * 8
    # untied: an output layer more, the input embedding (16 x 4) not read by a decode step
    untied = dataclasses.replace(tied, tied=False)
    assert profile_steps.decode_bytes(untied, 4, 10) == (524 + 64 - 64) * 2 + 3 * 10 * 8
    # 100, 150 and 600 bytes a second: the median, 150, over the copy rate
    assert profile_steps.roofline_fraction([100.0, 300.0, 600.0], [1.0, 2.0, 1.0], 100.0) == 1.5


def test_a_hybrid_decode_step_reads_its_attention_layers_kv_and_its_gdn_layers_states(profile_steps):
    """"G-*-": one attention layer, 10 context tokens of 8 B; one GDN layer (key heads 1 x 2, value
    heads 2 x 2, conv kernel 4), each request's conv state (2 x 2 + 4) x 4 x 2 B = 64 and rule
    state 2 x 2 x 2 fp32 = 32, read and written, for 4 requests. Weights: embedding 64, GDN 122,
    two MLPs 100 each, attention 52, final norm 4 (tests/unit_tests/test_memory_plan.py's counts)."""
    from megatron_rl_bi.memory import ModelShape

    shape = ModelShape(layers=tuple("G-*-"), hidden=4, ffn=8, heads=2, kv_heads=1, head_dim=2, vocab=16, tied=True,
                       gdn_key_heads=1, gdn_value_heads=2, gdn_key_dim=2, gdn_value_dim=2, gdn_conv_kernel=4)
    weights = 64 + 122 + 2 * 100 + 52 + 4
    assert profile_steps.decode_bytes(shape, 4, 10) == weights * 2 + 1 * 10 * 8 + 4 * (64 + 32) * 2


def test_the_copy_rate_counts_each_byte_read_and_written_at_the_median_copy(profile_steps):
    # 1 GiB copies in 0.5, 4.0 (one slowed by something else) and 0.25 s: 2 GiB moved in the median 0.5 s
    assert profile_steps.copy_rate(2**30, [0.5, 4.0, 0.25]) == 2**32


def test_the_copy_rate_is_timed_on_copies_after_a_warm_up_and_its_buffers_are_given_back(profile_steps, monkeypatch):
    """torch stood in for: each timed copy's CUDA-event milliseconds from a schedule."""
    milliseconds = iter([500.0, 250.0, 4000.0, 500.0, 500.0, 250.0, 8000.0, 500.0, 250.0])  # the median: 500
    calls = []

    class Buffer:
        def copy_(self, source):
            calls.append("copy")

    class Event:
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):
            pass

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return next(milliseconds)

    def empty(size, dtype, device):
        calls.append(("empty", size, device))
        return Buffer()

    monkeypatch.setattr(profile_steps, "torch", types.SimpleNamespace(
        uint8=torch.uint8, empty=empty, empty_like=lambda buffer: Buffer(),
        cuda=types.SimpleNamespace(Event=Event, empty_cache=lambda: calls.append("empty_cache"))))
    assert profile_steps.measure_copy_rate() == 2**32  # 2 GiB read and written in the median 0.5 s
    assert calls == [("empty", 2**30, "cuda")] + ["copy"] * 10 + ["empty_cache"]  # a warm-up, nine timed


def test_a_modes_report_carries_the_copy_rate_it_measured_before_building_the_model(profile_steps, monkeypatch):
    """measure with the model, the profilers and the copy stood in for: 2 requests, 2 new tokens a
    generation, every step a full-batch decode step of 0.5 s reading 2**31 bytes."""
    built = []
    engine = _FakeEngine(profile_steps.clock, [0.5] * 14)  # seven generations of two steps
    work = _FakeWork(engine)
    work.generator, work.model = types.SimpleNamespace(engine=engine), None
    work.trains, work.parity_max = False, lambda: 0.0
    monkeypatch.setattr(profile_steps, "measure_copy_rate", lambda: built.append("copy") or 2.0**40)
    monkeypatch.setattr(profile_steps, "build_workload", lambda args, weights, trains: built.append("model") or work)
    monkeypatch.setattr(profile_steps, "model_shape_from_args", lambda args, vocab: ("shape", vocab))
    read = []
    monkeypatch.setattr(profile_steps, "decode_bytes",
                        lambda shape, requests, context_tokens: read.append((shape, requests)) or 2.0**31)
    monkeypatch.setattr(profile_steps, "profile", lambda activities: _CountingProfiler(engine))
    monkeypatch.setattr(profile_steps, "PythonProfiler", lambda: _CountingProfiler(engine))
    monkeypatch.setattr(profile_steps, "op_table", lambda profiler, per, rows: [])
    monkeypatch.setattr(profile_steps, "python_table", lambda profiler, per, rows: [])
    monkeypatch.setattr(profile_steps, "cpu_state_dict", lambda model: {})
    args = types.SimpleNamespace(bench_generation_only=True, bench_new_tokens=2, bench_op_rows=5, bench_vocab_size=8)
    result, _ = profile_steps.measure(args, True, None)
    assert built == ["copy", "model"] and engine.steps == 14
    assert read and set(read) == {(("shape", 8), 2)}  # the bench's model, its 2 requests
    assert result["hbm_copy_bytes_per_s"] == 2.0**40
    assert result["decode_hbm_roofline_fraction"] == 2.0**-8  # 2**32 bytes a second over 2**40


def test_the_printed_summary_names_each_modes_copy_rate(profile_steps, monkeypatch):
    printed = {}
    report = {"bi": {**MODE, "prefill_ms": 9.0}}  # --bench-mode bi
    args = types.SimpleNamespace(bench_output=None)
    monkeypatch.setattr(profile_steps, "run_modes", lambda provider, measure: (args, report))
    monkeypatch.setattr(profile_steps, "write_report", lambda report, summary, path: printed.update(summary))
    monkeypatch.setattr(profile_steps, "check_bi_parity", lambda report: None)
    profile_steps.main()
    assert printed == {"bi": {"prefill_ms": 9.0, "decode_step_ms_median": 30.0, "decode_interval_ms_median": 25.0,
                              "decode_hbm_roofline_fraction": 0.02, "hbm_copy_bytes_per_s": 4.0e12,
                              "train_fwd_bwd_s": 1.0, "parity_max": 0.0}}


def _tick(clock, seconds):
    clock.now += seconds


def test_python_table_per_step():
    """cProfile on a fake clock: each _tick call takes exactly its seconds."""
    clock = _Clock()
    profiler = bench_report.PythonProfiler()
    profiler.profile = cProfile.Profile(timer=clock.perf_counter)
    profiler.start()
    for _ in range(4):
        _tick(clock, 0.5)
    profiler.stop()
    row = next(r for r in bench_report.python_table(profiler, per=2, rows=5) if "(_tick)" in r["function"])
    assert row["function"].endswith("test_bench_suite.py:" + str(_tick.__code__.co_firstlineno) + "(_tick)")
    assert row["calls_per_step"] == 2.0
    assert row["cumulative_ms"] == row["own_ms"] == 1000.0  # two 0.5 s ticks a step


def test_short_path():
    assert bench_report.short_path("/x/lib/python3.12/site-packages/megatron/core/a.py") == "megatron/core/a.py"
    assert bench_report.short_path("/home/u/megatron_rl_bi/megatron_rl_bi/bi/gemm.py") == "megatron_rl_bi/bi/gemm.py"
    assert bench_report.short_path("/tmp/b.py") == "/tmp/b.py"


def test_step_time_summary_names_the_slow_steps():
    profile_steps = _module("bench/profile_steps.py")
    summary = profile_steps.step_time_summary([0.05, 0.01, 0.01, 2.0, 0.01, 0.02])
    assert summary["count"] == 6 and summary["sum_s"] == pytest.approx(2.1)
    assert summary["p50_ms"] == pytest.approx(20.0) and summary["max_ms"] == pytest.approx(2000.0)
    assert summary["slowest"][:2] == [[3, pytest.approx(2000.0)], [0, pytest.approx(50.0)]]


def test_table_of_a_file_that_is_no_suite_report_names_it(tmp_path, monkeypatch):
    path = tmp_path / "gemm.json"
    path.write_text('{"shapes": []}')
    monkeypatch.setattr("sys.argv", ["suite.py", "--table", str(path)])
    with pytest.raises(SystemExit, match=r"--table .*gemm.json: not a report of bench/suite.py"):
        suite.main()


@pytest.mark.parametrize("written, code, failure", [
    ('{"shapes": []}', 0, None),
    ('{"shapes": []}', 3, "exit 3"),
    (None, 1, "exit 1, wrote no {path}"),
    ('{"shapes": [\n', 0, "exit 0, {path}:1: not JSON (Expecting value)"),  # a run killed while writing
])
def test_a_runs_failure_is_reported_not_raised(tmp_path, monkeypatch, written, code, failure):
    path = tmp_path / "out.json"

    def fake_run(command):
        assert command[-2:] == ["--output", str(path)]
        if written is not None:
            path.write_text(written)
        return types.SimpleNamespace(returncode=code)

    monkeypatch.setattr(suite.subprocess, "run", fake_run)
    report, reported = suite._run("gemm.py", [], "--output", str(path))
    assert reported == (failure and failure.format(path=path))
    assert report == ({"shapes": []} if written and written.endswith("}") else None)


def test_a_count_of_zero_is_refused_before_anything_runs(capsys):
    """--rounds 0 ran nothing and wrote an empty report over --output, exit 0."""
    with pytest.raises(SystemExit):
        suite.build_parser().parse_args(["--output", "report.json", "--rounds", "0"])
    assert "argument --rounds: 0: must be >= 1" in capsys.readouterr().err
    assert bench_report.positive_int("3") == 3


def test_a_report_stopped_while_being_written_leaves_the_last_one_whole(tmp_path, monkeypatch):
    path = tmp_path / "bench.json"
    bench_report.write_json({"rounds": 1}, str(path))

    def stopped_halfway(value, f, **kwargs):
        f.write('{"rounds": ')
        raise KeyboardInterrupt  # the device call's time limit, mid-write

    monkeypatch.setattr(bench_report.json, "dump", stopped_halfway)
    with pytest.raises(KeyboardInterrupt):
        bench_report.write_json({"rounds": 2}, str(path))
    assert suite.read_object(str(path)) == {"rounds": 1}
