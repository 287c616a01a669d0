"""llama.cpp as a CPU baseline: what a CPU user runs instead of metasd, on the same weights, timed by llama.cpp itself.

A benchmark-time tool, not a runtime dependency of metasd:

- ``build_tools`` downloads the ``llama-cpp-python`` sdist (the package registry is the one source this project may
  reach; the sdist vendors llama.cpp's source) and builds llama.cpp's command-line tools with cmake (Release,
  ``GGML_NATIVE=ON``: the kernels this CPU has) under ``llama_cpp_dir()``; idempotent. On a CPU with AMX it builds
  the instruction sets the CPU has without ggml's AMX kernels instead (``cpu_build_flags``): with them, every
  quantized GGUF crashes this llama.cpp (docs/models.md);
- ``converted_gguf`` (``metasd.models.llama_cpp_source``, shared with the llama.cpp verifier backend) converts a
  bundled model's cached bf16 safetensors with llama.cpp's own ``convert_hf_to_gguf.py --outtype bf16`` - the very
  weights metasd's bf16 runs load;
  ``shipped_gguf`` writes the bundled Q4_K_M GGUF as shipped (other weights: other outputs);
- ``LlamaCpp`` runs ``llama-completion`` (plain), ``llama-speculative`` (a draft model) and ``llama-lookup`` (prompt
  lookup) greedily on one prompt and reads their own timings: the timing boundary is prefill + decode (model load
  excluded), the same as metasd's and transformers' wall time of ``generate``.

Token counting: the tokens delivered. ``llama-completion`` samples one token from the prompt's logits and one after
each decode run, so it produced ``runs + 1`` tokens (the end-of-generation token included where it stopped on one).
The speculative tools stop only once their count exceeds ``-n`` or after the verify step that accepted an
end-of-generation token, and print every token that step accepted - past ``-n`` and past the end-of-generation token
(``n_predict`` counts them all). What a user gets is the text up to the first end-of-generation token, cut at
``max_new_tokens``: ``LlamaCpp.token_ids`` gives it as the verifier's token ids (the text tokenized again, the
end-of-sequence id appended where the tool reached it), and the benchmarks count those, as they count metasd's kept
tokens (the time the tool spent on the surplus stays in its seconds, as metasd's rejected and surplus work stays in
its own).
"""
from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from metasd.core.execution.llama_cpp_verifier import cpu_flags as read_cpu_flags, no_amx_cmake_options
from metasd.models.bundled import BUNDLED_PREFIX, assemble_gguf
from metasd.models.llama_cpp_source import (LLAMA_CPP_PYTHON_VERSION, LlamaCppError, converted_gguf, fetch_source,
                                            llama_cpp_dir, run_logged, source_dir)

__all__ = [
    "LLAMA_CPP_PYTHON_VERSION",
    "LlamaCpp",
    "LlamaCppError",
    "LlamaCppRun",
    "TOOLS",
    "build_tools",
    "cpu_build_flags",
    "converted_gguf",
    "llama_cpp_dir",
    "parse_completion",
    "parse_speculative",
    "shipped_gguf",
]

#: the tools built: plain decoding, draft-model speculation, prompt lookup, the server
TOOLS = ("llama-completion", "llama-speculative", "llama-lookup", "llama-server")
#: what llama-completion prints on stdout when it sampled an end-of-generation token
_END_OF_TEXT = " [end of text]\n"


@dataclass(frozen=True)
class LlamaCppRun:
    """One greedy generation by a llama.cpp tool, as the tool reported it."""

    text: str  # the generated text (the end-of-generation token's text not included)
    prompt_tokens: int  # tokens the tool tokenized the prompt into
    new_tokens: int  # tokens the tool counted (speculative tools: overshoot past -n and past the end token included)
    seconds: float  # prefill + decode, by the tool's own clock (model load excluded)
    stopped_at_eos: bool
    drafted: int | None = None  # speculative tools: tokens drafted / accepted
    accepted: int | None = None


def cpu_build_flags(cpu_flags: set[str]) -> tuple[str, list[str]]:
    """(build directory, cmake options) for llama.cpp on a CPU with ``cpu_flags`` (/proc/cpuinfo's): ``GGML_NATIVE``
    in ``build``, except on a CPU with AMX (``amx_int8``), where llama-cpp-python 0.3.36's AMX kernels crash on every
    quantized GGUF: then the instruction sets the CPU has, the AMX kernels off, in ``build-noamx``."""
    if "amx_int8" not in cpu_flags:
        return "build", ["-DGGML_NATIVE=ON"]
    return "build-noamx", no_amx_cmake_options(cpu_flags)


