"""benchmarks/serve_load.py without servers: its statistics, the per-level summary, argument parsing, server
commands and the tables on synthetic rows."""
from __future__ import annotations

from pathlib import Path

import pytest

from benchmark_scripts import load_script


@pytest.fixture(scope="module")
def sl():
    return load_script("serve_load")


def test_percentile_interpolates_like_numpy(sl):
    xs = [4, 1, 3, 2]
    assert sl.percentile(xs, 50) == 2.5
    assert sl.percentile(xs, 0) == 1 and sl.percentile(xs, 100) == 4
    assert sl.percentile(xs, 99) == pytest.approx(3.97)
    assert sl.percentile([7.0], 99) == 7.0
    assert sl.percentile([], 50) is None


def test_median_range_skips_missing(sl):
    assert sl.median_range([3, None, 1, 2]) == (2, 1, 3)
    assert sl.median_range([None]) is None


def test_verdict_by_range_overlap(sl):
    assert sl.verdict([10, 11, 12], [7, 8, 9]) == "faster"
    assert sl.verdict([7, 8, 9], [10, 11, 12]) == "slower"
    assert sl.verdict([8, 10, 12], [7, 9, 11]) == "within noise"
    assert sl.verdict([10, 9], [9, 8]) == "within noise"  # touching ranges overlap
    assert sl.verdict([10], [5]) == "one repeat"


def test_fmt_mr(sl):
    assert sl.fmt_mr((2.0, 1.0, 3.0)) == "2.00 [1.00-3.00]"
    assert sl.fmt_mr((2.0, 2.0, 2.0)) == "2.00"
    assert sl.fmt_mr((0.05, 0.04, 0.06), 0, 1000, False) == "50"
    assert sl.fmt_mr(None) == "-"


def test_deliveries_merge_chunks_of_one_read(sl):
    chunks = [(1.0, "a"), (1.0005, "b"), (1.5, "c"), (1.5015, ""), (1.503, "d"), (2.0, "e")]
    # "d" is 3 ms after "c" but 1.5 ms after the empty chunk: gaps are measured from the previous text chunk
    assert sl.deliveries(chunks, 0.002) == [(1.0, "ab"), (1.5, "c"), (1.503, "d"), (2.0, "e")]
    assert sl.deliveries([], 0.002) == []


def test_itl_samples_per_token(sl):
    # first delivery at 1 s (TTFT), then 3 tokens after 0.3 s, then 1 token after 0.1 s
    assert sl.itl_samples([1.0, 1.3, 1.4], [2, 3, 1]) == pytest.approx([0.1, 0.1, 0.1, 0.1])
    assert sl.itl_samples([1.0, 2.0], [1, 0]) == [1.0]  # a delivery is at least one token
    assert sl.itl_samples([1.0], [5]) == []


def test_tokens_per_step(sl):
    assert sl.tokens_per_step([{"new_tokens": 6, "steps": 2}, {"new_tokens": 4, "steps": 3}]) == 2.0
    assert sl.tokens_per_step([{"mean_tokens_per_step": 2.0}, {"mean_tokens_per_step": 3.0}, None]) == 2.5
    assert sl.tokens_per_step([None, {}]) is None


def test_summarise_level(sl):
    words = lambda text: len(text.split())  # noqa: E731 - a tokenizer of words
    reqs = [
        {"ok": True, "chunks": [(0.5, " a"), (0.6, " b c"), (0.7, " d")], "e2e": 0.8, "completion_tokens": 4,
         "metasd": {"new_tokens": 4, "steps": 2}},
        {"ok": True, "chunks": [(1.0, " a"), (1.0001, " b"), (1.2, " c")], "e2e": 1.3, "completion_tokens": 3,
         "metasd": {"new_tokens": 3, "steps": 1}},
        {"ok": False, "chunks": [], "error": "boom"},
    ]
    s = sl.summarise_level(reqs, 2.0, words)
    assert s["requests_done"] == 2 and s["errors"] == 1
    assert s["completion_tokens"] == 7 and s["output_tok_s"] == 3.5 and s["requests_s"] == 1.0
    assert s["ttft_p50"] == pytest.approx(0.75)
    # ITL samples: 0.05, 0.05 (two tokens after 0.1 s), 0.1; 0.2 (the second stream's merged first delivery)
    assert s["itl_p50"] == pytest.approx(0.075)
    assert s["tpot_p50"] == pytest.approx((0.2 / 3 + 0.2 / 2) / 2)
    assert s["e2e_p50"] == pytest.approx(1.05)
    assert s["mean_tokens_per_step"] == pytest.approx(7 / 3)
    assert reqs[1]["deliveries"] == [[1.0, 2], [1.2, 1]]


