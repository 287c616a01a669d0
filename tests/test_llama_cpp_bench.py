"""metasd.bench.llama_cpp without llama.cpp: its readers on output recorded from the real tools (llama.cpp built from
llama-cpp-python 0.3.36's sdist), its commands, and a run through stand-in tools that print such output; the paired
geometric mean and the llama.cpp table of benchmarks/speed.py on fake rows."""
import argparse
import stat
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from metasd.bench.llama_cpp import LlamaCpp, LlamaCppError, parse_completion, parse_speculative
from metasd.bench.stats import prompt_geomean

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import speed  # noqa: E402

# stderr tails as llama-completion / llama-speculative printed them (timestamps and all)
COMPLETION_ERR = """0.16.572.518 I common_perf_print:    sampling time =      43.61 ms
0.16.572.554 I common_perf_print:    samplers time =      14.06 ms /   102 tokens
0.16.572.586 I common_perf_print:        load time =    1766.82 ms
0.16.572.615 I common_perf_print: prompt eval time =     958.59 ms /    39 tokens (   25.23 ms per token,    39.64 tokens per second)
0.16.572.644 I common_perf_print:        eval time =   12464.52 ms /    63 runs   (  197.85 ms per token,     5.05 tokens per second)
0.16.572.671 I common_perf_print:       total time =   13474.22 ms /   101 tokens
"""
SPECULATIVE_ERR = """0.17.155.164 I encoded   39 tokens in    1.379 seconds, speed:   27.557 t/s
0.17.155.165 I decoded   71 tokens in    9.438 seconds, speed:    7.523 t/s
0.17.155.166 I 
0.17.155.168 I n_draft   = 8
0.17.155.169 I n_predict = 71
0.17.155.172 I n_drafted = 80
0.17.155.174 I n_accept  = 60
0.17.155.175 I accept    = 75.000%
0.17.155.206 I common_perf_print:    sampling time =      32.87 ms
0.17.155.213 I common_perf_print: prompt eval time =    4495.65 ms /   128 tokens (   35.12 ms per token,    28.47 tokens per second)
0.17.155.216 I common_perf_print:        eval time =       0.00 ms /     1 runs   (    0.00 ms per token,      inf tokens per second)
"""
PROMPT = "<|im_start|>user\nWrite a Python function that reverses a string.<|im_end|>\n<|im_start|>assistant\n"


def test_completion_counts_runs_plus_one_and_times_prefill_decode_and_sampling():
    r = parse_completion("```python\ndef f(s):\n    return s[::-1]\n```\n\n", COMPLETION_ERR)
    assert r.text == "```python\ndef f(s):\n    return s[::-1]\n```"
    assert (r.prompt_tokens, r.new_tokens, r.stopped_at_eos) == (39, 64, False)
    assert r.seconds == pytest.approx((958.59 + 12464.52 + 43.61) / 1000)  # load time excluded
    r = parse_completion("done. [end of text]\n\n\n", COMPLETION_ERR)
    assert (r.text, r.stopped_at_eos) == ("done.", True)


def test_speculative_output_loses_the_echoed_prompt_and_the_end_of_text_token():
    # the verify step that accepted the end token printed the drafted tokens after it too
    out = "\n\n" + PROMPT + "```python\nx = 1\n```<|im_end|>\n\nMore" + "\n\n\n\n"
    r = parse_speculative(out, SPECULATIVE_ERR, PROMPT, "<|im_end|>")
    assert (r.text, r.stopped_at_eos) == ("```python\nx = 1\n```", True)
    assert (r.prompt_tokens, r.new_tokens, r.drafted, r.accepted) == (39, 71, 80, 60)
    assert r.seconds == pytest.approx(1.379 + 9.438)
    r = parse_speculative("\n\n" + PROMPT + "x\n\n\n\n\n\n", SPECULATIVE_ERR, PROMPT, "<|im_end|>")
    assert (r.text, r.stopped_at_eos) == ("x\n\n", False)  # the text's own newlines stay


