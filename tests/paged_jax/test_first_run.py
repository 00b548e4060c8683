"""Issue 17's rough edges of a first run: errors that name the file and say what is wrong,
help texts a terminal shows as they are, the compilation cache's settings."""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import pytest

from paged_jax import cli, cli_run, compile_cache, models
from tests.models import helpers


def _checkpoint(path):
  hf = helpers.hf_config_dict("llama")
  tensors = helpers.hf_tensors(models.ModelConfig.from_hf_dict(hf))
  helpers.write_numpy_checkpoint(path, hf, tensors, shards=1)


def test_plan_with_broken_json_names_the_file_and_says_json(tmp_path, capsys):
  (tmp_path / "config.json").write_text('{"num_hidden_layers": 2,')
  with pytest.raises(SystemExit) as exc:
    cli.main(["plan", "--config", str(tmp_path)])
  assert exc.value.code == 2
  err = capsys.readouterr().err
  assert str(tmp_path / "config.json") in err and "not valid JSON" in err
  assert err.count("\n") == 1, err  # one line, no traceback


def test_truncated_safetensors_is_one_line_naming_the_file(tmp_path, capsys):
  _checkpoint(tmp_path)
  file = tmp_path / "model.safetensors"
  data = file.read_bytes()
  file.write_bytes(data[: len(data) - 100])
  with pytest.raises(ValueError, match="truncated") as exc:
    models.load_pretrained(tmp_path, dtype=jnp.float32)
  assert str(file) in str(exc.value)
  with pytest.raises(SystemExit) as sysexit:
    cli.main(["run", "--model", str(tmp_path), "--no-progress"])
  assert sysexit.value.code == 2
  err = capsys.readouterr().err
  assert "truncated" in err and str(file) in err and err.count("\n") == 1, err