def test_requests_per_level(sl):
    assert [sl.requests_for(c, 20, None) for c in (1, 2, 4, 8, 16)] == [20, 20, 20, 20, 40]
    assert sl.requests_for(16, 6, None) == 36
    assert sl.requests_for(16, 20, 3) == 3
    assert [sl.requests_for(c, 6, None, per_c=1) for c in (1, 2, 4, 8, 16)] == [6, 6, 6, 12, 18]


def test_cb_num_blocks_cover_the_load(sl):
    n = sl.cb_num_blocks(16, 712, 64)
    assert n * 256 >= 2 * 16 * (712 + 64)


def test_a_server_runs_another_build_first_on_its_path(sl, tmp_path):
    build = tmp_path / "build"
    (build / "metasd").mkdir(parents=True)
    args = sl.build_parser().parse_args(["--servers", "metasd-off", "old", "--extra-pool", "old=configs/x.yaml",
                                         "--server-path", f"old={build}"])
    specs = {s.name: s for s in sl.server_specs(args)}
    assert specs["old"].pythonpath == str(build) and specs["metasd-off"].pythonpath is None
    env = {"PYTHONPATH": "/frozen", "OMP_NUM_THREADS": "1"}
    assert sl.server_env(specs["old"], env) == {"PYTHONPATH": f"{build}:/frozen", "OMP_NUM_THREADS": "1"}
    assert sl.server_env(specs["metasd-off"], env) is env
    assert sl.server_env(specs["old"], {})["PYTHONPATH"] == str(build)
    for bad in (f"nobody={build}", f"old={tmp_path}", "old="):  # not a server of the run; no metasd there; no DIR
        with pytest.raises(SystemExit, match="--server-path"):
            sl.server_specs(sl.build_parser().parse_args(["--servers", "old", "--extra-pool", "old=x.yaml",
                                                          "--server-path", bad]))


