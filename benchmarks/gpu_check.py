"""The first GPU run, as one prepared script: what a session lent a GPU runs, nothing fetched, one JSON and a log.

    python benchmarks/gpu_check.py --out $OUT                 # on the GPU (about 7 minutes on an H100)
    python benchmarks/gpu_check.py --device cpu --quick --out /tmp/check   # the dry run (tests/test_gpu_check.py):
                                                          # tiny shapes, one test of each pytest section

Sections, in order, each given what is left of ``--budget-s`` (a section that runs out is cut, the ones after it
still run; every result is written as it comes):

1. ``environment``: Python, torch, transformers, the device, whether the carried packages import.
2. ``kernels``: the int8 and int4 weight-only kernels (``metasd/models/quantize.py``) on the device against the
   weights dequantized by plain arithmetic (bf16; rows 1, 3, 80).
3. ``fake_syncs`` (in the background, on the CPU): the same replay engine and tree drafter on tiny models on the
   fake device of ``tests/second_device.py``, its host-device synchronisations per step by kind - what the GPU
   count of section 5 is compared with.
   ``host_time`` (in the background too, one CPU core, no GPU): ``benchmarks/host_time.py --batch 1 16`` - a
   scheduler step's host time on this machine's CPU (plain, the static tree, the served adaptive pool), beside the
   captured forwards of section 6: what share of a batched step the Python is there.
4. ``conformance_greedy``: every drafter type's greedy identity on tiny models on the device
   (``pytest tests/test_conformance.py -k greedy_output --metasd-device cuda``).
5. ``overhead``: ``benchmarks/gpu_overhead.py`` on the 1.5B and the 8B shapes at tokens/step 1, 2, 4 and 6 and with
   the 0.5B-shape chain drafter at k = 3 (its real drafting cost at about 4 tokens a step), then
   three dynamic tree shapes of the 0.5B drafter on the 1.5B shape (depth:nodes 4:8, 6:16, and 8:32 in int4 as the
   CPU default pool drafts) and the GPU default's static tree [4, 2, 2, 1], verify forwards captured; forward times by
   rows (to calibrate ``CUDA_ROW_COST``); syncs per step as CUDA counts them (``set_sync_debug_mode``). Each its own
   process and file, written after every row.
6. ``batch_forward`` (after the GPU default's replay, at most 45 s): ``benchmarks/batch_forward.py``, the
   scheduler's batched verify forward on the 1.5B shape at 1, 4 and 16 rows x 1, 4, 8 and 16 tokens a row, eager at
   its exact shape against its captured bucket (issue "A batch at GPU speed", item 2); then ``draft_forward`` (at
   most 30 s): a drafting level of the batch on the 0.5B shape at 1, 4 and 16 rows x 1 and 4 tokens, each request's
   own cache eagerly against the rows of one ``DraftRows`` captured (``--level draft``, item 1).
7. ``trace_replay_gpu_default``, ``trace_replay_gpu_default8``, then ``trace_replay``: the embedded GPU default pool
   (configs/gpu_default.yaml), its deeper candidate (configs/pools/gpu_default8.yaml: the static tree to depth 8),
   then the CPU default, trace-replayed (``TRACES``) against metasd with no drafter.
8. ``conformance_batch``: every drafter type through the scheduler at captured shapes on the device - the batched
   verify forward and the model drafters' rows and loops (``tests/test_scheduler_drafters.py -k fixed``: greedy
   identity with ``Engine.generate`` for three concurrent requests; issue "A batch at GPU speed"), at most 90 s.
9. ``conformance_sampling``: every drafter type's sampling exactness on the device (chi-square), if time is left.

Section 5 runs every tokens/step row twice - the verifier's verify forwards eager (``graphs: off``) and replayed from
CUDA graphs (``on``; the dry run: ``fixed``, the same buffers eagerly) - and times transformers' static-cache
``generate`` (compiled on CUDA: the strongest plain baseline) beside each; the chain and the static tree run their
catch-up and drafting loop eagerly and captured (``--drafter-graphs off on``: one graph each a step). On a
machine without the packages metasd needs
(pydantic and its own needs; benchmarks/gpu_wheels.md), install the carried wheels first; metasd itself is imported
from the checkout (``metasd_layout``).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import metasd_layout  # noqa: F401  (first: metasd from a bare checkout, as a GPU machine gets it)

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent


class Check:
    """The run's JSON (``gpu_check.json``) and log (``gpu_check.log``), written as results come."""

    def __init__(self, out: Path, budget_s: float):
        self.out, self.t0, self.budget_s = out, time.monotonic(), budget_s
        out.mkdir(parents=True, exist_ok=True)
        self.log_file = open(out / "gpu_check.log", "a", buffering=1)
        self.results: dict = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                              "sections": {}}

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.t0)

    def log(self, msg: str) -> None:
        line = f"[{time.monotonic() - self.t0:6.1f}s] {msg}"
        print(line, flush=True)
        self.log_file.write(line + "\n")

    def record(self, section: str, value) -> None:
        self.results["sections"][section] = value
        self.results["elapsed_s"] = time.monotonic() - self.t0
        (self.out / "gpu_check.json").write_text(json.dumps(self.results, indent=1, default=str))

    def run(self, section: str, argv: list[str], timeout: float, env: dict | None = None) -> dict:
        """A subprocess, its output into the log; cut at ``timeout`` seconds."""
        timeout = max(min(timeout, self.left()), 1.0)
        self.log(f"{section}: {' '.join(argv)} (at most {timeout:.0f} s)")
        t = time.monotonic()
        try:
            p = subprocess.run(argv, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, timeout=timeout)
            out, rc = p.stdout, p.returncode
        except subprocess.TimeoutExpired as e:
            out, rc = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "timeout"
        self.log_file.write(out)
        self.log(f"{section}: exit {rc} after {time.monotonic() - t:.0f} s")
        return {"exit": rc, "seconds": time.monotonic() - t, "tail": out[-3000:]}

    def run_script(self, section: str, argv: list[str], out: Path, timeout: float) -> dict:
        """``benchmarks/<argv[0]>`` with ``argv[1:]`` writing its figures to ``out`` (``run``): the run and the
        figures it wrote (None where it wrote none)."""
        run = self.run(section, [sys.executable, str(HERE / argv[0]), *argv[1:], "--out", str(out)], timeout,
                       {"PYTHONUNBUFFERED": "1"})
        return {**run, "figures": json.loads(out.read_text()) if out.exists() else None}