def test_garbage_safetensors_header_is_named(tmp_path):
  _checkpoint(tmp_path)
  (tmp_path / "model.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
  with pytest.raises(ValueError, match="not a valid safetensors file"):
    models.load_pretrained(tmp_path, dtype=jnp.float32)


def test_path_to_config_json_is_accepted(tmp_path):
  _checkpoint(tmp_path)
  model, config = models.load_pretrained(tmp_path / "config.json", dtype=jnp.float32)
  assert config.num_layers == helpers.hf_config_dict("llama")["num_hidden_layers"]
  with pytest.raises(ValueError, match="checkpoint directory"):
    models.load_pretrained(tmp_path / "model.safetensors")


def _parsers(parser):
  yield parser
  for action in parser._actions:
    if isinstance(action, argparse._SubParsersAction):
      for sub in action.choices.values():
        yield from _parsers(sub)


def test_help_texts_are_plain_and_show_every_default():
  for parser in _parsers(cli.build_parser()):
    text = parser.format_help()
    assert "``" not in text and ":func:" not in text, text
    for action in parser._actions:
      if action.option_strings and action.help and action.help is not argparse.SUPPRESS:
        if action.dest in ("help", "version"):
          continue
        assert "default" in action.help, (parser.prog, action.option_strings)


def test_max_tokens_without_prompt_is_refused(capsys):
  with pytest.raises(SystemExit) as exc:
    cli.main(["run", "--max-tokens", "8", "--no-progress"])
  assert exc.value.code == 2
  assert "--max-tokens=8 applies to --prompt" in capsys.readouterr().err


def test_compilation_cache_settings(tmp_path, monkeypatch):
  monkeypatch.delenv(compile_cache.ENV_VAR, raising=False)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert compile_cache.resolve(True) == tmp_path / "xdg" / "paged_jax" / "jax"
  assert compile_cache.resolve(False) is None
  assert compile_cache.resolve(str(tmp_path / "c")) == tmp_path / "c"
  assert compile_cache.resolve("off") is None
  monkeypatch.setenv(compile_cache.ENV_VAR, str(tmp_path / "env"))
  assert compile_cache.resolve(True) == tmp_path / "env"
  monkeypatch.setenv(compile_cache.ENV_VAR, "off")
  assert compile_cache.resolve(True) is None
  with pytest.raises(ValueError, match="compilation_cache=3"):
    compile_cache.resolve(3)
  # A directory that cannot be made is named as the user gave it: the environment
  # variable, the CLI's flag, or the argument (each was "compilation_cache=...").
  blocker = tmp_path / "file"
  blocker.write_text("")
  monkeypatch.setenv(compile_cache.ENV_VAR, str(blocker / "sub"))
  config = compile_cache.jax.config
  current = config.jax_compilation_cache_dir
  config.update("jax_compilation_cache_dir", None)  # else enable keeps the one JAX has
  try:
    with pytest.raises(ValueError, match=f"^{compile_cache.ENV_VAR}='.*file/sub' cannot be"):
      compile_cache.enable(True)
    with pytest.raises(ValueError, match="^--compilation-cache='.*file' cannot be created: "
                       r".*\(a file of that name is there; it must be a directory\)$"):
      compile_cache.enable(str(blocker), override=True, name="--compilation-cache")
    with pytest.raises(ValueError, match="^compilation_cache='.*file' cannot be created"):
      compile_cache.enable(str(blocker))
  finally:
    config.update("jax_compilation_cache_dir", current)


def _plan_sequences(capsys, *extra) -> tuple[int, str]:
  assert cli.main(["plan", "--budget", "16GiB", *extra]) == 0
  out = capsys.readouterr().out
  row = next(line for line in out.splitlines() if line.startswith("| paged |"))
  return int(row.split("|")[2]), out


def test_plan_kv_cache_dtype_counts_scales_and_fits_about_twice(capsys):
  bf16, _ = _plan_sequences(capsys)
  int8, out = _plan_sequences(capsys, "--kv-cache-dtype", "int8")
  # 2 * 32 layers * 8 KV heads * (128 one-byte values + a 4-byte scale) per token
  assert "per token  : 67584 bytes" in out and "scales" in out
  assert "D=128 dtype=bfloat16, KV pool int8" in out  # the model stays bfloat16
  assert 1.8 <= int8 / bf16 <= 2.0, (int8, bf16)
  fp8, _ = _plan_sequences(capsys, "--kv-cache-dtype", "float8_e4m3fn")
  assert fp8 == int8


def test_run_report_names_a_quantised_pool():
  args = cli.build_parser().parse_args(["run", "--kv-cache-dtype", "float8_e5m2"])
  assert args.kv_cache_dtype == "float8_e5m2"
  # float16 models as `plan --dtype` and load_pretrained take them (run refused the choice)
  assert cli.build_parser().parse_args(["run", "--dtype", "float16"]).dtype == "float16"
  stats = dict(requests=1, generated_tokens=4, wall_s=1.0, tokens_per_s=4.0, requests_per_s=1.0,
               num_blocks=8, num_free_blocks=8, block_size=16, kv_cache_dtype="int8",
               kv_pool_bytes=3 * 2**20, peak_blocks_in_use=1, mean_blocks_in_use=1.0,
               kv_utilization=0.5, preemptions=0, prefix_hit_rate=0.0, steps=4,
               device_calls=1, host_syncs=1, host_syncs_per_token=0.25)
  report = cli_run.format_report(stats, title="t", compile_s=2.0)
  assert "int8 with a float32 scale per token and KV head, 3.0 MiB" in report
  assert "compile time" in report and "no leak" in report
  assert "prefix caching off" not in report
  stats.update(prefix_caching=False, kv_group_windows=(16,))
  report = cli_run.format_report(stats, title="t", compile_s=2.0)
  assert "0.0% (prefix caching off: every layer has a sliding window)" in report
  stats.update(kv_group_windows=(16, None))  # turned off by the user
  report = cli_run.format_report(stats, title="t", compile_s=2.0)
  assert "0.0% (prefix caching off)" in report
  # One block of a small pool: "1 blocks ... 0.0 MiB" and "1 device calls" before.
  stats.update(num_blocks=1, num_free_blocks=1, kv_pool_bytes=24 * 1024)
  report = cli_run.format_report(stats, title="t")
  assert "1 block of 16 tokens, int8 with a float32 scale per token and KV head, 24.0 KiB" \
      in report
  assert "4 in 1 device call\n" in report


def test_run_int8_pool_end_to_end(capsys):
  # `paged-jax run --kv-cache-dtype int8` through the console script's entry point on the
  # embedded model: a tiny workload (one token bucket, one compiled device call) served
  # from an int8 pool, whose report names the pool and its bytes with the scales: 1024
  # blocks * 16 tokens * 2 layers * 2 KV heads * K and V * (32 one-byte values + a 4-byte
  # scale) = 4.5 MiB (a bfloat16 pool: 8.0 MiB).
  code = cli.main(["run", "--kv-cache-dtype", "int8", "--num-requests", "4",
                   "--prompt-median", "8", "--output-median", "4", "--num-blocks", "1024",
                   "--max-seqs", "4", "--max-tokens-per-step", "32", "--steps-per-call", "4",
                   "--compilation-cache", "off"])
  assert code == 0
  out, err = capsys.readouterr()
  # The cache is off: no promise that a warm cache would load the calls.
  assert "device calls to compile (the compilation cache is off):" in err, err
  pool = next(line for line in out.splitlines() if line.strip().startswith("KV pool"))
  assert ("1024 blocks of 16 tokens, int8 with a float32 scale per token and KV head, "
          "4.5 MiB") in pool, pool
  assert "4 synthetic requests" in out and "no leak" in out
  generated = next(line for line in out.splitlines() if "generated tokens" in line)
  assert int(generated.split()[-1]) >= 4, generated


def test_run_with_arrivals_reports_each_requests_wait(capsys):
  # `paged-jax run --request-rate R`: the workload's requests arrive over time (a Poisson
  # process) and join the running batch through a session; the report gives the waits for
  # the first token and the latencies, and every block is back.
  code = cli.main(["run", "--request-rate", "400", "--num-requests", "6",
                   "--prompt-median", "8", "--output-median", "4", "--num-blocks", "64",
                   "--max-seqs", "4", "--max-tokens-per-step", "32", "--steps-per-call", "4",
                   "--compilation-cache", "off", "--no-progress"])
  assert code == 0
  out = capsys.readouterr().out
  assert out.startswith("paged-jax run: 6 synthetic requests arriving at 400/s on "), out
  rows = {line.split("  ")[1].strip(): line for line in out.splitlines()[1:]}
  assert rows["requests"].split()[-1] == "6" and "no leak" in out
  ttft = re.search(r"p50 ([\d.]+) s, p90 ([\d.]+) s, max ([\d.]+) s \(from each request's "
                   r"arrival\)", rows["time to first token"])
  latency = re.search(r"p50 ([\d.]+) s, p90 ([\d.]+) s, max ([\d.]+) s \(arrival to",
                      rows["request latency"])
  assert ttft and latency, out
  assert 0 <= float(ttft[1]) <= float(ttft[2]) <= float(ttft[3]) <= float(latency[3])
  # The serving time runs from the first arrival to the last token, waits for arrivals
  # included (the engine's own time is its busy row); the rates divide by it.
  serving = float(re.search(r"serving time +([\d.]+) s \(first arrival to last token\)",
                            rows["serving time"])[1])
  busy = float(re.search(r"engine busy +([\d.]+) s \(", rows["engine busy"])[1])
  generated = int(rows["generated tokens"].split()[-1])
  assert float(latency[3]) <= serving + 0.01 and busy <= serving + 0.01
  tokens_per_s = float(re.search(r"tokens/s +([\d.]+)", rows["tokens/s"])[1])
  assert tokens_per_s == pytest.approx(generated / serving, rel=0.05)


def test_cli_parses_without_importing_jax():
  # `paged-jax run` says what it is doing before JAX loads (~2 s): nothing up to argument
  # parsing imports JAX, and `import paged_jax` stays light until a name is used.
  import subprocess
  import sys
  code = ("import sys, paged_jax, paged_jax.cli as c; c.build_parser().parse_args(['run']); "
          "assert 'jax' not in sys.modules, 'jax imported'; "
          "from paged_jax import LLM, KVCache, allocator; assert 'jax' in sys.modules")
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        cwd=pathlib.Path(__file__).parents[2])
  assert proc.returncode == 0, proc.stderr


