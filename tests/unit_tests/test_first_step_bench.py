"""bench/first_step.py's arithmetic and cache placement by hand (the runs themselves need a GPU)."""

import importlib.util
import json
import os
import pstats
import subprocess
import sys

from .. import REPO

_spec = importlib.util.spec_from_file_location("first_step", os.path.join(REPO, "bench", "first_step.py"))
first_step = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(first_step)


def _run(wall, first_record, step, generation, training, optimizer, later, startup=None):
    return {"wall_s": wall, "first_record_s": first_record,
            "first_step": {"time/step_s": step, "time/generation_s": generation, "time/training_s": training,
                           "time/optimizer_s": optimizer},
            "startup": startup or {}, "later_steps_median": later}


def test_ratios_by_hand():
    later = {"time/step_s": 10.0, "time/generation_s": 4.0, "time/training_s": 5.0, "time/optimizer_s": 0.5}
    fresh = _run(300.0, 200.0, 170.0, 39.0, 131.0, 2.0, later)
    warm = _run(100.0, 40.0, 20.0, 8.0, 10.0, 0.5, {**later, "time/optimizer_s": 0.0})
    assert first_step.ratios(fresh, warm) == {
        "wall_fresh_over_warm": 3.0, "first_record_fresh_over_warm": 5.0,
        "wall_fresh_minus_warm_s": 200.0, "first_record_fresh_minus_warm_s": 160.0,
        "compiling_fresh_minus_warm_s": 150.0, "elsewhere_fresh_minus_warm_s": 50.0,
        "fresh_first_over_later_step_s": 17.0, "fresh_first_over_later_generation_s": 9.75,
        "fresh_first_over_later_training_s": 26.2, "fresh_first_over_later_optimizer_s": 4.0,
        "warm_first_over_later_step_s": 2.0, "warm_first_over_later_generation_s": 2.0,
        "warm_first_over_later_training_s": 2.0, "warm_first_over_later_optimizer_s": None}


def test_the_start_ups_phases_fresh_over_warm_where_both_runs_have_them():
    later = {"time/step_s": 1.0, "time/generation_s": 1.0, "time/training_s": 1.0, "time/optimizer_s": 1.0}
    fresh = _run(90.0, 60.0, 6.0, 5.0, 1.0, 1.0, later, {"time/startup_model_s": 20.0, "time/startup_engine_s": 9.0,
                                                          "time/startup_sft_s": 18.0,
                                                          "time/startup_compile_ahead_s": 0.0})
    warm = _run(60.0, 30.0, 3.0, 2.0, 1.0, 1.0, later, {"time/startup_model_s": 16.0, "time/startup_engine_s": 3.0,
                                                         "time/startup_compile_ahead_s": 0.0})
    got = first_step.ratios(fresh, warm)
    # compiles fall in the SFT warm-up (18 s, none warm), compile ahead and the first step (6 against 3 s)
    assert got["compiling_fresh_minus_warm_s"] == 21.0 and got["elsewhere_fresh_minus_warm_s"] == 9.0
    assert got["startup_model_s_fresh_over_warm"] == 1.25 and got["startup_engine_s_fresh_over_warm"] == 3.0
    assert "startup_sft_s_fresh_over_warm" not in got
    assert got["startup_compile_ahead_s_fresh_over_warm"] is None  # default mode: no pass, no ratio


def test_a_ratio_some_rounds_lack_takes_the_median_of_the_others():
    assert first_step.median_of_rounds([1.5, None, 1.1, 1.3]) == 1.3
    assert first_step.median_of_rounds([None, None, None]) is None  # default mode's compile ahead, three rounds


def test_a_rounds_zero_is_a_value_and_one_far_round_moves_no_median():
    # the median of 4.0, 0.0 and 0.5 (the mean is 1.5; without the 0.0 the median is 2.25)
    assert first_step.median_of_rounds([4.0, None, 0.0, 0.5]) == 0.5


def test_the_compiling_seconds_count_compile_ahead_once_with_its_wait_inside_it():
    startup = {"time/startup_imports_s": 7.0, "time/startup_model_s": 9.0, "time/startup_compile_ahead_s": 30.0,
               "time/startup_compile_ahead_wait_s": 12.0, "time/startup_sft_s": 5.0}
    # compile ahead 30 s (its 12 s wait a part of it), the SFT warm-up 5 s, the first step 40 s
    assert first_step.compiling_seconds(_run(100.0, 90.0, 40.0, 20.0, 19.0, 1.0, None, startup)) == 75.0


