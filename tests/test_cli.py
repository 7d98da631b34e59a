"""`hetero-infer` from a shell: every bad input exits 2 with one line `hetero-infer: error: <flag>:
...` (no traceback), every flag has help with its default, the seed project's spellings and config
file work, and `generate` / `serve` resolve their options."""

import argparse
import io
import json
import os
import socket
import subprocess
import sys
import pytest
import torch
from hetero_infer.cli.flags import build_parser, hpi_argv
from hetero_infer.cli.main import main
from hetero_infer.cli.config import serve_options, engine_config
from hetero_infer.cli.flags import ENGINE_FLAGS, CLI_ARGS, COMMANDS
from hetero_infer.cli.flags import register_cli_args, register_command, register_engine_flags
from hetero_infer.bench.main import bench_command
from hetero_infer.core.config import DEMO_MODEL_DIR

SEED_CONFIG = {
    "block_size": 16,
    "max_num_blocks": 1024,
    "max_batch_size": 32,
    "max_num_seqs": 256,
    "max_model_len": 2048,
    "max_total_tokens": 4096,
    "memory_threshold": 0.9,
    "max_retry_attempts": 2,
    "tokenizer": {"kind": "simple", "path": None},
    "serving": {
        "host": "127.0.0.1",
        "port": 3000,
        "model_name": "hetero-infer",
        "backend": {"kind": "local_engine", "command": None},
    },
}


