"""`metasd serve` measured on a GPU, trace-replayed (issue "A batch at GPU speed", item 4): one prepared device script.

    python benchmarks/gpu_serve.py --out $OUT --budget-s 420                      # on the GPU
    python benchmarks/gpu_serve.py --device cpu --dry-run --out /tmp/serve_check   # the CPU dry run (tiny shapes;
                                                                                   # tests/test_gpu_serve.py)

1. ``trace_replay.py serve-prep`` into a scratch folder (``--work``; default a temporary one: the weights stay out of
   ``$OUT``): random-weight models of the real shapes (``--verifier-shape``, ``--drafter-shape``) with a byte-level
   tokenizer, the recorded trace (``--trace``, the default pool's, recorded on a CPU with the real models) replayed
   on them, its prompts as chat text with their recorded answer lengths, the serving pool's arms rewritten to trace
   entries (``pool.yaml``) and the verifier alone (``plain.yaml``).
2. ``serve_load.py`` at ``--concurrency`` (default 1 4 16 64) against three servers started one at a time, the order
   rotated per repeat (each server its own serve_load run and file, so that one failing - a first contact with the
   device - is reported and left out of later repeats while the others go on): ``transformers`` (``transformers
   serve --continuous-batching`` on the same weights), ``plain`` (``metasd serve`` without drafters: metasd's plain
   batched path) and ``adaptive`` (the serving pool, its acceptance replayed from the trace). Repeats run while
   ``--budget-s`` leaves time for one more (the first always runs); the log says how many did. Results:
   ``$OUT/gpu_serve.json`` (every server's rows, the repeats run, the servers that failed and why), each server's
   own ``gpu_serve_<server>.json`` and its server logs. metasd's shapes are captured the first time a level meets
   them, inside that level: each metasd row says how many graphs it captured and the seconds that took (``graphs``,
   read from the server's ``/metrics``; the warm-up's apart), and the tables list the levels that captured any.

Every figure from it is **trace-replayed**: the acceptance is the recorded pool's on the real models, the forwards
and the serving are the device's. Sampled requests are not replayed (greedy only).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import metasd_layout  # noqa: F401  (first: metasd from a bare checkout, as a GPU machine gets it)

HERE = Path(__file__).resolve().parent
SERVERS = ("transformers", "plain", "adaptive")


def metasd_cmd() -> list[str]:
    """``metasd serve`` from this checkout whether or not metasd is installed (``metasd_cli.py``)."""
    return [sys.executable, str(HERE / "metasd_cli.py"), "serve"]


def load_argv(args, work: Path, out: Path, repeats: int, server: str) -> list[str]:
    """serve_load.py's arguments for ``server``'s first ``repeats`` repeats into its own file (``--resume``: the
    finished ones are kept)."""
    return ["--questions", str(work / "questions.jsonl"), "--per-group", "1000", "--model-dir", str(work / "verifier"),
            "--servers", server, "--extra-pool", f"plain={work / 'plain.yaml'}",
            "--extra-pool", f"adaptive={work / 'pool.yaml'}", "--concurrency", *map(str, args.concurrency),
            "--requests-per-c", "1", "--repeats", str(repeats), "--warmup-prompt", "first", "--device", args.device,
            "--threads", str(args.threads), "--level-timeout", str(args.level_timeout),
            "--startup-timeout", str(args.startup_timeout), "--metasd-cmd", *metasd_cmd(),
            "--out", str(out / f"gpu_serve_{server}.json"), "--resume"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--work", help="scratch folder for the random weights (default: a temporary one)")
    p.add_argument("--trace", default=str(HERE / "results" / "trace_default.json"))
    p.add_argument("--pool", default=str(HERE.parent / "configs" / "pools" / "serve_adaptive.yaml"))
    p.add_argument("--verifier-shape", default="1.5b")
    p.add_argument("--drafter-shape", default="0.5b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--per-group", type=int, default=1, help="trace prompts per group")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--servers", nargs="+", default=list(SERVERS), choices=SERVERS)
    p.add_argument("--budget-s", type=float, default=420.0)
    p.add_argument("--threads", type=int, default=8, help="CPU threads of each server")
    p.add_argument("--level-timeout", type=float, default=120.0)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--dry-run", action="store_true", help="the tiny shapes (a CPU check of the whole path)")
    args = p.parse_args(argv)
    if args.dry_run:
        args.verifier_shape = args.drafter_shape = "tiny"
    t0, out = time.monotonic(), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import serve_load
    import trace_replay
    from metasd.bench import stats

    with tempfile.TemporaryDirectory(prefix="gpu_serve_") as scratch:
        work = Path(args.work or scratch)
        prep = ["serve-prep", "--trace", args.trace, "--pool", args.pool, "--verifier-shape", args.verifier_shape,
                "--drafter-shape", args.drafter_shape, "--device", args.device, "--dtype", args.dtype,
                "--per-group", str(args.per_group), "--out", str(work)]
        if trace_replay.main(prep) != 0:
            return 1
        print(f"[gpu_serve] serve-prep done in {time.monotonic() - t0:.0f} s", flush=True)
        done, took, failed = 0, 0.0, {}
        for rep in range(1, args.repeats + 1):
            left = args.budget_s - (time.monotonic() - t0)
            if rep > 1 and left < 1.2 * took:
                print(f"[gpu_serve] {done} repeat(s) run: {left:.0f} s left, a repeat took {took:.0f} s", flush=True)
                break
            t_rep = time.monotonic()
            live = [s for s in args.servers if s not in failed]
            for server in stats.rotation(live, rep - 1):  # the order rotated per repeat
                try:  # one server failing (a first contact with the device) leaves the others' figures
                    serve_load.main(load_argv(args, work, out, rep, server))
                except (Exception, SystemExit) as e:  # noqa: BLE001 - reported in the result, never hidden
                    failed[server] = f"repeat {rep}: {type(e).__name__}: {e}"[:2000]
                    print(f"[gpu_serve] {server} failed, left out of later repeats: {failed[server]}", flush=True)
            took, done = time.monotonic() - t_rep, rep
        rows = [r for s in args.servers if (out / f"gpu_serve_{s}.json").exists()
                for r in json.loads((out / f"gpu_serve_{s}.json").read_text())["rows"]]
        (out / "gpu_serve.json").write_text(json.dumps({"command": " ".join(sys.argv), "label": "trace-replayed",
                                                        "repeats_run": done, "failed": failed, "rows": rows}, indent=1))
        print(f"[gpu_serve] {done} repeat(s), {len(rows)} rows, {time.monotonic() - t0:.0f} s; failed: "
              f"{sorted(failed) or 'none'}; figures trace-replayed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
