"""The verifier on llama.cpp: the same prefill / verify / commit contract as ``Verifier``, its forwards run by
llama.cpp (``llama-cpp-python``'s low-level API) over a GGUF of the verifier's weights.

A draft tree is verified in one ``llama_decode``, as llama.cpp's own tree speculation does it: the KV cache is unified
(one buffer for every sequence), the committed prefix lives in sequence 0, each leaf of the tree gets a sequence of its
own (1..L) that first receives the prefix (``seq_cp``: the cells are shared, only their sequence sets grow), and each
node belongs to the sequences of the leaves below it. llama.cpp lets a token attend to the cells of its first sequence
at positions up to its own, so a node at depth d (position committed + d) sees the prefix, its ancestors and itself -
the ancestor mask of ``tree.ancestor_mask``. After acceptance the path is kept: every cell outside one leaf's sequence
below the last accepted node is dropped (``seq_keep``), the rejected deeper nodes of that leaf are cut (``seq_rm``),
and the survivors move back to sequence 0. A chain is one sequence (0): verify appends, commit crops.

Lossless with respect to the verifier as llama.cpp computes it: logits are llama.cpp's. A batched forward rounds
differently from a one-token one, so greedy output matches llama.cpp's own plain decoding up to near-ties, as the torch
verifier's bf16 output does transformers'. No hidden states: drafters that read them stay on the torch backend.

``model`` is the verifier's shape, not its weights (a transformers model on the ``meta`` device): the step meter prices
llama.cpp's forwards from it (``StepMeter.add``: no torch hook sees them), the generation config names the end tokens,
and nothing runs it.
"""
from __future__ import annotations

import ctypes
import importlib
import re
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from .logprobs import PROMPT_LOGPROBS_CHUNK, TokenLogprob, token_logprobs
from .tree import Draft
from .verifier import VerifierOutput

__all__ = ["LlamaCppVerifier", "cpu_flags", "crashes_on_amx", "leaf_sequences", "llama_cpp_module",
           "no_amx_cmake_options", "no_amx_reinstall"]

#: llama.cpp's limit on sequence ids (LLAMA_MAX_SEQ): sequence 0 holds the prefix, so a tree has at most 255 leaves
MAX_SEQUENCES = 256
#: tokens per llama_decode (prefill chunks) and per micro-batch: a draft tree is verified in one micro-batch
BATCH_TOKENS = 512

_LOG_CALLBACK = None  # llama.cpp's log sink, kept alive for the process (ctypes callbacks must not be collected)


def llama_cpp_module():
    """``llama_cpp.llama_cpp`` (the ctypes binding), the backend initialised and its log silenced; a clear error
    where the extra is not installed."""
    global _LOG_CALLBACK
    try:
        lib = importlib.import_module("llama_cpp.llama_cpp")
    except ImportError as e:
        raise ImportError("the llama.cpp backend needs llama-cpp-python: pip install 'metasd[llama-cpp]' "
                          f"(it builds llama.cpp, ~10 minutes on 2 cores): {e}") from e
    if _LOG_CALLBACK is None:
        _LOG_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(lambda *_: None)
        lib.llama_log_set(_LOG_CALLBACK, None)
        lib.llama_backend_init()
    return lib


#: GGUF ``general.file_type`` values of unquantized weights (LLAMA_FTYPE_ALL_F32, MOSTLY_F16, MOSTLY_BF16)
FLOAT_FILE_TYPES = frozenset({0, 1, 32})
#: ggml's cmake options for the instruction sets /proc/cpuinfo names (what ``GGML_NATIVE`` would pick, but AMX)
GGML_ISA = (("avx", "GGML_AVX"), ("avx2", "GGML_AVX2"), ("avx_vnni", "GGML_AVX_VNNI"), ("fma", "GGML_FMA"),
            ("f16c", "GGML_F16C"), ("bmi2", "GGML_BMI2"), ("avx512f", "GGML_AVX512"),
            ("avx512vbmi", "GGML_AVX512_VBMI"), ("avx512_vnni", "GGML_AVX512_VNNI"),
            ("avx512_bf16", "GGML_AVX512_BF16"))