def run_main(capsys, *argv):
    "Exit status and stderr of `hetero-infer argv...` in-process (argparse exits via SystemExit)."
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def error_line(err: str) -> str:
    lines = [l for l in err.splitlines() if l.startswith("hetero-infer: error:")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize(
    "argv, flag, words",
    [
        (["generate", "x", "--model", "/nonexistent/model"], "--model", "no such directory"),
        (["serve", "--model", "/nonexistent/model"], "--model", "no such directory"),
        (
            ["generate", "x", "--model", "Qwen/Qwen3-0.6B"],
            "--model",
            "huggingface-cli download Qwen/Qwen3-0.6B",
        ),
        (["generate", "x", "--config", "/nonexistent.json"], "--config", "no such file"),
        (["serve", "--config", "/nonexistent.json"], "--config", "no such file"),
        (["generate", "x", "--block-size", "3"], "--block-size", "power of two"),
        (["generate", "x", "--max-tokens", "0"], "--max-tokens", "max_tokens"),
        (["generate", "x", "--temperature", "-1"], "--temperature", "temperature"),
        (["generate", "x", "--memory-threshold", "2"], "--memory-threshold", "memory_threshold"),
        (["serve", "--port", "70000"], "--port", "65535"),
        (["serve", "--top-p", "0"], "--top-p", "top_p"),
        (["serve", "--request-timeout", "0"], "--request-timeout", "> 0"),
        (["generate", "x", "--tokenizer", "/nonexistent/tok"], "--tokenizer", "no such directory"),
    ],
)
def test_bad_inputs_exit_2_naming_the_flag(capsys, argv, flag, words):
    code, err = run_main(capsys, *argv)
    line = error_line(err)
    assert code == 2 and line.startswith(f"hetero-infer: error: {flag}") and words in line, err


def test_hub_id_says_local_only(capsys):
    code, err = run_main(capsys, "serve", "--model", "Qwen/Qwen3-0.6B")
    line = error_line(err)
    assert code == 2 and "local" in line and "never downloads" in line and "--local-dir" in line


def test_model_dir_without_config(capsys, tmp_path):
    code, err = run_main(capsys, "generate", "x", "--model", str(tmp_path))
    assert code == 2 and "no config.json" in error_line(err)


def test_malformed_config(capsys, tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    code, err = run_main(capsys, "generate", "x", "--config", str(tmp_path / "bad.json"))
    assert (
        code == 2
        and error_line(err).startswith("hetero-infer: error: --config:")
        and "not valid JSON" in err
    )
    (tmp_path / "unknown.json").write_text(json.dumps({"no_such_key": 1}))
    code, err = run_main(capsys, "serve", "--config", str(tmp_path / "unknown.json"))
    assert code == 2 and "no_such_key" in error_line(err)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda(capsys):
    code, err = run_main(capsys, "generate", "x", "--device", "cuda")
    assert (
        code == 2
        and error_line(err).startswith("hetero-infer: error: --device: cuda")
        and "--device cpu" in err
    )


def run_cli_subprocess(argv, block_triton=False, env=None, timeout=300):
    "Exit status and stderr of `hetero-infer argv...` in a fresh interpreter (env None: unset)."
    code = (
        "import json, sys\n"
        + (
            "sys.modules['triton'] = None  # as if not installed: `import triton` raises\n"
            if block_triton
            else ""
        )
        + "from hetero_infer.cli.main import main\nsys.exit(main(json.loads(sys.argv[1])))"
    )
    env = {
        k: v
        for k, v in {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}.items()
        if v is not None
    }
    r = subprocess.run(
        [sys.executable, "-c", code, json.dumps(argv)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert "Traceback" not in r.stderr, r.stderr
    return r.returncode, r.stderr


def _triton_modules():
    return {k: v for k, v in sys.modules.items() if k == "triton" or k.startswith("triton.")}


def test_triton_backend_where_it_cannot_run():
    """Hiding triton, or importing it without TRITON_INTERPRET, happens in subprocesses: done here
    it left `triton.*` modules behind that broke later tests (e.g.
    tests/test_engine.py::test_prompt_longer_than_max_model_len)."""
    before = _triton_modules()
    code, err = run_cli_subprocess(
        ["generate", "x", "--attention-backend", "triton", "--device", "cpu"], block_triton=True
    )
    assert (
        code == 2
        and error_line(err).startswith(
            "hetero-infer: error: --attention-backend: triton is not installed"
        )
        and "--attention-backend torch" in err
    )
    if not torch.cuda.is_available():
        code, err = run_cli_subprocess(
            ["generate", "x", "--attention-backend", "triton"], env={"TRITON_INTERPRET": None}
        )
        assert code == 2 and "needs a CUDA device" in error_line(err)
    after = _triton_modules()
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)


def test_a_bad_value_from_the_config_names_the_config(capsys, tmp_path):
    """The seed's config (max_model_len 2048) on the demo model (64 positions): the error names
    --config and the key, not a flag the user never gave; the same value as a flag names the flag;
    the flag overrides the file."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(SEED_CONFIG))
    code, err = run_main(capsys, "generate", "x", "--config", str(cfg))
    line = error_line(err)
    assert (
        code == 2
        and line.startswith(f"hetero-infer: error: --config: {cfg} sets 'max_model_len'")
        and "limit of 64" in line
    ), line
    code, err = run_main(capsys, "generate", "x", "--max-model-len", "2048")
    assert code == 2 and error_line(err).startswith(
        "hetero-infer: error: --max-model-len: max_model_len (2048)"
    )
    assert (
        main(
            [
                "generate",
                "--chat",
                "reverse: a b c",
                "--config",
                str(cfg),
                "--max-model-len",
                "64",
                "--max-tokens",
                "8",
            ]
        )
        == 0
    )
    assert "'reverse: a b c' -> 'c b a'" in capsys.readouterr().out


def test_serve_with_the_seed_config_names_the_config(tmp_path):
    """The seed's own command, `hetero-infer --serve --config config.json`, on the demo model:
    exit 2 naming --config and the key."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(dict(SEED_CONFIG, serving=dict(SEED_CONFIG["serving"], port=port))))
    code, err = run_cli_subprocess(["--serve", "--config", str(cfg)], timeout=120)
    assert code == 2 and error_line(err).startswith(
        f"hetero-infer: error: --config: {cfg} sets 'max_model_len'"
    ), err


def test_argparse_errors_use_our_format(capsys):
    for argv in (
        ["generate", "--bogus"],
        ["serve", "--port", "abc"],
        ["generate", "--dtype", "int3"],
        [],
    ):
        code, err = run_main(capsys, *argv)
        assert code == 2 and error_line(err), (argv, err)


def test_busy_port_is_refused_before_loading(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        code, err = run_main(capsys, "serve", "--port", str(s.getsockname()[1]))
    assert code == 2 and error_line(err).startswith("hetero-infer: error: --port: cannot listen")


def all_parsers():
    ap = build_parser()
    subs = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction)).choices
    return ap, subs


def test_every_flag_has_help_with_its_default():
    """generate, serve, demo and bench offline/serve: every option's help shows its default, and
    its choices when it has some."""
    _, subs = all_parsers()
    parsers = {name: subs[name] for name in ("generate", "serve", "demo")}
    bench = next(
        a for a in subs["bench"]._actions if isinstance(a, argparse._SubParsersAction)
    ).choices
    parsers.update({f"bench {name}": p for name, p in bench.items()})
    assert {"bench offline", "bench serve"} <= set(parsers)
    for name, p in parsers.items():
        for a in p._actions:
            if (
                a.help == argparse.SUPPRESS
                or isinstance(a, argparse._HelpAction)
                or not a.option_strings
            ):
                continue
            assert a.help and "default" in a.help, (name, a.option_strings, a.help)
            if a.choices:
                assert all(str(c) in p.format_help() for c in a.choices), (name, a.option_strings)


def test_help_is_complete(capsys):
    for argv in (["--help"], ["serve", "--help"], ["generate", "--help"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in (
        "--host",
        "--port",
        "--served-model-name",
        "--api-key",
        "--config",
        "--max-num-blocks",
        "--max-batch-size",
        "--max-total-tokens",
        "--memory-threshold",
        "--max-tokens",
        "--temperature",
        "--top-p",
        "--max-queued-requests",
        "--request-timeout",
        "--input",
        "--serve",
    ):
        assert flag in out, flag


def test_engine_flags_cover_generate_and_serve():
    _, subs = all_parsers()
    for field, (flags, *_) in ENGINE_FLAGS.items():
        for name in ("generate", "serve"):
            opts = subs[name]._option_string_actions
            assert all(f in opts for f in flags) or field not in {
                f.name
                for f in __import__("dataclasses").fields(
                    __import__("hetero_infer.core.sampling_params").core.EngineConfig
                )
            }, (field, name)


def test_seed_spellings():
    a = build_parser().parse_args(
        hpi_argv(
            [
                "--serve",
                "--max-num-blocks",
                "64",
                "--max-batch-size",
                "4",
                "--max-total-tokens",
                "512",
                "--memory-threshold",
                "0.8",
                "--max-tokens",
                "7",
                "--temperature",
                "0.5",
                "--top-p",
                "0.9",
            ]
        )
    )
    assert (
        a.command,
        a.num_blocks,
        a.max_num_seqs,
        a.max_num_batched_tokens,
        a.memory_threshold,
    ) == ("serve", 64, 4, 512, 0.8)
    o = serve_options(a)
    assert o["default_sampling"] == {"max_tokens": 7, "temperature": 0.5, "top_p": 0.9}
    a = build_parser().parse_args(hpi_argv(["--input", "hello", "--max-tokens", "3"]))
    assert (a.command, a.input, a.max_tokens) == ("generate", ["hello"], 3)


def test_serve_defaults_and_the_seed_config(tmp_path, monkeypatch):
    monkeypatch.delenv("HETERO_INFER_API_KEY", raising=False)
    o = serve_options(build_parser().parse_args(["serve"]))
    assert (o["host"], o["port"], o["served_model_name"], o["api_key"]) == (
        "127.0.0.1",
        3000,
        "hetero-infer",
        None,
    )
    monkeypatch.setenv("HETERO_INFER_API_KEY", "k1")
    assert serve_options(build_parser().parse_args(["serve"]))["api_key"] == "k1"
    assert serve_options(build_parser().parse_args(["serve", "--api-key", "k2"]))["api_key"] == "k2"
    cfg = dict(
        SEED_CONFIG,
        serving=dict(SEED_CONFIG["serving"], port=3111, model_name="seed-model", host="127.0.0.2"),
    )
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    a = build_parser().parse_args(hpi_argv(["--serve", "--config", str(tmp_path / "config.json")]))
    o, c = serve_options(a), engine_config(a)
    assert (o["host"], o["port"], o["served_model_name"]) == ("127.0.0.2", 3111, "seed-model")
    assert (c.num_blocks, c.max_num_seqs, c.max_num_batched_tokens, c.memory_threshold) == (
        1024,
        32,
        4096,
        0.9,
    )
    a = build_parser().parse_args(
        [
            "serve",
            "--config",
            str(tmp_path / "config.json"),
            "--port",
            "4000",
            "--max-batch-size",
            "8",
        ]
    )
    assert (serve_options(a)["port"], engine_config(a).max_num_seqs) == (4000, 8)


def test_generate_on_the_demo_model_through_the_console_script():
    "The real command in a subprocess: the seed's `--input` form, with the chat template."
    exe = os.path.join(os.path.dirname(sys.executable), "hetero-infer")
    cmd = (
        [exe]
        if os.path.exists(exe)
        else [
            sys.executable,
            "-c",
            "import sys; from hetero_infer.cli.main import main; sys.exit(main())",
        ]
    )
    r = subprocess.run(
        cmd + ["--input", "reverse: a b c", "--chat", "--max-tokens", "8", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[-1])["completions"] == ["c b a"]


def test_a_missing_model_dir_is_one_line(capsys):
    code, err = run_main(capsys, "generate", "x", "--model", "/no/such/dir")
    assert code == 2 and err.strip().splitlines()[-1] == (
        "hetero-infer: error: --model: no such directory: /no/such/dir"
    )


# Through the installed command, in a fresh process, as a user meets it.
HETERO_INFER = os.path.join(os.path.dirname(sys.executable), "hetero-infer")


def run_installed(argv, stdin=b"", env=None, timeout=300, cmd=None):
    "Exit status, stdout and stderr (text) of the installed `hetero-infer` (argv may hold bytes)."
    r = subprocess.run(
        (cmd or [HETERO_INFER]) + list(argv),
        input=stdin,
        capture_output=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )
    out, err = r.stdout.decode(errors="replace"), r.stderr.decode(errors="replace")
    assert "Traceback" not in err, err
    return r.returncode, out, err


def stdin_bytes(monkeypatch, data: bytes) -> None:
    "Make stdin hold `data`, as a pipe into the command would."
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))


def test_prompts_lose_their_line_endings(capsys, monkeypatch):
    "`\\r\\n` (and a lone `\\r`) on stdin or in --input is not part of the prompt."
    stdin_bytes(monkeypatch, b"reverse: a b c\r\n\r\nreverse: d e f\r")
    assert main(["generate", "--chat", "--max-tokens", "8", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["prompt"], r["completions"]) for r in rows] == [
        ("reverse: a b c", ["c b a"]),
        ("reverse: d e f", ["f e d"]),
    ]
    argv = ["--input", "reverse: a b c\r\n", "--chat", "--max-tokens", "8", "--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["prompt"] == "reverse: a b c"


def test_prompt_bytes_that_are_not_utf8_exit_2(capsys, monkeypatch):
    """Non-UTF-8 bytes in an argument or on stdin: exit 2 naming where they were (Python keeps an
    argument's bad bytes as lone surrogates: `b"caf\\xe9"` arrives as "caf\\udce9")."""
    argv = [b.decode("utf-8", "surrogateescape") for b in (b"generate", b"caf\xe9")]
    code, err = run_main(capsys, *argv, "--max-tokens", "2")
    assert code == 2 and error_line(err).startswith("hetero-infer: error: prompts: not UTF-8")
    code, err = run_main(
        capsys, "generate", "--input", b"\xff\xfe".decode("utf-8", "surrogateescape")
    )
    assert code == 2 and error_line(err).startswith("hetero-infer: error: --input: not UTF-8")
    stdin_bytes(monkeypatch, b"ok\ncaf\xe9\n")
    code, err = run_main(capsys, "generate", "--max-tokens", "2")
    assert code == 2 and error_line(err).startswith("hetero-infer: error: stdin: not UTF-8")


def test_home_relative_paths(tmp_path, capsys, monkeypatch):
    '`--model=~/m`, `--tokenizer=\'~/m\'` and a config\'s `"model": "~/m"` all load.'
    os.symlink(DEMO_MODEL_DIR, tmp_path / "m")
    monkeypatch.setenv("HOME", str(tmp_path))
    argv = ["generate", "--chat", "reverse: a b c", "--max-tokens", "8", "--json"]
    completions = lambda: json.loads(capsys.readouterr().out.splitlines()[-1])["completions"]
    assert main(argv + ["--model=~/m", "--tokenizer=~/m"]) == 0 and completions() == ["c b a"]
    (tmp_path / "c.json").write_text(json.dumps({"model": "~/m", "tokenizer": "~/m"}))
    assert main(argv + ["--config", str(tmp_path / "c.json")]) == 0
    assert completions() == ["c b a"]
    code, err = run_main(capsys, *argv, "--tokenizer", "~/nothing")
    assert code == 2 and error_line(err).startswith("hetero-infer: error: --tokenizer: no such")


@pytest.mark.parametrize("n", ["0", "-1"])
def test_demo_refuses_no_prompts(capsys, n):
    "`demo --num-prompts 0` and -1 name the flag."
    code, err = run_main(capsys, "demo", "--num-prompts", n)
    assert code == 2 and error_line(err) == (
        f"hetero-infer: error: --num-prompts: must be >= 1, got {n}"
    )


def test_config_that_is_not_a_json_object_or_not_utf8(capsys, tmp_path):
    "A JSON string is not a path to follow; bad bytes name --config and the file."
    (tmp_path / "other.json").write_text(json.dumps({"block_size": 8}))
    cfg = tmp_path / "string.json"
    cfg.write_text(json.dumps(str(tmp_path / "other.json")))
    code, err = run_main(capsys, "generate", "x", "--config", str(cfg))
    assert code == 2 and error_line(err).startswith(
        f"hetero-infer: error: --config: {cfg} holds a JSON str, not an object"
    )
    cfg = tmp_path / "latin1.json"
    cfg.write_bytes('{"model": "mod\u00e8le"}'.encode("latin-1"))
    code, err = run_main(capsys, "serve", "--config", str(cfg))
    assert code == 2 and error_line(err).startswith(
        f"hetero-infer: error: --config: {cfg} is not UTF-8 text"
    )


def test_host_that_does_not_resolve_names_host(capsys):
    "`serve --host 999.1.1.1` blames --host, not --port."
    code, err = run_main(capsys, "serve", "--host", "999.1.1.1")
    assert code == 2 and error_line(err).startswith(
        "hetero-infer: error: --host: '999.1.1.1' does not resolve"
    )


@pytest.mark.parametrize("module", ["hetero_infer", "hetero_infer.cli.main"])
def test_python_dash_m_runs_the_command(module):
    "`python -m hetero_infer[.cli.main] ...` is the command, bad input and all."
    code, _, err = run_installed(["demo", "--num-prompts", "0"], cmd=[sys.executable, "-m", module])
    assert code == 2 and error_line(err).startswith("hetero-infer: error: --num-prompts")


def test_help_names_the_command(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("usage: hetero-infer")


def test_cors_flags(capsys):
    "vLLM's --allowed-origins/methods/headers, JSON lists, reach serve."
    a = build_parser().parse_args(
        ["serve", "--allowed-origins", '["https://a.example"]', "--allowed-headers", "[]"]
    )
    o = serve_options(a)
    assert (o["allowed_origins"], o["allowed_headers"]) == (["https://a.example"], [])
    assert "allowed_methods" not in o  # not given: the server's default (all, as vLLM)
    code, err = run_main(capsys, "serve", "--allowed-methods", "POST")
    assert code == 2 and error_line(err).startswith(
        "hetero-infer: error: argument --allowed-methods: expected a JSON list"
    )


def test_cors_preflight_through_the_command():
    "End to end: a browser's preflight to a `serve --allowed-origins ...` is allowed."
    import httpx
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = ["serve", "--port", str(port), "--allowed-origins", '["https://a.example"]']
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([HETERO_INFER] + argv, env=env, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(480):
            assert proc.poll() is None, proc.stderr.read().decode()
            try:
                if httpx.get(base + "/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        headers = {
            "Origin": "https://a.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type",
        }
        r = httpx.options(base + "/v1/chat/completions", headers=headers, timeout=10)
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "https://a.example"
        r = httpx.options(
            base + "/v1/chat/completions",
            headers={**headers, "Origin": "https://b.example"},
            timeout=10,
        )
        assert r.headers.get("access-control-allow-origin") != "https://b.example"
    finally:
        proc.terminate()
        proc.wait(timeout=60)


# ------------------------------------------- how later chapters plug into the command line


def test_bench_is_a_registered_command():
    assert COMMANDS["bench"][1] is bench_command
    assert "bench" in build_parser().format_help()
    assert hpi_argv(["bench", "offline"]) == ["bench", "offline"]


def test_core_engine_flags_only():
    "The table holds the core chapters' fields; a later chapter's field has a flag once registered."
    core = {"model", "tokenizer", "dtype", "device", "attention_backend", "block_size"}
    core |= {"num_blocks", "gpu_memory_utilization", "memory_threshold", "max_num_seqs"}
    core |= {"max_admitted_seqs", "max_num_batched_tokens", "max_model_len", "seed"}
    core |= {"enable_prefix_caching", "enable_chunked_prefill", "max_retry_attempts"}
    assert core <= set(ENGINE_FLAGS)
    with pytest.raises(ValueError, match="not EngineConfig fields"):
        register_engine_flags({"no_such_field": (["--x"], int, None, "x")})


def test_register_cli_args_reaches_generate_and_serve(capsys, monkeypatch):
    """A later chapter's own flag of `generate` becomes a SamplingParams keyword, one of `serve` a
    server keyword; a bad value raised by `apply` as a UsageError exits 2 naming the flag."""
    from hetero_infer.cli.flags import UsageError

    def add_generate(p):
        p.add_argument("--stop-at", default=None, help="a stop string (default: none)")

    def apply_generate(args, kw):
        if args.stop_at == "":
            raise UsageError("--stop-at", "must not be empty")
        if args.stop_at is not None:
            kw["stop"] = [args.stop_at]

    def add_serve(p):
        p.add_argument("--banner", default=None, help="a banner (default: none)")

    monkeypatch.setitem(CLI_ARGS, "generate", [])
    monkeypatch.setitem(CLI_ARGS, "serve", [])
    register_cli_args("generate", add_generate, apply_generate)
    register_cli_args("serve", add_serve, lambda args, kw: kw.update(banner=args.banner))
    argv = ["generate", "--chat", "--max-tokens", "8", "--json", "reverse: a b c", "--stop-at", "b"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["completions"] == ["c "]
    code, err = run_main(capsys, "generate", "x", "--stop-at", "")
    assert code == 2 and error_line(err) == "hetero-infer: error: --stop-at: must not be empty"
    assert serve_options(build_parser().parse_args(["serve", "--banner", "hi"]))["banner"] == "hi"
    with pytest.raises(ValueError, match="command must be one of"):
        register_cli_args("bench", add_serve, apply_generate)


def test_register_command_runs_through_main(capsys, monkeypatch):
    def add_parser(sub):
        sub.add_parser("hello", help="say hello (default: -)").add_argument("--fail", type=int)

    def run(args):
        if args.fail:
            raise ValueError("--fail: asked to")
        print("hello")
        return 0

    monkeypatch.setitem(COMMANDS, "hello", (add_parser, run))
    assert main(["hello"]) == 0 and capsys.readouterr().out == "hello\n"
    code, err = run_main(capsys, "hello", "--fail", "1")
    assert code == 2 and error_line(err) == "hetero-infer: error: --fail: asked to"
    with pytest.raises(ValueError, match="own commands"):
        register_command("generate", add_parser, run)


def test_a_serve_flag_may_serve_its_own_way(capsys, monkeypatch):
    """An `apply` of `serve` that sets `serve_with`: `serve` calls it with the engine config and
    the server's keywords instead of the plain server; a UsageError it raises names its flag."""
    from hetero_infer.cli.flags import UsageError

    calls = []

    def own(config, **opts):
        if opts["served_model_name"] == "bad":
            raise UsageError("--twice", "not for bad")
        calls.append((config.block_size, opts["served_model_name"], "serve_with" in opts))
        return 0

    def add(p):
        p.add_argument("--twice", action="store_true", help="serve twice (default: off)")

    monkeypatch.setitem(CLI_ARGS, "serve", [])
    register_cli_args("serve", add, lambda args, kw: args.twice and kw.update(serve_with=own))
    argv = ["serve", "--port", "0", "--block-size", "8", "--model-name", "m", "--twice"]
    assert main(argv) == 0 and calls == [(8, "m", False)]
    code, err = run_main(capsys, "serve", "--port", "0", "--model-name", "bad", "--twice")
    assert code == 2 and error_line(err) == "hetero-infer: error: --twice: not for bad"


def test_disaggregation_plugs_in_by_registration():
    "19's flags and command come from its registrations: engine flags, a serve flag, `proxy`."
    from hetero_infer.cli.flags import BENCH_FLAGS

    assert {"kv_role", "kv_address", "kv_transfer_timeout"} <= set(ENGINE_FLAGS)
    assert "kv_role" not in BENCH_FLAGS
    assert "proxy" in COMMANDS and hpi_argv(["proxy", "--port", "1"]) == ["proxy", "--port", "1"]
    a = build_parser().parse_args(
        ["serve", "--kv-role", "kv_consumer", "--data-parallel-size", "3"]
    )
    assert (a.kv_role, a.data_parallel_size) == ("kv_consumer", 3)
    assert engine_config(a).kv_role == "decode"