@pytest.mark.parametrize("stdout, stderr, match", [
    ("\n\nanother prompt x\n\n\n\n", SPECULATIVE_ERR, "another prompt"),
    ("\n\n" + PROMPT + "x", SPECULATIVE_ERR, "did not end"),
    ("\n\n" + PROMPT + "x\n\n\n\n", SPECULATIVE_ERR.replace("n_accept", "n_acc"), "n_accept"),
], ids=["another prompt echoed", "cut short", "no n_accept"])
def test_speculative_output_that_cannot_be_read_is_an_error(stdout, stderr, match):
    with pytest.raises(LlamaCppError, match=match):
        parse_speculative(stdout, stderr, PROMPT, "<|im_end|>")


def test_completion_without_timings_is_an_error():
    with pytest.raises(LlamaCppError, match="eval run count|eval time"):
        parse_completion("x\n\n", COMPLETION_ERR.replace("runs", "batches"))


class CharTokenizer:
    """One id per character; id 0 is the end-of-sequence token."""
    eos_token_id = 0

    def convert_ids_to_tokens(self, i):
        return "<|im_end|>" if i == 0 else chr(i)

    def decode(self, ids, **_):
        return "".join(self.convert_ids_to_tokens(i) for i in ids)

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def _tool(bin_dir: Path, name: str, stdout: str, stderr: str, rc: int = 0) -> None:
    """A stand-in for a llama.cpp tool: records its argv, prints the given output."""
    path = bin_dir / name
    path.write_text(f"#!{sys.executable}\nimport sys\nopen({str(bin_dir / 'argv')!r}, 'w').write(repr(sys.argv))\n"
                    f"sys.stdout.write({stdout!r}); sys.stderr.write({stderr!r}); sys.exit({rc})\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_a_run_checks_the_prompt_tokenization_and_returns_reference_comparable_ids(tmp_path):
    lc = LlamaCpp(tmp_path, CharTokenizer(), threads=3)
    ids = [ord(c) for c in "p" * 39]
    _tool(tmp_path, "llama-speculative", "\n\n" + "p" * 39 + "abc<|im_end|>\n\n\n\n", SPECULATIVE_ERR)
    cmd = lc.speculative_command(Path("t.gguf"), Path("d.gguf"), lc.prompt_text(ids), 64, 8)
    r = lc.run(cmd, ids)
    argv = eval((tmp_path / "argv").read_text())
    for flag, value in [("-m", "t.gguf"), ("-md", "d.gguf"), ("--spec-draft-n-max", "8"), ("-n", "64"),
                        ("--temp", "0"), ("-t", "3"), ("-td", "3"), ("-p", "p" * 39)]:
        assert argv[argv.index(flag) + 1] == value, flag
    assert "--no-escape" in argv  # prompts with backslashes reach the tool as they are
    assert lc.token_ids(r, 64) == [ord("a"), ord("b"), ord("c"), 0]  # the end-of-sequence id where it stopped
    assert lc.token_ids(r, 2) == [ord("a"), ord("b")]
    _tool(tmp_path, "llama-speculative", "\n\n" + "p" * 39 + "ab<|im_end|>cd\n\n\n\n", SPECULATIVE_ERR)
    assert lc.token_ids(lc.run(cmd, ids), 64) == [ord("a"), ord("b"), 0]  # nothing past the end token
    with pytest.raises(LlamaCppError, match="into 39 tokens, the verifier's tokenizer into 38"):
        lc.run(lc.speculative_command(Path("t"), Path("d"), "p" * 39, 64, 8), ids[:38])
    _tool(tmp_path, "llama-completion", "", "error: unknown argument\n", rc=1)
    with pytest.raises(LlamaCppError, match="llama-completion exited with 1: error: unknown argument"):
        lc.run(lc.completion_command(Path("t"), "p", 64), ids)


def test_prompt_geomean_pairs_repeats_takes_median_per_prompt_then_geometric_mean():
    def row(q, rep, a_s, b_s):
        return {"question_id": q, "repeat": rep,
                "methods": {"a": {"tokens": 10, "seconds": a_s}, "b": {"tokens": 10, "seconds": b_s}}}
    # prompt q1: ratios 2, 4, 8 (median 4); prompt q2: ratios 1, 1, 0.25 (median 1)
    rows = [row("q1", 0, 1, 2), row("q1", 1, 1, 4), row("q1", 2, 1, 8),
            row("q2", 0, 1, 1), row("q2", 1, 1, 1), row("q2", 2, 4, 1)]
    overall, per_repeat = prompt_geomean(rows, "a", "b")
    assert overall == pytest.approx(2.0)  # sqrt(4 * 1), not the mean of the ratios
    assert per_repeat == pytest.approx([2 ** 0.5, 2.0, 2 ** 0.5])  # sqrt(2*1), sqrt(4*1), sqrt(8*0.25)
    assert prompt_geomean(rows, "a", "missing") is None


def test_speed_compares_llama_cpp_outputs_with_their_own_plain_and_picks_the_best_single_method(tmp_path):
    calls = []

    def fake(name, seconds, ids_out):
        def run(ids):
            calls.append(name)
            return list(ids_out), seconds, None, {"tokens": 3}
        return run

    methods = {speed.PLAIN: fake(speed.PLAIN, 3.0, [1, 2, 3]), speed.LLAMA_PLAIN: fake(speed.LLAMA_PLAIN, 1.0, [1, 2, 4]),
               "llama.cpp speculative n-max 4": fake("s", 0.5, [1, 2, 4]),
               "llama.cpp plain Q4_K_M (other weights)": fake("q", 0.25, [7, 7, 7]), "pool d": fake("d", 0.4, [1, 2, 3])}
    reference_of = {"llama.cpp speculative n-max 4": speed.LLAMA_PLAIN, "llama.cpp plain Q4_K_M (other weights)": None}
    questions = [SimpleNamespace(question_id=f"q{i}", category="c", group="MT", turns=[f"p{i}"]) for i in range(2)]
    args = argparse.Namespace(repeats=2, resume=False, out=str(tmp_path / "s.json"), temperature=0.0, oracle=None)
    probe = SimpleNamespace(encode=lambda messages: [len(m["content"]) for m in messages])
    rows = speed.run_repeats(args, [], questions, methods, probe, lambda ids: ([1, 2, 3], [1.0] * 3), reference_of)
    e = rows[0]["methods"]
    assert e[speed.LLAMA_PLAIN]["identical"] is False  # against transformers' plain: diverged
    assert e["llama.cpp speculative n-max 4"]["identical"] is True  # against llama.cpp's own plain
    assert e["llama.cpp plain Q4_K_M (other weights)"]["identical"] is None  # nothing to compare with
    table = speed.llama_table(rows)
    assert "best single method (llama.cpp speculative n-max 4)" in table  # Q4_K_M is faster but other weights
    line = next(l for l in table.splitlines() if l.startswith("| pool d |"))
    assert line == "| pool d | 7.50 | 2.50x [2.50, 2.50] | 1.25x [1.25, 1.25] |"


def test_the_tools_are_built_for_the_cpu_and_without_amx_kernels_where_the_cpu_has_amx():
    from metasd.bench.llama_cpp import cpu_build_flags

    assert cpu_build_flags({"avx2", "avx512f"}) == ("build", ["-DGGML_NATIVE=ON"])  # no AMX: ggml's own choice
    amx = {"avx", "avx2", "fma", "f16c", "avx512f", "avx512vbmi", "avx512_bf16", "amx_int8", "amx_tile"}
    build, options = cpu_build_flags(amx)
    assert build == "build-noamx" and "-DGGML_NATIVE=OFF" in options  # a native build compiles the AMX kernels
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(options)
    assert {"-DGGML_AVX512=ON", "-DGGML_AVX512_VBMI=ON", "-DGGML_AVX512_BF16=ON", "-DGGML_AVX2=ON"} <= set(options)
    assert {"-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX_VNNI=OFF", "-DGGML_BMI2=OFF"} <= set(options)  # what it lacks: off