def test_steady_tokens_per_s_counts_bursts_not_events():
  # One device call delivers its tokens as a burst of events microseconds apart: the
  # steady rate is taken between bursts (10 tokens every 0.1 s = 100 tokens/s), never
  # between two events of one burst (which would claim millions).
  p = cli_run._Progress(total=4, enabled=False)
  p.trace = [(0.1 * call + 1e-6 * k, 10 * call + k + 1) for call in range(10) for k in range(10)]
  p.tokens = 100
  assert p.steady_tokens_per_s() == pytest.approx(100.0)
  p.trace, p.tokens = [(0.1 + 1e-6 * k, k + 1) for k in range(40)], 40  # one device call
  assert p.steady_tokens_per_s() == 0.0


def test_run_kv_budget_groups_a_hybrid_checkpoint(tmp_path, capsys):
  # `paged-jax run --model DIR --kv-budget ...` on a tiny Qwen2 checkpoint whose layers
  # from max_window_layers on slide: the pool is sized in bytes, the layers go in KV
  # groups, and the report says so; the prefix cache stays on.
  hf = helpers.hf_config_dict("qwen2", sliding_window=8, num_hidden_layers=2,
                              use_sliding_window=True, max_window_layers=1)
  tensors = helpers.hf_tensors(models.ModelConfig.from_hf_dict(hf))
  helpers.write_numpy_checkpoint(tmp_path, hf, tensors, shards=1)
  code = cli.main(["run", "--model", str(tmp_path), "--kv-budget", "256KiB",
                   "--num-requests", "4", "--prompt-median", "12", "--output-median", "4",
                   "--block-size", "4", "--max-seqs", "4", "--max-tokens-per-step", "32",
                   "--steps-per-call", "4", "--compilation-cache", "off", "--no-progress"])
  assert code == 0
  out = capsys.readouterr().out
  groups = next(line for line in out.splitlines() if line.strip().startswith("KV groups"))
  assert "2: 1 full, 1 sliding (window 8), one block table each" in groups, groups
  assert "no leak" in out and "prefix caching off" not in out