def test_arguments_commands_and_tables(sl, capsys):
    args = sl.build_parser().parse_args(
        ["--servers", "transformers", "metasd-off", "metasd", "--concurrency", "1", "8", "--repeats", "2",
         "--extra-pool", "ngram=configs/x.yaml", "--out", "/tmp/x.json"])
    assert args.max_tokens == 64 and args.threads == 2 and args.temperature == 0 and args.per_group == 2
    specs = {s.name: s for s in sl.server_specs(args)}
    assert list(specs) == ["transformers", "metasd-off", "metasd"]  # --servers chooses; ngram not listed
    assert specs["metasd-off"].extra_body == {"metasd": {"speculate": False}} and specs["metasd"].extra_body is None
    cmd = sl.server_command(specs["transformers"], args, 1234, Path("/m"), 100)
    assert cmd[cmd.index("serve"):][:2] == ["serve", "--continuous-batching"] and cmd[-1] == "/m"
    assert "allow_block_sharing" in " ".join(cmd)  # prefix cache off by default
    for flag, value in (("--device", "cpu"), ("--dtype", "bfloat16"), ("--host", "127.0.0.1"), ("--port", "1234"),
                        ("--cb-num-blocks", "100")):
        assert cmd[cmd.index(flag) + 1] == value
    m = sl.server_command(specs["metasd"], args, 99, Path("/m"), 100)
    assert m[m.index("serve"):] == ["serve", "--host", "127.0.0.1", "--port", "99", "--max-batch", "8",
                                    "--threads", "2"]
    every = sl.build_parser().parse_args(["--extra-pool", "ngram=configs/x.yaml", "--transformers-prefix-cache"])
    specs = sl.server_specs(every)
    assert [s.name for s in specs][-1] == "ngram" and specs[-1].pool.endswith("configs/x.yaml")
    assert sl.server_command(specs[-1], every, 1, Path("/m"), 1)[-2] == "--pool"
    assert sl.server_command(specs[0], every, 1, Path("/m"), 1)[:2] == ["transformers", "serve"]
    gpu = sl.build_parser().parse_args(["--device", "cuda"])
    cmd = sl.server_command(sl.server_specs(gpu)[0], gpu, 1, Path("/m"), 1)
    assert cmd[cmd.index("--device") + 1] == "cuda"  # a GPU run's transformers serve (benchmarks/gpu_serve.py)
    with pytest.raises(SystemExit):
        sl.server_specs(sl.build_parser().parse_args(["--servers", "vllm"]))

    def row(server, c, rep, tok_s, text="x"):
        return {"server": server, "concurrency": c, "repeat": rep, "requests_sent": 4, "requests_done": 4,
                "timed_out": False, "output_tok_s": tok_s, "requests_s": tok_s / 64, "ttft_p50": 1.0, "ttft_p99": 2.0,
                "itl_p50": 0.2, "itl_p99": 0.4, "tpot_p50": 0.2, "e2e_p50": 9.0, "tokens_per_delivery": 1.0,
                "mean_tokens_per_step": None if server != "metasd" else 2.5,
                "requests": [{"ok": True, "question_id": "q1", "text": text}]}
    rows = []
    for rep in (0, 1):
        rows += [row("transformers", 1, rep, 4.0 + rep), row("transformers", 8, rep, 12.0 + rep),
                 row("metasd-off", 1, rep, 3.0 + rep, "y"), row("metasd-off", 8, rep, 11.0 + rep),
                 row("metasd", 1, rep, 8.0 + rep), row("metasd", 8, rep, 16.0 + rep)]
    table = sl.summary_table(rows)
    assert "| metasd | 1 | 8/8 | 8.50 [8.00-9.00] |" in table and "| 200 / 400 |" in table and "2.50" in table
    ratios = sl.ratio_table(rows)
    assert "| c | metasd-off vs transformers | metasd vs transformers | metasd vs metasd-off |" in ratios
    assert "| 1 | 0.78 [0.75-0.80]x within noise | 1.90 [1.80-2.00]x faster |" in ratios
    assert "| metasd | c=8 vs c=1 | 1.94 [1.89-2.00]x | faster |" in ratios
    assert "| transformers | c=8 vs c=1 |" in ratios
    assert sl.identity_line(rows).endswith("metasd-off 2/4, metasd 4/4")
    sl.print_tables(rows)
    assert "metasd vs transformers" in capsys.readouterr().out


def test_resume_needs_the_same_arguments(sl, tmp_path):
    out = tmp_path / "r.json"
    args = sl.build_parser().parse_args(["--out", str(out), "--resume", "--concurrency", "1", "2"])
    assert sl.resumed_rows(args) == []
    whole = [{"server": "metasd", "concurrency": c, "repeat": 0} for c in (1, 2)]
    part = [{"server": "metasd", "concurrency": 1, "repeat": 1}, {"server": "tree8", "concurrency": 1, "repeat": 0}]
    sl.write_result(args, [], whole + part, 0.0)
    # a server stopped before its last level runs again from its first: what an adaptive pool learnt is gone
    assert sl.resumed_rows(args) == whole
    more = sl.build_parser().parse_args(["--out", str(out), "--resume", "--concurrency", "1", "2", "--repeats", "5"])
    assert sl.resumed_rows(more) == whole  # more repeats of the same run
    other = sl.build_parser().parse_args(["--out", str(out), "--resume", "--max-tokens", "8"])
    with pytest.raises(SystemExit, match="concurrency, max_tokens"):
        sl.resumed_rows(other)