def test_a_run_of_one_step_has_no_later_steps_and_no_first_over_later_ratios():
    summary = first_step.summarize({1: _record(1, 40.0)}, 50.0, 45.0, 45.0)
    assert summary["later_steps_median"] is None and summary["later_steps_s"] == 0
    assert (summary["between_records_beyond_steps_s"], summary["after_last_record_s"]) == (0.0, 5.0)
    warm = first_step.summarize({1: _record(1, 10.0)}, 20.0, 15.0, 15.0)
    assert first_step.ratios(summary, warm) == {
        "wall_fresh_over_warm": 2.5, "first_record_fresh_over_warm": 3.0,
        "wall_fresh_minus_warm_s": 30.0, "first_record_fresh_minus_warm_s": 30.0,
        "compiling_fresh_minus_warm_s": 30.0, "elsewhere_fresh_minus_warm_s": 0.0}


def test_a_first_record_without_compile_ahead_or_compile_counts_keeps_the_later_steps_counts():
    """Default mode runs no compile ahead: its first record has none of the pass's fields."""
    summary = first_step.summarize({1: _record(1, 40.0), 2: _record(2, 2.0, (4, 1.5, 0))}, 50.0, 45.0, 47.0)
    assert summary["compile_ahead"] == {} and summary["compiles_first_step"] == {}
    assert summary["compiles_later_steps"] == {"time/triton_compiles": 4, "time/triton_compile_s": 1.5,
                                               "time/triton_cache_loads": 0}


def _record(step, step_s, compiles=None, **more):
    times = {"time/step_s": step_s, "time/generation_s": step_s / 2, "time/training_s": step_s / 4,
             "time/optimizer_s": 0.25}
    counted = dict(zip(first_step.COMPILES, compiles)) if compiles else {}
    return {"step": step, **times, **counted, **more}


def test_a_runs_summary_by_hand():
    steps = {1: _record(1, 40.0, (30, 12.5, 2), **{"time/startup_model_s": 9.0, "compile_ahead/jobs": 57,
                                                     "time/compile_ahead_workers_s": 85.5}),
             2: _record(2, 2.0, (4, 1.5, 0)), 3: _record(3, 4.0), 4: _record(4, 3.0, (1, 0.25, 3))}
    assert first_step.summarize(steps, 100.0, 60.0, 75.5) == {
        "wall_s": 100.0, "first_record_s": 60.0, "last_record_s": 75.5,
        "first_step": {"time/step_s": 40.0, "time/generation_s": 20.0, "time/training_s": 10.0,
                       "time/optimizer_s": 0.25},
        "startup": {"time/startup_model_s": 9.0},
        "compiles_first_step": {"time/triton_compiles": 30, "time/triton_compile_s": 12.5,
                                "time/triton_cache_loads": 2},
        "compile_ahead": {"compile_ahead/jobs": 57, "time/compile_ahead_workers_s": 85.5},
        "compiles_later_steps": {"time/triton_compiles": 5, "time/triton_compile_s": 1.75,
                                 "time/triton_cache_loads": 3},
        "later_steps_s": 9.0, "between_records_beyond_steps_s": 6.5, "after_last_record_s": 24.5,
        "later_steps_median": {"time/step_s": 3.0, "time/generation_s": 1.5, "time/training_s": 0.75,
                               "time/optimizer_s": 0.25}}


def test_the_fresh_runs_kernels_are_read_from_its_triton_cache(tmp_path):
    cache = first_step.cache_environment(str(tmp_path))["TRITON_CACHE_DIR"]
    for variant, name in enumerate(["chunk_fwd", "chunk_fwd", "rmsnorm", "chunk_fwd", "rmsnorm", "matmul"]):
        os.makedirs(os.path.join(cache, f"HASH{variant}"))
        for suffix in (".cubin", ".json", ".ptx", ".ttgir"):
            open(os.path.join(cache, f"HASH{variant}", name + suffix), "w").close()
    open(os.path.join(cache, "HASH0", "__grp__chunk_fwd.json"), "w").close()
    kernels = first_step.triton_kernels(str(tmp_path))
    assert kernels == {"chunk_fwd": 3, "rmsnorm": 2, "matmul": 1} and list(kernels) == ["chunk_fwd", "rmsnorm", "matmul"]


def test_the_fresh_runs_flash_attention_kernels_are_counted_by_family(tmp_path):
    tmpdir = first_step.cache_environment(str(tmp_path))["TMPDIR"]
    cache = os.path.join(tmpdir, "root", "flash_attention_cute_dsl_cache", "f1nger")
    for family, key in [("fwd", "a"), ("fwd", "b"), ("bwd", "c"), ("fwd", "d"), ("bwd_pre", "e")]:
        os.makedirs(os.path.join(cache, family), exist_ok=True)
        open(os.path.join(cache, family, key + ".o"), "w").close()
        open(os.path.join(cache, family, key + ".lock"), "w").close()
    open(os.path.join(cache, "fwd", ".x.123.tmp.o"), "w").close()  # a write in progress
    for other in ("other", "old_flash_attention_cute_dsl_cache"):  # not FlashAttention's cache
        os.makedirs(os.path.join(tmpdir, other, "fwd"))
        open(os.path.join(tmpdir, other, "fwd", "z.o"), "w").close()
    kernels = first_step.flash_attention_kernels(str(tmp_path))
    assert kernels == {"fwd": 3, "bwd": 1, "bwd_pre": 1} and list(kernels)[0] == "fwd"