# ---------------------------------------------------------------------------------------------- sections

def environment(device: str) -> dict:
    import importlib

    import torch
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "device": device, "cuda": torch.version.cuda, "packages": {}}
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpu_memory_gib"] = torch.cuda.get_device_properties(0).total_memory / 2**30
    for name in ("pydantic", "pydantic_core", "yaml", "scipy", "safetensors", "accelerate", "gguf", "pytest"):
        try:
            module = importlib.import_module(name)
            env["packages"][name] = getattr(module, "__version__", "?")
        except ImportError as e:
            env["packages"][name] = f"missing: {e}"
    try:
        import metasd  # noqa: F401
        import metasd.drafters  # noqa: F401
        env["metasd_imports"] = True
    except Exception as e:  # noqa: BLE001 - reported, the sections after say what it stops
        env["metasd_imports"] = f"{type(e).__name__}: {e}"
    return env


def kernels(device: str) -> dict:
    """int8/int4 ``QuantizedLinear`` on ``device`` against the weight dequantized from the quantizers' own codes."""
    import torch
    from torch import nn

    from metasd.models.quantize import QuantizedLinear, dequantize_int4, quantize_int4, quantize_int8

    results = {}
    torch.manual_seed(1)
    for mode in ("int8", "int4"):
        for rows in (1, 3, 80):
            lin = nn.Linear(256, 192).to(torch.bfloat16)
            # as tests/test_quantize.py: the codes and scales (stored in bf16) of the module's own quantizers
            if mode == "int8":
                q, sc = quantize_int8(lin.weight.detach())
                w = q.float() * sc.to(torch.bfloat16).float()[:, None]
            else:
                q, sz = quantize_int4(lin.weight.detach(), 32)
                w = dequantize_int4(q, sz.to(torch.bfloat16), 32)
            ql = QuantizedLinear(lin.to(device), mode, group_size=32)
            x = torch.randn(1, rows, 256, dtype=torch.bfloat16)
            got = ql(x.to(device)).float().cpu()
            ref = x.float() @ w.t() + lin.bias.detach().float().cpu()
            err = float((got - ref).abs().max())
            results[f"{mode}_rows{rows}"] = {"max_abs_error": err, "ok": err < 0.1 and got.shape == ref.shape}
    results["ok"] = all(r["ok"] for r in results.values())
    return results