def cpu_flags() -> set[str]:
    """This CPU's flags as /proc/cpuinfo names them (empty where there is none: not Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    match = re.search(r"^flags\s*:(.*)$", text, re.MULTILINE)
    return set(match.group(1).split()) if match else set()


def no_amx_cmake_options(flags: set[str]) -> list[str]:
    """cmake options building llama.cpp for a CPU with ``flags`` without ggml's AMX kernels: each instruction set of
    ``GGML_ISA`` on where the CPU has it, ``GGML_NATIVE`` (which would compile the AMX kernels in) and AMX off."""
    isa = [f"-D{option}={'ON' if flag in flags else 'OFF'}" for flag, option in GGML_ISA]
    return ["-DGGML_NATIVE=OFF", *isa, "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]


def no_amx_reinstall(flags: set[str]) -> str:
    """The command that reinstalls llama-cpp-python without ggml's AMX kernels for a CPU with ``flags``
    (``--no-cache-dir``: pip otherwise reuses the wheel it built before, AMX kernels included)."""
    return (f"CMAKE_ARGS=\"-DLLAVA_BUILD=OFF {' '.join(no_amx_cmake_options(flags))}\" pip install --force-reinstall "
            f"--no-cache-dir --no-deps --no-binary llama-cpp-python llama-cpp-python==0.3.36")


def crashes_on_amx(system_info: str, file_type: int | None) -> bool:
    """Whether llama.cpp as built would crash on these weights: the build has ggml's AMX kernels (``AMX_INT8 = 1`` in
    ``llama_print_system_info``) and the GGUF is quantized. With llama-cpp-python 0.3.36 built ``GGML_NATIVE`` on a CPU
    with AMX, every quantized GGUF tried (Q4_K_M, Q4_0, Q8_0) ends the process with a segmentation fault inside
    ``llama_decode``; the same source without the AMX kernels runs them (BENCHMARKS.md, "llama.cpp on the same weights,
    on a CPU with AMX"). ``file_type``: the GGUF's ``general.file_type`` (None: not recorded - not refused)."""
    return "AMX_INT8 = 1" in system_info and file_type is not None and file_type not in FLOAT_FILE_TYPES


def leaf_sequences(parents: Sequence[int], new_leaf) -> list[list[int]]:
    """The sequences of a draft tree in a unified KV cache, per block row (0 = the pending token, i+1 = node i): the
    sequences of the leaves below it, so that each node sees exactly its ancestors. ``new_leaf()`` gives a leaf its
    sequence (one that already holds the committed prefix), leaves in row order.

    parents: [n] each node's parent node (-1: the pending token)."""
    n = len(parents)
    has_child = [False] * (n + 1)
    for p in parents:
        has_child[p + 1] = True
    per_node: list[list[int]] = [[] if has_child[row] else [new_leaf()] for row in range(n + 1)]
    for row in range(n, 0, -1):  # parents come before their children: fold each row's sequences into its parent's
        per_node[parents[row - 1] + 1].extend(per_node[row])
    return per_node


class LlamaCppVerifier:
    """The verifier with its forwards on llama.cpp: ``Verifier``'s interface (prefill, verify a chain or a tree in one
    forward, commit the accepted path) over a GGUF file of the verifier's weights.

    gguf: the GGUF file (``metasd.models.llama_cpp_source.converted_gguf`` makes one from the model metasd loads).
    model: the verifier's shape on the ``meta`` device (pricing, generation config; never run).
    threads: llama.cpp's threads (default: torch's). context: KV cache positions (a request's prompt and new tokens
    must fit; default: the model's context length, at most 8192).
    """

    backend = "llama.cpp"

    def __init__(self, gguf: str | Path, model, tokenizer=None, name: str = "verifier", *, threads: int | None = None,
                 context: int | None = None):
        self.lib = lib = llama_cpp_module()
        self.gguf = Path(gguf)
        if not self.gguf.is_file():
            raise FileNotFoundError(f"{name}: GGUF file {str(self.gguf)!r} does not exist")
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.num_layers = int(cfg.num_hidden_layers)
        self.hidden_size = int(cfg.hidden_size)
        limit = int(getattr(cfg, "max_position_embeddings", 0) or 0) or 8192
        self.context_length = int(context) if context else min(limit, 8192)
        if self.context_length > limit:
            raise ValueError(f"{name}: context {self.context_length} exceeds the model's {limit} positions")
        self.threads = int(threads or torch.get_num_threads())
        self.hidden = None  # llama.cpp hands out no hidden states
        self.hidden_layers: tuple[int, ...] = ()
        self._model = lib.llama_model_load_from_file(str(self.gguf).encode(), lib.llama_model_default_params())
        if not self._model:
            raise ValueError(f"{name}: llama.cpp could not load {str(self.gguf)!r}")
        self._refuse_a_crash(name)
        self.vocab_size = int(lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self._model)))
        if self.vocab_size != int(cfg.vocab_size):
            raise ValueError(f"{name}: {self.gguf.name} has {self.vocab_size} tokens, the model's config "
                             f"{cfg.vocab_size}: not the same model")
        params = lib.llama_context_default_params()
        params.n_ctx = self.context_length
        self.batch_tokens = min(BATCH_TOKENS, self.context_length)  # llama.cpp asserts a batch within the context
        params.n_batch = params.n_ubatch = self.batch_tokens
        self.max_sequences = min(MAX_SEQUENCES, self.batch_tokens)  # as many outputs as one batch: llama.cpp's assert
        params.n_seq_max = self.max_sequences
        params.kv_unified = True
        params.n_threads = params.n_threads_batch = self.threads
        params.no_perf = True
        self._ctx = lib.llama_init_from_model(self._model, params)
        if not self._ctx:
            raise ValueError(f"{name}: llama.cpp could not create a context of {self.context_length} positions")
        self._memory = lib.llama_get_memory(self._ctx)
        self._batch = lib.llama_batch_init(self.batch_tokens, 0, self.max_sequences)
        self._past = 0  # cached positions: committed tokens minus the pending one
        self._block: tuple[int, list[list[int]] | None] | None = None  # (start, per-node sequences) until commit

    def __del__(self):
        lib = getattr(self, "lib", None)
        if lib is None:
            return
        if getattr(self, "_batch", None) is not None:
            lib.llama_batch_free(self._batch)
        if getattr(self, "_ctx", None):
            lib.llama_free(self._ctx)
        if getattr(self, "_model", None):
            lib.llama_model_free(self._model)

    def _refuse_a_crash(self, name: str) -> None:
        """A clear error, before any forward, where this llama.cpp build would crash on these weights
        (``crashes_on_amx``)."""
        buf = ctypes.create_string_buffer(32)
        n = self.lib.llama_model_meta_val_str(self._model, b"general.file_type", buf, len(buf))
        file_type = int(buf.value) if n > 0 and buf.value.isdigit() else None
        if crashes_on_amx(self.lib.llama_print_system_info().decode(errors="replace"), file_type):
            raise ValueError(f"{name}: {self.gguf.name} holds quantized weights (GGUF file type {file_type}), which "
                             f"the installed llama-cpp-python's AMX kernels crash on (a segmentation fault in its "
                             f"first forward, seen with 0.3.36 on CPUs with AMX). Use a bf16 or f16 GGUF, or "
                             f"reinstall llama-cpp-python without AMX: {no_amx_reinstall(cpu_flags())}")

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")  # logits come back to host memory

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def cached(self) -> int:
        """Number of positions in the KV cache (committed tokens minus the pending one)."""
        return self._past

    def describe(self) -> str:
        """Where its forwards run, for a log line."""
        return f"{self.name} on llama.cpp ({self.gguf.name}, {self.threads} threads, context {self.context_length})"

    def reset(self, reserve: int = 0) -> None:
        """An empty KV cache; ``reserve`` positions must fit in the context."""
        if reserve > self.context_length:
            raise ValueError(f"{self.name}: {reserve} positions do not fit in the llama.cpp context of "
                             f"{self.context_length} (verifier: {{context: ...}} in the pool)")
        self.lib.llama_memory_clear(self._memory, True)
        self._past = 0
        self._block = None

    def _decode(self, tokens: Sequence[int], positions: Sequence[int], sequences: Sequence[Sequence[int]],
                outputs: bool | Sequence[bool]) -> torch.Tensor | None:
        """One llama_decode of ``tokens`` at ``positions`` in ``sequences``; the logits [m, vocab] (float32, host) of
        the tokens ``outputs`` marks (True: every token; False: none, and None is returned)."""
        b, n = self._batch, len(tokens)
        flags = [bool(outputs)] * n if isinstance(outputs, bool) else [bool(o) for o in outputs]
        b.n_tokens = n
        for i in range(n):
            b.token[i], b.pos[i], b.logits[i] = int(tokens[i]), int(positions[i]), flags[i]
            seqs = sequences[i]
            b.n_seq_id[i] = len(seqs)
            row = b.seq_id[i]
            for j, s in enumerate(seqs):
                row[j] = s
        rc = self.lib.llama_decode(self._ctx, b)
        if rc != 0:
            raise RuntimeError(f"{self.name}: llama_decode returned {rc} for {n} tokens at position {positions[0]} "
                               f"(context {self.context_length})")
        m = sum(flags)
        if not m:
            return None
        logits = np.ctypeslib.as_array(self.lib.llama_get_logits(self._ctx), shape=(m, self.vocab_size))
        return torch.from_numpy(logits.copy())

    @torch.inference_mode()
    def prefill(self, token_ids: torch.Tensor, hidden_layers: Sequence[int] = (), reserve: int = 0,
                score: Sequence[int] | None = None, top: int = 0) -> list[TokenLogprob] | None:
        """``Verifier.prefill``: cache ``token_ids`` (every prompt token but the last) in sequence 0; ``score``: the
        prompt's log-probabilities, as there. ``hidden_layers`` must be empty (llama.cpp hands out none)."""
        if hidden_layers:
            raise ValueError(f"{self.name}: the llama.cpp backend has no hidden states (layers {list(hidden_layers)} "
                             "asked for); drafters that read them need verifier: {backend: torch}")
        self.reset(max(reserve, len(token_ids)))
        ids = [int(t) for t in token_ids]
        scored: list[TokenLogprob] = []
        chunk = self.batch_tokens if score is None else min(self.batch_tokens, PROMPT_LOGPROBS_CHUNK)
        for start in range(0, len(ids), chunk):
            part = ids[start: start + chunk]
            logits = self._decode(part, range(start, start + len(part)), [(0,)] * len(part), score is not None)
            if score is not None:
                scored += token_logprobs(logits, score[start: start + len(part)], top)
        self._past = len(ids)
        return scored if score is not None else None

    def timed_forward(self, n: int) -> float:
        """Seconds of one forward over ``n`` tokens after the cached positions (a chain in sequence 0, logits at every
        position, as a verify computes them); the cache is left as it was (forward profiles)."""
        if self._past + n > self.context_length or n > self.batch_tokens:
            raise ValueError(f"{self.name}: a forward of {n} tokens after {self._past} does not fit the llama.cpp "
                             f"context ({self.context_length} positions, {self.batch_tokens} a forward)")
        start = time.perf_counter()
        self._decode([0] * n, range(self._past, self._past + n), [(0,)] * n, True)
        elapsed = time.perf_counter() - start
        self.lib.llama_memory_seq_rm(self._memory, 0, self._past, -1)
        return elapsed

    @torch.inference_mode()
    def verify(self, pending: int, draft: Draft) -> VerifierOutput:
        """Score [pending] + draft in one llama_decode (a tree through per-leaf sequences). Returns the logits
        [n+1, vocab]: row 0 after the pending token, row i+1 after node i; no hidden states."""
        if self._block is not None:
            raise RuntimeError("LlamaCppVerifier.verify called twice without a commit in between")
        n, past = len(draft), self._past
        if n + 1 > self.batch_tokens:
            raise ValueError(f"{self.name}: a draft of {n} nodes exceeds the llama.cpp backend's {self.batch_tokens - 1}")
        if past + n + 1 > self.context_length:
            raise ValueError(f"{self.name}: {past + n + 1} positions exceed the llama.cpp context of "
                             f"{self.context_length}")
        tokens = [int(pending), *draft.tokens.tolist()]
        depth = draft.layout.depths  # [n+1], the root's 0 first
        sequences = None if draft.is_chain else self._tree_sequences(draft.parents.tolist())
        logits = self._decode(tokens, [past + d for d in depth], sequences or [(0,)] * (n + 1), True)
        self._block = (past, sequences)
        return VerifierOutput(logits, {})

    def _tree_sequences(self, parents: list[int]) -> list[list[int]]:
        """Per block row (0 = pending, i+1 = node i): the sequences of the leaves below it, 1..L; each leaf's sequence
        first receives the committed prefix."""
        leaves = len(parents) + 1 - len(set(parents))  # rows no node names as its parent (-1 names row 0)
        if leaves >= self.max_sequences:
            raise ValueError(f"{self.name}: a draft tree of {leaves} leaves exceeds the llama.cpp backend's "
                             f"{self.max_sequences - 1}")
        ids = iter(range(1, leaves + 1))

        def new_leaf() -> int:
            s = next(ids)
            self.lib.llama_memory_seq_cp(self._memory, 0, s, -1, -1)
            return s

        return leaf_sequences(parents, new_leaf)

    @torch.inference_mode()
    def commit(self, path: Sequence[int], out: VerifierOutput | None = None) -> torch.Tensor:
        """Keep the pending token and the accepted nodes ``path`` of the block last verified in sequence 0; drop the
        rest. Returns the kept rows [n_acc + 1] of the block."""
        if self._block is None:
            raise RuntimeError("LlamaCppVerifier.commit called without a verified block")
        (past, sequences), self._block = self._block, None
        rows = [0] + [i + 1 for i in path]
        end = past + len(rows)
        lib, mem = self.lib, self._memory
        if sequences is None:
            lib.llama_memory_seq_rm(mem, 0, end, -1)
        else:
            keep = sequences[rows[-1]][0]  # a leaf below the last accepted row: its sequence holds the path
            lib.llama_memory_seq_keep(mem, keep)  # every other cell goes; the kept ones lose their other sequences
            lib.llama_memory_seq_rm(mem, keep, end, -1)  # the leaf's nodes past the accepted path
            lib.llama_memory_seq_cp(mem, keep, 0, -1, -1)
            lib.llama_memory_seq_rm(mem, keep, -1, -1)
        self._past = end
        return torch.tensor(rows, dtype=torch.long)