def test_every_cache_lives_under_the_rounds_directory(tmp_path, monkeypatch):
    for name in first_step.CACHE_VARIABLES:
        monkeypatch.setenv(name, "/the/users/own")  # the round's directories win over the environment's
    env = first_step.cache_environment(str(tmp_path))
    for name in first_step.CACHE_VARIABLES:
        assert env[name] == str(tmp_path / name.lower()) and os.path.isdir(env[name])


def test_the_first_and_the_last_record_are_timed_when_their_lines_appear(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    writer = subprocess.Popen([sys.executable, "-c", (
        "import time; f = open(%r, 'w'); f.write('{\"run\": {}}\\n'); f.flush(); time.sleep(1.0); "
        "f.write('{\"step\": 1}\\n'); f.flush(); time.sleep(1.0); f.write('{\"step\": 2}\\n'); f.flush(); "
        "time.sleep(1.0)") % str(metrics)])
    start = first_step.time.perf_counter()
    first, last = first_step._record_seconds(str(metrics), writer, start)
    wall = first_step.time.perf_counter() - start
    writer.wait()
    # not before their lines: the writer sleeps 1 s before each, and 1 s after the last
    assert 1.0 <= first and first + 1.0 <= last + first_step.POLL_SECONDS and last + 1.0 <= wall + first_step.POLL_SECONDS
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    assert first_step._record_seconds(str(tmp_path / "none.jsonl"), ended, 0.0) == (None, None)


def _write_profile(path, cumulative: dict[str, float]) -> str:
    """A cProfile file (marshal of pstats' dict) whose functions have these cumulative seconds."""
    import marshal

    stats = {(f"/x/{name}.py", 1, name): (1, 1, 0.0, seconds, {}) for name, seconds in cumulative.items()}
    with open(path, "wb") as f:
        marshal.dump(stats, f)
    return str(path)


def test_where_the_fresh_runs_seconds_go_by_hand(tmp_path):
    fresh = _write_profile(tmp_path / "fresh.prof", {"main": 50.0, "sft": 9.0, "load": 7.0, "imports": 17.0})
    warm = _write_profile(tmp_path / "warm.prof", {"main": 38.0, "sft": 2.0, "imports": 18.0})
    assert first_step.profile_growth(fresh, warm, top=3) == [
        ("main.py:1(main)", 50.0, 38.0), ("sft.py:1(sft)", 9.0, 2.0), ("load.py:1(load)", 7.0, 0.0)]


def test_a_profiled_run_runs_the_script_under_cprofile_through_torchrun(tmp_path):
    """run_command's cProfile arguments, as torchrun passes them on: the script runs as __main__
    with its flags, and the profile holds its functions."""
    script = tmp_path / "script.py"
    script.write_text("import sys\ndef work():\n    return sys.argv[1:3]\nif __name__ == '__main__':\n"
                      "    assert work() == ['--flag', '3'], sys.argv\n")
    profile = str(tmp_path / "run.prof")
    command = first_step.run_command(["--flag", "3"], str(tmp_path), profile)
    command[command.index(os.path.join(first_step.REPO, "pretrain_rl.py"))] = str(script)
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert any(name == "work" for (_, _, name) in pstats.Stats(profile).stats)


def test_a_profiled_rounds_growth_is_in_the_report(tmp_path, monkeypatch):
    """main with the runs stood in for: each writes its profile where it is told."""
    cumulative = {"fresh": {"main": 50.0, "sft": 9.0}, "warm": {"main": 38.0, "sft": 2.0}}
    later = {"time/step_s": 1.0, "time/generation_s": 1.0, "time/training_s": 1.0, "time/optimizer_s": 1.0}

    def run_once(flags, cache_dir, work_dir, profile):
        run = "warm" if os.path.exists(os.path.join(work_dir, "fresh_ran")) else "fresh"
        open(os.path.join(work_dir, "fresh_ran"), "w").close()
        _write_profile(profile, cumulative[run])
        return _run(2.0, 1.0, 1.0, 1.0, 1.0, 1.0, later)

    monkeypatch.setattr(first_step, "run_once", run_once)
    output = tmp_path / "report.json"
    monkeypatch.setattr(sys, "argv", ["first_step.py", "--profile", str(tmp_path / "prof"), "--output", str(output),
                                      "--", "--recipe", "x.yaml"])
    first_step.main()
    report = json.loads(output.read_text())
    assert report["profiled"] is True
    assert report["rounds"][0]["profile_growth"] == [["main.py:1(main)", 50.0, 38.0], ["sft.py:1(sft)", 9.0, 2.0]]