def test_llama_cpp_servers_commands_ratios_and_identity(sl, monkeypatch):
    """llama-server (plain and with its draft model) and metasd serve on the llama.cpp backend: their commands, the
    ratios of metasd on llama.cpp against llama.cpp's own server, and identity against llama-server's text."""
    import metasd.bench.llama_cpp as bench_llama_cpp
    import metasd.models.llama_cpp_source as source

    monkeypatch.setattr(bench_llama_cpp, "build_tools", lambda: Path("/bin"))
    monkeypatch.setattr(source, "converted_gguf", lambda ref, outtype="bf16", **_: Path(f"/g/{ref}-{outtype}.gguf"))
    args = sl.build_parser().parse_args(["--servers", "llama-server", "llama-server-draft", "metasd-llama-cpp",
                                         "metasd-llama-cpp-off", "--concurrency", "1", "4", "--threads", "2"])
    specs = {s.name: s for s in sl.server_specs(args)}
    plain = sl.server_command(specs["llama-server"], args, 7, Path("/m"), 1)
    assert plain[0] == "/bin/llama-server" and plain[plain.index("-m") + 1] == f"/g/{sl.VERIFIER}-bf16.gguf"
    for flag, value in (("-np", "4"), ("-c", "8192"), ("-t", "2"), ("--port", "7"), ("--cache-ram", "0")):
        assert plain[plain.index(flag) + 1] == value
    assert "--no-cache-prompt" in plain and "-md" not in plain
    draft = sl.server_command(specs["llama-server-draft"], args, 7, Path("/m"), 1)
    assert draft[draft.index("-md") + 1] == f"/g/{sl.DRAFT}-bf16.gguf" and draft[-2:] == ["--spec-draft-n-max", "8"]
    on = sl.server_command(specs["metasd-llama-cpp"], args, 7, Path("/m"), 1)
    assert on[on.index("serve") + 1: on.index("serve") + 3] == ["--backend", "llama.cpp"]
    assert specs["metasd-llama-cpp-off"].extra_body == {"metasd": {"speculate": False}}

    def row(server, c, rep, tok_s, text="x"):
        return {"server": server, "concurrency": c, "repeat": rep, "output_tok_s": tok_s,
                "requests": [{"ok": True, "question_id": "q1", "text": text}]}
    rows = [row(s, c, rep, base * c + rep, text) for rep in (0, 1) for c in (1, 4)
            for s, base, text in (("llama-server", 10.0, "x"), ("llama-server-draft", 12.0, "x"),
                                  ("metasd-llama-cpp", 20.0, "x"), ("metasd-llama-cpp-off", 10.0, "y"))]
    ratios = sl.ratio_table(rows)
    header = ratios.splitlines()[0]
    for pair in ("metasd-llama-cpp vs llama-server", "metasd-llama-cpp vs llama-server-draft",
                 "metasd-llama-cpp vs metasd-llama-cpp-off", "llama-server-draft vs llama-server"):
        assert pair in header
    assert "| 1 | " in ratios and "transformers" not in ratios
    assert sl.identity_line(rows) == ""  # no transformers serve in this run
    line = sl.identity_line(rows, "llama-server")
    assert line.startswith("completions identical to llama-server's text")
    assert line.endswith("llama-server-draft 4/4, metasd-llama-cpp 4/4, metasd-llama-cpp-off 0/4")


METRICS_PAGE = """# HELP metasd:verify_fixed_shapes (rows, tokens, width) shapes the batched verify forward met.
# TYPE metasd:verify_fixed_shapes gauge
metasd:verify_fixed_shapes{engine="0",model_name="m"} 5.0
metasd:verify_graphs_captured{engine="0",model_name="m"} 7.0
metasd:verify_graph_capture_seconds{engine="0",model_name="m"} 1.5
metasd:draft_fixed_shapes{drafter="a",engine="0",model_name="m"} 3.0
metasd:draft_fixed_shapes{drafter="b",engine="0",model_name="m"} 4.0
metasd:draft_graphs_captured{drafter="a",engine="0",model_name="m"} 2.0
metasd:draft_graphs_captured{drafter="b",engine="0",model_name="m"} 1.0
vllm:num_requests_running{engine="0",model_name="m"} 2.0
"""