def fake_syncs(taus: list[int], trees: list[str], chains: list[int] = ()) -> dict:
    """On the fake device (``tests/second_device.py``): per step of a whole request (its start and end included, as
    ``gpu_overhead.py`` counts on the GPU), the host-device synchronisations by kind."""
    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(HERE))
    import torch

    import second_device
    from gpu_overhead import build, parse_tree, record, tree_drafter
    from metasd import Engine, Verifier
    from metasd.drafters import PretrainedDrafter
    from metasd.drafters.replay import ReplayDrafter

    dev = second_device.enable()
    n, out = 32, {}  # a request's start (its first token's read included) and end, spread over its steps
    with torch.inference_mode():
        cpu_model = build("tiny", torch.device("cpu"), torch.float32)
        prompt = torch.randint(1, 1024, (1, 16), generator=torch.Generator().manual_seed(1))
        reference, _ = record(cpu_model, prompt, n + max(taus + [9]) + 1)
        model = cpu_model.to(dev)
        small = build("tiny", torch.device("cpu"), torch.float32, seed=2).to(dev)
        verifier = Verifier(model)
        ids = prompt[0].tolist()
        cases = {f"tokens_per_step_{t}": ReplayDrafter(model, accept=t - 1, wrong=1, rerecord=False) if t > 1 else None
                 for t in [1] + taus}
        for spec in trees:
            t = parse_tree(spec)
            if t["quantize"]:
                continue  # the fake device has no int4 kernel
            cases[f"tree_{spec}"] = tree_drafter(small, t)
        for k in chains:  # drafted on the device, read once with the verifier's choices
            cases[f"chain_{k}"] = PretrainedDrafter(small, k=k, name="chain")
            # the drafting loop's buffers as a CUDA graph replays them (run eagerly here)
            cases[f"chain_{k}_loop"] = PretrainedDrafter(small, k=k, name="chain", fixed_shapes=True)
        for spec in [s for s in trees if s.startswith("static:")]:
            cases[f"tree_{spec}_loop"] = tree_drafter(small, parse_tree(spec), "fixed")
        for name, drafter in cases.items():
            if isinstance(drafter, ReplayDrafter):
                drafter.record(ids, reference)
            engine = Engine(verifier, drafter)
            engine.generate(ids, max_new_tokens=4)
            with second_device.count_host_reads() as counted:
                result = engine.generate(ids, max_new_tokens=n)
            steps = result.stats.steps
            out[name] = {"steps": steps, "per_step": counted.total / steps,
                         **{f"{k}_per_step": v / steps for k, v in sorted(counted.items())},
                         "tokens_match": result.token_ids == reference[:n]}
    return out


def replay_section(check: "Check", quick: bool, device: str, out_dir: Path, pool: str, timeout: float) -> dict:
    """An embedded pool trace-replayed (issue "metasd at GPU speed", item 6 (e)): acceptance recorded on a CPU with
    the real models (``TRACES[pool]``), every forward at the real shapes on random weights, against metasd with no
    drafter; the GPU default's static tree replays through its captured drafting loop (the dry run: its buffers,
    ``--graphs fixed``). The replay writes its rows as they come, so a run cut at its time keeps the repeats it
    finished (``summary``)."""
    sys.path.insert(0, str(HERE))
    from trace_replay import summary

    shapes = (["--verifier-shape", "tiny", "--drafter-shape", "tiny", "--dtype", "fp32", "--repeats", "1"] if quick
              else ["--verifier-shape", "1.5b", "--drafter-shape", "0.5b", "--repeats", "3"])
    if quick and pool.startswith("gpu_default"):
        shapes += ["--graphs", "fixed"]
    target = out_dir / ("trace_replay.json" if pool == "default" else f"trace_replay_{pool}.json")
    result = check.run_script(replay_name(pool), ["trace_replay.py", "replay", "--trace", str(TRACES[pool]), "--pool",
                                                  POOLS[pool], "--per-group", "1", *shapes, "--device", device],
                              target, timeout)
    figures = result["figures"]
    if figures and "summary" not in figures:
        figures["summary"] = summary(figures.get("rows", []))  # cut short: the repeats it finished
    return result