def build_tools(root: Path | None = None, jobs: int = 2) -> Path:
    """Build llama.cpp's ``TOOLS`` once (minutes: ~11 on 2 cores) and return their directory; returns at once when
    they are built. Needs cmake, ninja and a C++ compiler; the sdist comes from the package index (``pip download``).
    The build options: ``cpu_build_flags`` for this CPU."""
    root = Path(root) if root is not None else llama_cpp_dir()
    build, options = cpu_build_flags(read_cpu_flags())
    bin_dir = source_dir(root) / build / "bin"
    if all((bin_dir / t).is_file() for t in TOOLS):
        return bin_dir
    src = fetch_source(root)
    log = root / "build.log"
    run_logged(["cmake", "-B", build, "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", *options,
                "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF"], log, cwd=src)
    run_logged(["cmake", "--build", build, "-j", str(jobs), "--target", *TOOLS], log, cwd=src)
    return bin_dir


def shipped_gguf(ref: str, root: Path | None = None) -> Path:
    """The bundled model's GGUF as its packages ship it (Q4_K_M): other weights than the bf16 runs, other outputs."""
    root = Path(root) if root is not None else llama_cpp_dir()
    return assemble_gguf(ref, root / "gguf" / f"{ref.removeprefix(BUNDLED_PREFIX)}-q4_k_m.gguf")


def _number(pattern: str, text: str, what: str, cast=float):
    m = re.search(pattern, text)
    if m is None:
        raise LlamaCppError(f"llama.cpp printed no {what} (looked for /{pattern}/)")
    return cast(m.group(1))


def parse_completion(stdout: str, stderr: str) -> LlamaCppRun:
    """``llama-completion -no-cnv --no-display-prompt``'s output: stdout is the generated text, then
    ``" [end of text]\\n"`` where it sampled an end-of-generation token, then ``"\\n\\n"``; stderr has its timings
    (``prompt eval time = X ms / N tokens``, ``eval time = Y ms / M runs``, ``sampling time = Z ms``)."""
    if not stdout.endswith("\n\n"):
        raise LlamaCppError("llama-completion's output did not end as expected (the tool stopped early?)")
    text = stdout[:-2]
    eos = text.endswith(_END_OF_TEXT)
    if eos:
        text = text[:-len(_END_OF_TEXT)]
    prompt_ms = _number(r"prompt eval time =\s*([\d.]+) ms", stderr, "prompt eval time")
    prompt_tokens = _number(r"prompt eval time =\s*[\d.]+ ms /\s*(\d+) tokens", stderr, "prompt token count", int)
    eval_ms = _number(r"\beval time =\s*([\d.]+) ms /\s*\d+ runs", stderr, "eval time")
    runs = _number(r"\beval time =\s*[\d.]+ ms /\s*(\d+) runs", stderr, "eval run count", int)
    sampling_ms = _number(r"sampling time =\s*([\d.]+) ms", stderr, "sampling time")
    return LlamaCppRun(text=text, prompt_tokens=prompt_tokens, new_tokens=runs + 1,
                       seconds=(prompt_ms + eval_ms + sampling_ms) / 1000, stopped_at_eos=eos)


def parse_speculative(stdout: str, stderr: str, prompt_text: str, eos_text: str) -> LlamaCppRun:
    """``llama-speculative`` / ``llama-lookup``'s output: stdout is ``"\\n\\n"``, the prompt's pieces, the generated
    pieces (special tokens printed: an end-of-generation token shows as ``eos_text``; the text is cut there, the
    tokens its verify step accepted after it dropped), ``"\\n\\n"`` and ``"\\n\\n"`` again at exit; stderr has ``encoded N tokens in S seconds``, ``decoded M tokens in S seconds``, ``n_drafted``
    and ``n_accept``."""
    head, tail = "\n\n" + prompt_text, "\n\n\n\n"
    if not stdout.startswith(head):
        raise LlamaCppError("the tool printed another prompt than it was given (tokenized differently?)")
    if not stdout.endswith(tail):
        raise LlamaCppError("the tool's output did not end as expected (it stopped early?)")
    text, eos_found, _ = stdout[len(head):-len(tail)].partition(eos_text)  # the step's tokens past it are printed too
    eos = bool(eos_found)
    enc_s = _number(r"encoded\s+\d+ tokens in\s+([\d.]+) seconds", stderr, "prefill time")
    dec_s = _number(r"decoded\s+\d+ tokens in\s+([\d.]+) seconds", stderr, "decode time")
    return LlamaCppRun(
        text=text, prompt_tokens=_number(r"encoded\s+(\d+) tokens", stderr, "prompt token count", int),
        new_tokens=_number(r"decoded\s+(\d+) tokens", stderr, "generated token count", int),
        seconds=enc_s + dec_s, stopped_at_eos=eos,
        drafted=_number(r"n_drafted\s*=\s*(\d+)", stderr, "n_drafted", int),
        accepted=_number(r"n_accept\s*=\s*(\d+)", stderr, "n_accept", int))