def test_graph_counters_sum_the_drafters_and_a_level_reports_what_it_captured(sl):
    before = sl.graph_counters(METRICS_PAGE)
    assert before == {"verify_shapes": 5.0, "verify_captured": 7.0, "verify_capture_s": 1.5, "draft_shapes": 7.0,
                      "draft_captured": 3.0, "draft_capture_s": 0.0}  # absent: 0
    after = dict(before, verify_shapes=6.0, verify_captured=9.0, verify_capture_s=2.0, draft_captured=4.0)
    delta = sl.graph_delta(before, after)
    assert delta == {"verify_shapes": 6.0, "verify_captured": 2.0, "verify_capture_s": 0.5, "draft_shapes": 7.0,
                     "draft_captured": 1.0, "draft_capture_s": 0.0}  # shapes as they stand, captures during it
    assert sl.graph_delta(None, after) is None and sl.graph_delta(before, None) is None
    assert sl.graph_note(delta) == ", 3 CUDA graphs captured in 0.50s"
    assert sl.graph_note(sl.graph_delta(before, before)) == "" and sl.graph_note(None) == ""
    zero = sl.graph_delta(before, before)
    rows = [{"server": "a", "concurrency": 4, "repeat": k, "graphs": g} for k, g in enumerate((delta, zero, delta))]
    rows += [{"server": "b", "concurrency": 1, "repeat": 0, "graphs": zero}, {"server": "t", "concurrency": 1}]
    assert sl.capture_lines(rows) == [
        "CUDA graphs captured inside the measured levels (their seconds count in the levels' wall time):",
        "  a c=4: 3 [0-3] graphs in 0.50 [0.00-0.50] s"]  # b captured none, t is no metasd server
    assert sl.capture_lines(rows[3:]) == []


def test_graph_counters_read_the_names_the_server_exports(sl):
    """serve_load reads the gauges metasd's /metrics exports (a renamed gauge fails here): a scheduler with fixed
    shapes on the CPU, its runners' capture counts set as a GPU's captures would leave them."""
    from metasd.core.batching.scheduler import Scheduler
    from metasd.core.engine import Engine
    from metasd.core.execution.verifier import Verifier
    from metasd.drafters import PretrainedTreeDrafter
    from metasd.serve.metrics import ServeMetrics
    from tiny import tiny_qwen, tiny_tokenizer

    drafter = PretrainedTreeDrafter(tiny_qwen(seed=0, logit_scale=1.5), nodes=8, depth=3, width=2, name="tree",
                                    graphs="fixed")
    engine = Engine(Verifier(tiny_qwen(seed=0, logit_scale=2.0), tiny_tokenizer(), fixed_shapes=True), drafter,
                    check_tokenizers=False)
    metrics = ServeMetrics("m")
    with Scheduler(engine, max_batch=2) as s:
        metrics.attach(s)
        s.submit([0, 7, 12, 9], 8).result(timeout=60)
        verify, draft = s.verifier.runner, drafter.rows.runner
        verify.stats.captured, verify.stats.capture_s = 3, 0.75
        draft.stats.captured, draft.stats.capture_s = 2, 0.25
        got = sl.graph_counters(metrics.render().decode())
        shapes = len(verify.shapes), sum(len(r.shapes) for r in (draft, *drafter.rows.loops.values()))
    assert got == {"verify_shapes": shapes[0], "verify_captured": 3.0, "verify_capture_s": 0.75,
                   "draft_shapes": shapes[1], "draft_captured": 2.0, "draft_capture_s": 0.25}
    assert min(shapes) > 0