def pytest_summary(run: dict) -> dict:
    tail = run.get("tail", "")
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|error|errors|skipped|deselected)", tail)}
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", tail, re.M)
    return {**run, "counts": counts, "failed_tests": failed, "tail": tail[-1500:]}


# ---------------------------------------------------------------------------------------------- main

SECTIONS = ("kernels", "fake_syncs", "host_time", "conformance_greedy", "overhead_1.5b", "overhead_8b", "batch_forward",
            "draft_forward", "overhead_rest", "trace_replay", "conformance_batch", "conformance_sampling")


def replay_name(pool: str) -> str:
    """The section a pool's trace replay is recorded under."""
    return "trace_replay" if pool == "default" else f"trace_replay_{pool}"
#: the traces the embedded pools replay (benchmarks/trace_replay.py record; BENCHMARKS.md says how each was recorded),
#: in the order they run: the GPU default, its deeper candidate, the CPU default
TRACES = {"gpu_default": ROOT / "benchmarks" / "results" / "trace_gpu_default.json",
          "gpu_default8": ROOT / "benchmarks" / "results" / "trace_gpu_default8.json",
          "default": ROOT / "benchmarks" / "results" / "trace_default.json"}
#: each traced pool's file
POOLS = {"gpu_default": "configs/gpu_default.yaml", "gpu_default8": "configs/pools/gpu_default8.yaml",
         "default": "configs/default.yaml"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="cuda (default when there is one) or cpu")
    p.add_argument("--quick", action="store_true", help="tiny shapes and a few tests: the CPU dry run (seconds)")
    p.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"), help="folder for gpu_check.json/.log")
    p.add_argument("--budget-s", type=float, default=460.0, help="the whole run's time (sections are cut to fit)")
    p.add_argument("--new-tokens", type=int, default=96, help="new tokens per request in the overhead rows")
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                   help="run only these (a rerun of what a first run left undone)")
    p.add_argument("--fake-syncs", action="store_true", help=argparse.SUPPRESS)  # section 3, in its own process
    args = p.parse_args(argv)

    taus = [2] if args.quick else [4, 2, 6]  # 4 first: the row if the time runs out
    trees = ["2:4", "static:2,1"] if args.quick else ["4:8", "6:16", "8:32:int4", "static:4,2,2,1"]
    chains = [2] if args.quick else [3]  # the 0.5B chain drafter at 4 tokens a step: the row
    if args.fake_syncs:
        print(json.dumps(fake_syncs(taus, trees, chains)))
        return 0

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    check = Check(Path(args.out), args.budget_s)
    check.log(f"gpu_check on {device}{' (quick)' if args.quick else ''}, budget {args.budget_s:.0f} s, out {args.out}")
    py = sys.executable
    test_env = {"PYTHONUNBUFFERED": "1", "METASD_TEST_DEVICE": device}
    ok = True

    env = environment(device)
    check.record("environment", env)
    check.log(f"environment: {json.dumps(env)}")
    if env["metasd_imports"] is not True:
        check.log("metasd does not import: install the carried wheels (benchmarks/gpu_wheels.md); stopping")
        return 2

    wanted = set(args.sections)
    if "kernels" in wanted:
        try:
            k = kernels(device)
        except Exception as e:  # noqa: BLE001 - a section's failure is a result, the others still run
            k = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        check.record("kernels", k)
        check.log(f"kernels: {json.dumps(k)}")
        ok &= bool(k.get("ok"))

    fake = None  # in the background, on the CPU alone
    if "fake_syncs" in wanted:
        fake = subprocess.Popen([py, str(Path(__file__).resolve()), "--fake-syncs", *(["--quick"] * args.quick)],
                                cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    host = None  # in the background too, on one CPU core: a scheduler step's host time on this machine's CPU
    if "host_time" in wanted:
        plan = ["--batch", "2", "--steps", "3", "--vocab", "64", "--drafters", "none", "adaptive"] if args.quick else \
            ["--batch", "1", "16", "--steps", "30", "--vocab", "1024", "--drafters", "none", "static_tree", "adaptive"]
        script = HERE / "host_time.py"
        host = subprocess.Popen([py, "-c", f"import runpy, sys; sys.path.insert(0, {str(HERE)!r}); "
                                 f"import metasd_layout; sys.argv[0] = {str(script)!r}; "
                                 "runpy.run_path(sys.argv[0], run_name='__main__')",
                                 *plan, "--threads", "1", "--out", str(Path(args.out) / "host_time.json")],
                                cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    pytest = [py, "-c", f"import sys; sys.path.insert(0, {str(HERE)!r}); import metasd_layout, pytest; "
              "sys.exit(pytest.main(sys.argv[1:]))",
              "-q", "-p", "no:cacheprovider", "tests/test_conformance.py", "--metasd-device", device]
    if "conformance_greedy" in wanted:
        greedy_k = "greedy_output and ngram" if args.quick else "greedy_output"
        # on the GPU at most 150 s (12 cases x 3 lengths of tiny models); the dry run only checks the plumbing, on
        # whatever CPU it gets
        run = pytest_summary(check.run("conformance_greedy", pytest + ["-k", greedy_k],
                                       check.left() / 2 if args.quick else 150, test_env))
        check.record("conformance_greedy", run)
        ok &= run["exit"] == 0

    overhead = {}
    out_dir = Path(args.out)
    replays = [pool for pool, trace in TRACES.items() if "trace_replay" in wanted and trace.exists()]
    for pool, trace in TRACES.items() if "trace_replay" in wanted else ():
        if pool not in replays:
            check.record(replay_name(pool), {"skipped": f"no trace at {trace.relative_to(ROOT)}"})
    # (stage, what, cap in seconds), in the order: the strongest baseline, metasd without a drafter, 4 tokens a
    # step with the lookup and with the 0.5B chain, the GPU default trace-replayed - then the rest, cut to the time left
    if args.quick:
        stages = [("overhead:tiny", ["--shapes", "tiny", "--taus", *map(str, taus), "--trees", *trees,
                                     "--chains", *map(str, chains), "--new-tokens", "8", "--prompt-tokens", "8",
                                     "--forward-rows", "1", "2", "--repeats", "3", "--graphs", "off", "fixed",
                                     "--static", "--drafter-graphs", "off", "fixed"], None)]  # fixed: buffers, eager
        stages += [(f"replay:{pool}", None, None) for pool in replays]
        stages += [(f"{level}:tiny", ["--shape", "tiny", "--rows", "1", "3", "--tokens", "1", "4", "--graphs", "off",
                                      "fixed", "--repeats", "3", "--dtype", "fp32"], None)
                   for level in ("batch", "draft")]
    else:
        common = ["--new-tokens", str(args.new_tokens), "--repeats", "3"]
        core = ["--taus", "4", "--graphs", "on", "--static", "--chains", *map(str, chains), "--drafter-graphs", "on"]
        stages = [("overhead:1.5b", ["--shapes", "1.5b", *core, "--trees", "static:4,2,2,1", "--forward-rows", "1",
                                     "8", "32", *common], 150),
                  ("overhead:8b", ["--shapes", "8b", *core, "--forward-rows", "1", "8", "32", *common], 150),
                  *[(f"replay:{pool}", None, 100) for pool in replays if pool == "gpu_default"],
                  # the scheduler's batched verify forward per (rows, tokens), eager against captured
                  ("batch:1.5b", ["--shape", "1.5b", "--rows", "1", "4", "16", "--tokens", "1", "4", "8", "16",
                                  "--graphs", "off", "on", "--repeats", "5"], 45),
                  # a drafting level of the batch: each request's own cache against one DraftRows, captured
                  ("draft:0.5b", ["--shape", "0.5b", "--rows", "1", "4", "16", "--tokens", "1", "4", "--graphs",
                                  "off", "on", "--repeats", "5"], 30),
                  # the rest: eager rows beside captured ones, tokens/step 2 and 6, the dynamic trees
                  ("overhead:rest", ["--shapes", "1.5b", "--taus", "2", "6", "--graphs", "off", "on", "--chains",
                                     *map(str, chains), "--drafter-graphs", "off", "--trees", *trees,
                                     "--forward-rows", "2", "4", "16", *common], None),
                  *[(f"replay:{pool}", None, None) for pool in replays if pool != "gpu_default"]]
        stages = [st for st in stages if st[0].startswith("replay:") or f"overhead_{st[0][9:]}" in wanted
                  or st[0].startswith("batch:") and "batch_forward" in wanted
                  or st[0].startswith("draft:") and "draft_forward" in wanted]
    for i, (stage, plan, cap) in enumerate(stages):
        later_core = sum(1 for _, _, c in stages[i + 1:] if c is not None)  # each keeps at least a minute
        if args.quick:
            timeout = check.left() / (len(stages) - i)
        elif cap is not None:  # a core stage: its cap, less a minute for each core stage after it
            timeout = min(cap, check.left() - 60 * later_core - 30)
        else:  # the rest share what the core left, evenly, 30 s kept for the sampling tests
            timeout = (check.left() - 60 * later_core - 30) / sum(1 for _, _, c in stages[i:] if c is None)
        kind, name = stage.split(":")
        if kind in ("batch", "draft"):
            section = f"{kind}_forward"
            level = ["--level", "draft"] if kind == "draft" else []
            result = check.run_script(section, ["batch_forward.py", *level, *plan, "--device", device],
                                      out_dir / f"{section}.json", timeout)
            check.record(section, result)
            ok &= result["exit"] == 0
            continue
        if kind == "replay":
            result = replay_section(check, args.quick, device, out_dir, name, timeout)
            check.record(replay_name(name), result)
            ok &= result.get("exit") == 0
            continue
        overhead[name] = check.run_script(f"overhead_{name}", ["gpu_overhead.py", *plan, "--device", device],
                                          out_dir / f"gpu_overhead_{name}.json", timeout)
        check.record("overhead", overhead)
        ok &= overhead[name]["exit"] == 0

    if fake is not None:
        try:
            stdout, stderr = fake.communicate(timeout=max(check.left() - 30, 5))
            fake_result = json.loads(stdout.strip().splitlines()[-1]) if fake.returncode == 0 else {
                "exit": fake.returncode, "stderr": stderr[-2000:]}
        except (subprocess.TimeoutExpired, ValueError, IndexError) as e:
            fake.kill()
            fake_result = {"error": f"{type(e).__name__}: {e}"}
        check.record("fake_syncs", fake_result)
        check.log(f"fake_syncs: {json.dumps(fake_result)}")
        ok &= "error" not in fake_result and "exit" not in fake_result

    if host is not None:
        try:
            output, _ = host.communicate(timeout=max(check.left() - 30, 5))
            figures = Path(args.out) / "host_time.json"
            host_result = {"exit": host.returncode, "tail": output[-1500:],
                           "figures": json.loads(figures.read_text()) if figures.exists() else None}
        except subprocess.TimeoutExpired as e:
            host.kill()
            host_result = {"error": f"{type(e).__name__}: {e}"}
        check.record("host_time", host_result)
        check.log(f"host_time: exit {host_result.get('exit')}")
        ok &= host_result.get("exit") == 0

    if "conformance_batch" in wanted and check.left() > 40:
        batch_k = "fixed and (static_tree or ngram)" if args.quick else "fixed"
        tests = [a if a != "tests/test_conformance.py" else "tests/test_scheduler_drafters.py" for a in pytest]
        run = pytest_summary(check.run("conformance_batch", tests + ["-k", batch_k],
                                       check.left() / 3 if args.quick else min(90.0, check.left() - 30), test_env))
        check.record("conformance_batch", run)
        ok &= run["exit"] == 0
    elif "conformance_batch" in wanted:
        check.record("conformance_batch", {"skipped": "no time left"})

    if "conformance_sampling" in wanted and check.left() > 20:
        # the dry run stands in a fast test of the same file for the slow chi-square ones: it checks the plumbing
        sampling_k = "round_trips and ngram" if args.quick else "sampling_follows"
        run = pytest_summary(check.run("conformance_sampling", pytest + ["-k", sampling_k], check.left() - 5,
                                       test_env))
        check.record("conformance_sampling", run)
        ok &= run["exit"] == 0
    elif "conformance_sampling" in wanted:
        check.record("conformance_sampling", {"skipped": "no time left"})

    check.results["ok"] = bool(ok)
    check.record("summary", _summary(check.results))
    check.log(f"summary: {json.dumps(check.results['sections']['summary'])}")
    check.log(f"done in {time.monotonic() - check.t0:.0f} s: {'ok' if ok else 'SOMETHING FAILED (see above)'}")
    return 0 if ok else 1


def _summary(results: dict) -> dict:
    """The figures the issue asks for, one line each: per shape and tokens/step (or tree), ms/step, engine share,
    speedup over transformers and syncs per step (GPU count beside the fake device's)."""
    s = results["sections"]
    fake = s.get("fake_syncs", {})
    lines = []
    for shape, run in s.get("overhead", {}).items():
        for sh in (run.get("figures") or {}).get("shapes", []):
            for row in sh["rows"]:
                loop = row.get("drafter_graphs", "off")
                what = (f"tau {row['tokens_per_step']} graphs {row.get('graphs_setting', 'off')}"
                        if "tokens_per_step" in row else
                        f"chain k {row['k']} graphs {row.get('graphs_setting', 'off')} loop {loop}" if "k" in row else
                        f"{'static ' if 'static' in row else ''}tree {row['depth']}:{row['nodes']}"
                        f"{':' + row['quantize'] if row.get('quantize') else ''}"
                        + (f" loop {loop}" if "static" in row else ""))
                loop_key = "_loop" if loop in ("on", "fixed") else ""
                if "failed" in row:
                    lines.append(f"{sh['shape']} {what}: FAILED {row['failed']}")
                    continue
                fake_row = (fake.get(f"tokens_per_step_{row['tokens_per_step']}") if "tokens_per_step" in row else
                            fake.get(f"chain_{row['k']}{loop_key}") if "k" in row else
                            fake.get(f"tree_static:{','.join(map(str, row['static']))}{loop_key}") if "static" in row
                            else None)
                gpu_syncs = row.get("cuda_sync_warnings_per_step")
                lines.append(
                    f"{sh['shape']} {what}: {row['ms_per_step']:.2f} ms/step, engine "
                    + (f"{row['engine_share']:.0%}, " if row["engine_share"] is not None else "- (graphs), ")
                    + (f"host overhead {row['host_overhead']:.0%} of the call, " if row.get("host_overhead") is not None
                       else "")
                    + f"{row['speedup_over_transformers']:.2f}x transformers"
                    + (f", {row['speedup_over_static']:.2f}x static-cache generate" if "speedup_over_static" in row
                       else "")
                    + ", syncs/step "
                    + (f"cuda {gpu_syncs:.2f}" if gpu_syncs is not None else "cuda -")
                    + (f", fake {fake_row['per_step']:.2f}" if fake_row else ""))
    for section in ("batch_forward", "draft_forward"):
        for row in (s.get(section, {}).get("figures") or {}).get("rows", []):
            settings = [k for k in row["order"] if k != "off"]
            lines.append(f"{section.replace('_', ' ')} {row['rows']} rows x {row['tokens']} tokens: "
                         + ", ".join(f"{k} {row[k]['median']:.2f} ms" for k in ["off", *settings] if k in row)
                         + "".join(f", {k}/off {row[f'{k}_over_off']:.2f}" for k in settings
                                   if f"{k}_over_off" in row))
    for section in ("trace_replay_gpu_default", "trace_replay_gpu_default8", "trace_replay"):
        replay = (s.get(section, {}).get("figures") or {}).get("summary", {})
        for prompts, by_method in replay.items():
            for method, fig in by_method.items() if isinstance(by_method, dict) else ():
                lines.append(f"trace-replayed, {prompts}: {method}: {fig['ratio_median']:.2f}x "
                             f"[{fig['ratio_range'][0]:.2f}, {fig['ratio_range'][1]:.2f}] metasd with no drafter "
                             f"over {replay['repeats']} repeats"
                             + ("" if fig["identical"] else " (an output LEFT its recording)"))
    return {"ok": results.get("ok"), "rows": lines,
            "tests": {k: s[k].get("counts") for k in ("conformance_greedy", "conformance_batch", "conformance_sampling")
                      if k in s},
            "kernels_ok": s.get("kernels", {}).get("ok")}


if __name__ == "__main__":
    sys.exit(main())