class LlamaCpp:
    """Greedy decoding of one prompt by llama.cpp's tools, on ``threads`` threads (the draft model's too).

    ``tokenizer`` is the verifier's (transformers) tokenizer: prompts come as ids and go to llama.cpp as their text
    (special tokens written out, which llama.cpp parses back into the same tokens - checked on every run: a prompt
    llama.cpp tokenized into another count of tokens raises ``LlamaCppError`` rather than time another prompt)."""

    def __init__(self, bin_dir: Path, tokenizer, threads: int = 2, context: int = 4096):
        self.bin_dir, self.tokenizer, self.threads, self.context = Path(bin_dir), tokenizer, threads, context
        self.eos_text = tokenizer.convert_ids_to_tokens(tokenizer.eos_token_id)

    def _common(self, model: Path, prompt: str, max_new_tokens: int) -> list[str]:
        return ["-m", str(model), "-p", prompt, "-n", str(max_new_tokens), "--temp", "0", "--seed", "0",
                "-t", str(self.threads), "-tb", str(self.threads), "-c", str(self.context),
                "--no-escape", "--color", "off", "--log-colors", "off"]

    def completion_command(self, model: Path, prompt: str, max_new_tokens: int) -> list[str]:
        """Plain decoding: ``llama-completion``, no conversation mode, the prompt not echoed."""
        return [str(self.bin_dir / "llama-completion"), *self._common(model, prompt, max_new_tokens),
                "-no-cnv", "--no-display-prompt"]

    def speculative_command(self, model: Path, draft: Path, prompt: str, max_new_tokens: int, n_max: int) -> list[str]:
        """Draft-model speculation: ``llama-speculative`` drafting up to ``n_max`` tokens with ``draft``."""
        return [str(self.bin_dir / "llama-speculative"), *self._common(model, prompt, max_new_tokens),
                "-md", str(draft), "-td", str(self.threads), "--spec-draft-n-max", str(n_max)]

    def lookup_command(self, model: Path, prompt: str, max_new_tokens: int, n_max: int) -> list[str]:
        """Prompt lookup: ``llama-lookup`` drafting up to ``n_max`` tokens from n-grams of the context."""
        return [str(self.bin_dir / "llama-lookup"), *self._common(model, prompt, max_new_tokens),
                "--spec-draft-n-max", str(n_max)]

    def prompt_text(self, prompt_ids: list[int]) -> str:
        return self.tokenizer.decode(prompt_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def run(self, cmd: list[str], prompt_ids: list[int], timeout: float = 3600) -> LlamaCppRun:
        """Run one tool command (built by the ``*_command`` methods from ``prompt_text(prompt_ids)``) and read it."""
        with tempfile.TemporaryDirectory(prefix="metasd-llama-") as tmp:  # llama-lookup may write cache files
            done = subprocess.run(cmd, capture_output=True, cwd=tmp, timeout=timeout)
        stdout = done.stdout.decode("utf-8", errors="replace")
        stderr = done.stderr.decode("utf-8", errors="replace")
        tool = Path(cmd[0]).name
        if done.returncode != 0:
            raise LlamaCppError(f"{tool} exited with {done.returncode}: {stderr[-800:]}")
        if tool == "llama-completion":
            result = parse_completion(stdout, stderr)
        else:
            result = parse_speculative(stdout, stderr, self.prompt_text(prompt_ids), self.eos_text)
        if result.prompt_tokens != len(prompt_ids):
            raise LlamaCppError(f"{tool} tokenized the prompt into {result.prompt_tokens} tokens, the verifier's "
                                f"tokenizer into {len(prompt_ids)}: the two would not decode the same prompt")
        return result

    def token_ids(self, result: LlamaCppRun, max_new_tokens: int) -> list[int]:
        """The tokens delivered: the run's text as the verifier's token ids (end-of-sequence id appended where the
        tool reached it), cut at ``max_new_tokens`` - what the reference's ids are compared with, and counted."""
        ids = self.tokenizer.encode(result.text, add_special_tokens=False)
        if result.stopped_at_eos:
            ids.append(self.tokenizer.eos_token_id)
        return ids[:max_new_tokens]
