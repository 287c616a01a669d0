"""The fault and soak run (benchmarks/serve_soak.py) at a small size: concurrent clients with normal, malformed,
oversized and absurd requests, abandoned streams and half-sent bodies, while KV allocations and batched forwards fail
at random. Every answered request has exactly its text alone, every failure an OpenAI-style error, none is lost, the
server answers afterwards and its KV rows are freed (the stored prefixes of the prefix cache, on as `metasd serve`
has it, stay within the budget)."""
import pytest

pytest.importorskip("fastapi")

from benchmark_scripts import load_script  # noqa: E402


def test_a_small_soak_with_faults_loses_nothing_and_returns_no_wrong_text():
    soak = load_script("serve_soak")
    report = soak.run_soak(requests=60, clients=4, seconds=120, alloc_p=0.05, forward_p=0.05, seed=1,
                           certain_fault_at=3)  # each kind's 3rd draw fails: a run that draws none by chance is no test
    assert report["requests_sent"] == 60, report
    assert report["wrong_outputs"] == 0, report["examples"]["wrong"]
    assert report["lost_without_error"] == 0, report["examples"]["lost"]
    assert report["errors_without_a_clear_body"] == 0, report["examples"]["unclear"]
    assert report["server_alive_at_end"] and report["kv_held_bytes_when_idle"] == 0
    assert report["kv_peak_held_bytes"] <= report["kv_budget_bytes"]
    assert report["kv_prefix_cache_bytes_when_idle"] <= report["kv_budget_bytes"]  # prefix caching on, as served
    assert report["prefix_cache_hit_tokens"] > 0  # later requests reused a shared start: checked texts include them
    assert report["faults_injected"].get("allocation", 0) > 0 and report["faults_injected"].get("forward", 0) > 0
    assert report["checked_texts"] >= 10  # enough answers were compared for the zero to mean something
    assert sum(n for k, n in report["by_kind_and_status"].items() if k.startswith("batch:")) > 0
    # a sampled request of two prompts x n = 2 after the faults (the soak's own may all meet one): 4 choices checked
    assert report["after_faults"] == {"status": 200, "checked_texts": 4}
    assert {"malformed", "oversized", "absurd", "disconnect", "slow_body"} <= set(report["bad_inputs_tried"])
    assert report["by_kind_and_status"].get("slow_body:408", 0) == report["bad_inputs_tried"]["slow_body"]
    # what tells a slow server from a lost answer: every answer's time, under the client's timeout, and the longest step
    assert 0 < report["answer_seconds"]["median"] <= report["answer_seconds"]["max"] < report["client_timeout_s"]
    assert report["answer_seconds"]["n"] == sum(n for k, n in report["by_kind_and_status"].items()
                                                if k.split(":")[1].isdigit())
    assert report["longest_step_s"] > 0


@pytest.mark.parametrize("j", [3, 11])
@pytest.mark.parametrize("check", ["greedy", "seeded"])
def test_the_near_tie_walk_accepts_a_runner_up_within_the_margin_and_nothing_else(check, j):
    """The real-pool soak's check (``tie_walk``): a text that leaves plain decoding at one place (the 4th new token;
    the last, where nothing is left to generate after it), for the token plain decoding ranked second (greedy: by
    log-probability; seeded: by log-probability / T + the request's keyed noise), and follows plain decoding from
    there is accepted within a margin above that gap and refused below it; plain decoding's own text is accepted with
    no gap."""
    soak = load_script("serve_soak")
    from metasd.core.decoding.sampling import KeyedNoise

    _, reference = soak.tiny_pair()
    r = {"prompt": "w10 w11 w12 w10 w11", "max_tokens": 12, "temperature": 0.7, "seed": 5}
    kwargs = {"temperature": 0.7, "seed": 5} if check == "seeded" else {}
    plain = reference.generate(r["prompt"], 12, logprobs=20, **kwargs)
    assert soak.tie_walk(reference, r, check, plain.text, 0.0) == {"ok": True, "margins": []}

    prompt = reference.encode(r["prompt"])
    row = plain.logprobs[j]
    logp = dict(row.top) | {row.token: row.logprob}
    noise = KeyedNoise(5)
    width = reference.verifier.model.config.vocab_size

    def score(t):
        if check == "greedy":
            return logp[t]
        return logp[t] / 0.7 + noise.gumbel(len(prompt) + j, width)[t].item()
    ranked = sorted(logp, key=score, reverse=True)
    assert ranked[0] == plain.token_ids[j]  # the score plain decoding chose by
    runner_up = ranked[1]
    gap = (score(ranked[0]) - score(runner_up)) * (0.7 if check == "seeded" else 1.0)
    forced = list(plain.token_ids[:j]) + [runner_up]
    rest = reference.generate(prompt + forced, 12 - len(forced), **kwargs).token_ids if len(forced) < 12 else []
    served = reference.verifier.tokenizer.decode(forced + list(rest), skip_special_tokens=True)
    assert served != plain.text

    walk = soak.tie_walk(reference, r, check, served, gap + 1e-3)
    assert walk["ok"] and walk["margins"] == [pytest.approx(gap, abs=1e-3)], walk
    assert not soak.tie_walk(reference, r, check, served, gap / 2)["ok"]
    assert not soak.tie_walk(reference, r, check, served + " w99", gap + 1e-3)["ok"]  # more than plain decoding gives