@pytest.mark.parametrize("argv,match", [
    (["--kv-budget", "1MiB", "--num-blocks", "64"], "--kv-budget=1MiB and --num-blocks=64"),
    (["--kv-budget", "lots"], "--kv-budget='lots' must be a size like '16GiB'"),
    # The parser's own reason (it said "must be a size like" of 1e300 too).
    (["--kv-budget", "1e300"], "--kv-budget='1e300' must be below 1 EiB"),
    (["--kv-budget", "0.4"], "--kv-budget=0.4 must hold one KV block at least"),
    # --prompt serves one prompt: the workload's options were ignored without a word.
    (["--prompt", "hi", "--num-requests", "5"], "--num-requests=5 applies to the synthetic "
     "workload only; --prompt serves that one prompt"),
    (["--prompt", "hi", "--sigma", "0.5"], "--sigma=0.5 applies to the synthetic workload"),
    (["--stop", "."], "--stop='.' applies to --prompt only"),
    (["--prompt", "hi", "--stop", ".", "--stop", ""], "--stop='' is empty"),
    (["--request-rate", "0"], "--request-rate=0.0 must be a finite number > 0"),
    (["--request-rate", "inf"], "--request-rate=inf must be a finite number > 0"),
    (["--request-rate", "1e-9"], "64 requests would take about 6.4e+10 s to arrive, more "
     "than a day"),
    (["--prompt", "hi", "--request-rate", "5"], "--request-rate=5.0 applies to the "
     "synthetic workload only")])
def test_run_kv_budget_is_checked_before_jax_loads(argv, match, capsys):
  with pytest.raises(SystemExit) as exc:
    cli.main(["run", *argv, "--no-progress"])
  assert exc.value.code == 2 and match in capsys.readouterr().err


def test_version_and_counts_read_as_english(capsys):
  # `paged-jax --version` prints the installed version (without loading JAX: it exits in
  # argument parsing); one of a thing is singular in the reports.
  with pytest.raises(SystemExit) as exc:
    cli.main(["--version"])
  assert exc.value.code == 0
  assert capsys.readouterr().out.strip() == f"paged-jax {cli._version()}"
  assert cli._version().count(".") >= 2
  # One version everywhere: the installed metadata, the package, pyproject.toml.
  import paged_jax
  import tomllib
  pyproject = pathlib.Path(__file__).parents[2] / "pyproject.toml"
  declared = tomllib.loads(pyproject.read_text())["project"]["version"]
  assert cli._version() == paged_jax.__version__ == declared
  from paged_jax._words import count  # run's and plan's reports count with it
  assert count(1, "synthetic request") == "1 synthetic request"
  assert count(64, "request") == "64 requests"
  assert (count(1, "group"), count(2, "layer")) == ("1 group", "2 layers")


def test_an_explicit_cache_setting_replaces_jax_compilation_cache_dir(tmp_path):
  # `paged-jax run --compilation-cache DIR|off` was ignored when JAX_COMPILATION_CACHE_DIR
  # was set (the library keeps a directory the user gave JAX; the CLI's explicit flag now
  # wins). One subprocess: JAX's cache directory is process-wide.
  script = textwrap.dedent("""
      import os, sys
      import jax, jax.numpy as jnp
      from paged_jax import compile_cache
      env_dir, own_dir = sys.argv[1:3]
      jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
      assert compile_cache.enable(True) == compile_cache.pathlib.Path(env_dir)  # kept
      jax.jit(lambda x: x + 1)(jnp.ones(3)).block_until_ready()
      before = len(os.listdir(env_dir))
      assert before > 0
      assert str(compile_cache.enable(own_dir, override=True)) == own_dir
      jax.jit(lambda x: x * 3)(jnp.ones(4)).block_until_ready()
      assert len(os.listdir(own_dir)) > 0 and len(os.listdir(env_dir)) == before
      assert compile_cache.enable("off", override=True) is None
      assert not jax.config.jax_compilation_cache_dir
      written = len(os.listdir(own_dir))
      jax.jit(lambda x: x - 5)(jnp.ones(6)).block_until_ready()
      assert len(os.listdir(own_dir)) == written and len(os.listdir(env_dir)) == before
      print("ok")
  """)
  env_dir, own_dir = tmp_path / "env", tmp_path / "own"
  env_dir.mkdir()
  env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(env_dir))
  out = subprocess.run([sys.executable, "-c", script, str(env_dir), str(own_dir)], env=env,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_an_engine_whose_cache_directory_is_not_used_says_so(tmp_path):
  # A second engine's compilation_cache="B", after a first set "A", used A in silence
  # (one cache per process); now a warning at the user's line names both.
  script = textwrap.dedent("""
      import sys, warnings
      from paged_jax import LLM, ModelConfig
      from paged_jax.models import init_random
      a, b = sys.argv[1:3]
      c = ModelConfig(model_type='llama', vocab_size=64, embed_dim=32, mlp_dim=48,
                      num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, max_seq_len=32)
      model = init_random(c, seed=0, impl='xla')
      with warnings.catch_warnings():
        warnings.simplefilter("error")
        first = LLM(model, c, num_blocks=8, max_seqs=2, compilation_cache=a)
        LLM(model, c, num_blocks=8, max_seqs=2, compilation_cache=a)  # the same: silent
      with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        second = LLM(model, c, num_blocks=8, max_seqs=2, compilation_cache=b)  # line 15
      assert str(second.compilation_cache_dir) == a == str(first.compilation_cache_dir)
      [w] = caught
      print(w.lineno, w.message)
      with warnings.catch_warnings():  # False / "off" leave JAX's cache alone, as documented
        warnings.simplefilter("error")
        LLM(model, c, num_blocks=8, max_seqs=2, compilation_cache=False)
        LLM(model, c, num_blocks=8, max_seqs=2, compilation_cache="off")
  """)
  a, b = str(tmp_path / "a"), str(tmp_path / "b")
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  out = subprocess.run([sys.executable, "-c", script, a, b], capture_output=True, text=True,
                       timeout=300, env=env)
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.strip() == (
      f"15 compilation_cache={b!r} is not used: JAX's compilation cache is {a!r} in this "
      "process (set before, by another engine, the CLI or JAX_COMPILATION_CACHE_DIR), and one "
      "process has one")


def test_warnings_point_past_the_package_but_not_past_a_sibling_file():
  # The stack walk took a user's paged_jax_demo.py, beside the package, for the package.
  from paged_jax import _caller
  package = _caller._PACKAGE
  assert _caller._inside(os.path.join(package, "engine", "llm.py"))
  assert not _caller._inside(package + "_demo.py")
  assert not _caller._inside(os.path.join(os.path.dirname(package), "script.py"))


@pytest.mark.slow
def test_a_warm_run_says_its_calls_came_from_the_compilation_cache(tmp_path):
  # A warm run printed "compiling 1/3 ..." and a compile time with no word that the calls
  # were loaded, not compiled. JAX's cache-hit events now count them, in the progress
  # lines and the report. Subprocesses: JAX's cache directory is process-wide.
  argv = [sys.executable, "-m", "paged_jax.cli", "run", "--num-requests", "4",
          "--prompt-median", "8", "--output-median", "4", "--max-seqs", "4",
          "--max-tokens-per-step", "32", "--compilation-cache", str(tmp_path / "cache")]
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  runs = [subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
          for _ in range(2)]
  for run in runs:
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Warning" not in run.stderr, run.stderr[-3000:]  # the flag's cache is the engine's
  compile_line = lambda run: next(line for line in run.stdout.splitlines()
                                  if "compile time" in line)
  cold, warm = map(compile_line, runs)
  assert cold.endswith("(before serving; not counted below; none loaded from the "
                       "compilation cache)"), cold
  loaded = re.search(r"; (\d) of 3 device calls loaded from the compilation cache\)$", warm)
  assert loaded and int(loaded.group(1)) >= 1, warm
  assert f"{loaded.group(1)} of 3 loaded from the compilation cache" in runs[1].stderr
  # The first progress line comes after a while, not at the first token (a rate over a
  # moment: "served 0/4 requests, 1 token, 50 tokens/s, 0.0 s").
  assert "served 0/4 requests, 1 token," not in runs[1].stderr, runs[1].stderr


def test_ctrl_c_during_a_run_is_one_line_and_exit_130(tmp_path):
  # Ctrl-C while `paged-jax run` compiled printed a long traceback into JAX, then the
  # interpreter crashed tearing JAX down mid-compilation (SIGSEGV, exit 139).
  import signal
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  # As from a terminal: a suite started in the background (`cmd &` in a script) ignores
  # SIGINT, and Python then leaves it ignored in every child (the run served to the end).
  restore = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)
  proc = subprocess.Popen([sys.executable, "-m", "paged_jax.cli", "run", "--compilation-cache",
                           "off", "--num-requests", "4"], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
                          preexec_fn=restore)
  for line in proc.stderr:  # interrupt while it compiles its first device call
    if "compiling 1/" in line:
      break
  proc.send_signal(signal.SIGINT)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 130, err
  assert err.strip().splitlines()[-1] == "paged-jax run: interrupted" and "Traceback" not in err
