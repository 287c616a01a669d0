"""A probe's stall of the batch, bounded (``serving.probe_stall``; ``metasd.core.batching.probes.probe``'s ``stall``).

Every running request waits for a scheduler step, so a probe is a gap in each of their streams. Beside 16 rows on a
CPU a probe of 4 nodes a request padded the forward to 80 tokens - 2.7 s against 0.58 s for the plain step - and the
streams' 99th-percentile inter-token latency was that probe's. With a bound, a probe's padded forward costs at most
that many times the forward of the step it replaces; where the forward is flat in tokens (a GPU) probes are
unchanged, and the drafting price (what a probe re-measures) is not part of the bound - but the drafters' reads of the
tokens their rows committed in plain steps are (``stall_cost``). Off by default (a bound of 3
was measured and did not remove that tail: BENCHMARKS.md)."""
import pytest

from metasd.core.batching.adaptive import AdaptiveSpeculation
from metasd.core.batching.probes import probe, stall_cost
from metasd.core.pricing.acceptance_curve import AcceptanceCurve
from metasd.core.pricing.allocator import Allocation

from test_probe_budget import dear_level  # noqa: E402

ROWS = 16


def _steep(n):  # a CPU's forward: linear in its tokens (16 plain rows: 1 unit; 4 nodes a row: 5 units)
    return n / ROWS


def _flat(n):  # a launch-bound GPU forward: the same price for any token count
    return 1.0


def _good_curve():
    curve = AcceptanceCurve()
    for _ in range(20):
        curve.update([0, 1, 2, 3], 4, budget=4)  # every draft of 4 accepted whole
    return curve


def _plain(rows=ROWS):
    return Allocation([0] * rows, 0, 1.0, {0: 1.0}, [0] * rows, float(rows))


def _probe(forward, least=4, stall=3.0, **kw):
    return probe(_plain(), [_good_curve()] * ROWS, [16] * ROWS, forward, None, 48, least=least, stall=stall, **kw)


def test_a_probe_whose_forward_would_stall_the_batch_is_not_made():
    assert _probe(_steep, stall=None).probe and probe(_plain(), [_good_curve()] * ROWS, [16] * ROWS, _steep, None, 48,
                                                     least=4).probe  # no bound by default
    flat = _probe(_flat)
    assert flat.probe and min(flat.nodes) >= 4  # flat forward: a probe as before
    steep = _probe(_steep)
    assert not steep.probe and steep.nodes == [0] * ROWS  # 80 tokens against 16: 5x the plain forward
    unbounded = _probe(_steep, stall=None)
    assert unbounded.probe and min(unbounded.nodes) >= 4  # what the bound removes


def test_a_probe_drafts_only_widths_whose_forward_fits_the_bound():
    narrow = _probe(_steep, least=0)  # 16 x (1 + 2) tokens = 3 units: the widest within 3x the plain forward
    assert narrow.probe and max(narrow.nodes) == 2
    assert not _probe(_steep, least=4).probe  # the narrowest budget arm's 4 nodes do not fit: no probe at all
    wider = _probe(_steep, least=4, stall=5.0)
    assert wider.probe and max(wider.nodes) == 4


def _level(forward, **kw):
    """An adaptive whose allocator keeps ``ROWS`` requests plain (drafting learnt dear: 50 units a step) and a step
    function recording each allocation."""
    adaptive = AdaptiveSpeculation(forward, max_width=48, price_drafting=True, **kw)
    arm, reqs = dear_level(adaptive, ROWS)
    adaptive.probe_budget.balance[4] = 1e9  # load_level(16): its probes may lose anything, only the stall bounds them

    def step():
        alloc = adaptive.allocate([arm] * ROWS, reqs)
        adaptive.record(alloc, alloc.nodes, ROWS * (1 + max(alloc.nodes)))
        return alloc

    return step


@pytest.mark.parametrize("forward, stall, widest", [(_flat, 3.0, 8), (_steep, 3.0, 2), (_steep, 5.0, 4),
                                                   (_steep, None, 8)])
def test_a_level_probes_wider_only_while_its_forward_stays_within_the_bound(forward, stall, widest):
    step = _level(forward, probe_stall=stall)  # serving.probe_stall; null (the default): no bound
    allocs = [step() for _ in range(40)]
    assert all(max(a.nodes) == 0 for a in allocs if not a.probe)  # drafting learnt dear: the allocation is plain
    probed = [max(a.nodes) for a in allocs if a.probe]
    # each probe twice the widest before it (1, 2, 4, 8: ProbeBudget.most); on the steep forward 4 nodes a row would
    # cost 5 plain forwards, so its probes stop at 2 (3x; at 4 with a bound of 5, at 8 with none) - the dear drafting
    # price holds back no level's
    assert probed[:2] == [1, 2] and max(probed) == widest


def test_a_width_no_level_has_run_is_probed_once_then_bounded_by_its_measured_price():
    # 16 rows have run plain forwards only (16 tokens, 1 unit): a probe prices what no level ran as the widest forward
    # run (``ForwardRatios.hopeful``), so its first wide probe is made - and measured; the next is bounded by that
    adaptive = AdaptiveSpeculation(_steep, max_width=48, price_drafting=True, unit_seconds=1.0)
    adaptive.record(_plain(), [0] * ROWS, ROWS, forward_s=_steep(ROWS))

    def probed():
        return probe(_plain(), [_good_curve()] * ROWS, [16] * ROWS, adaptive.forward_cost(ROWS), None, 48, least=4,
                     hopeful=adaptive.forward_cost(ROWS, hopeful=True), stall=3.0)

    first = probed()
    assert first.probe and max(first.nodes) == 16
    tokens = ROWS * (1 + max(first.nodes))
    adaptive.record(first, first.nodes, tokens, forward_s=_steep(tokens))  # 17 units: measured now
    again = probed()
    assert not again.probe and again.nodes == [0] * ROWS  # 4 nodes a row: 5 units, through the measured points


def test_the_stall_counts_the_reads_of_the_rows_that_draft_with_their_model():
    reads = [1.0] * ROWS  # each row's drafters have 1 unit of committed tokens to read
    assert stall_cost([0] * ROWS, [0] * ROWS, _flat, reads) == 1.0  # a plain step reads nothing
    assert stall_cost([4] * ROWS, [0] * ROWS, _flat, reads) == 1.0 + ROWS
    assert stall_cost([4] * 4 + [0] * 12, [0] * ROWS, _flat, reads) == 1.0 + 4  # only the rows that draft
    assert stall_cost([4] * ROWS, [1] * ROWS, _flat, reads) == 1.0  # on their lookups alone: the model reads nothing
    assert stall_cost([4] * ROWS, [0] * ROWS, _steep) == 5.0  # no reads given: the padded forward alone


def test_a_probe_whose_rows_would_first_read_their_backlog_is_bounded_by_those_reads():
    assert _probe(_flat, reads=[0.1] * ROWS).probe  # 1 + 1.6 units: within 3x the plain step's 1
    assert not _probe(_flat, reads=[0.25] * ROWS).probe  # 1 + 4 units: 5x
    few = _probe(_flat, reads=[0.5] * 4 + [0.0] * 12)  # four rows behind their drafters: 1 + 2 units
    assert few.probe and min(few.nodes) >= 4


def test_a_level_whose_rows_fall_behind_in_plain_steps_stops_probing_once_reading_them_would_stall_it():
    def probes_made(rate):
        adaptive = AdaptiveSpeculation(_flat, max_width=48, price_drafting=True, probe_stall=3.0)
        arm, reqs = dear_level(adaptive, ROWS)  # drafting learnt dear: the allocation stays plain
        adaptive.probe_budget.balance[4] = 1e9  # load_level(16): only the stall bounds its probes
        adaptive.catch_up_rates["cascade"] = rate  # what a drafter pays per token it reads
        made = []
        for _ in range(40):
            alloc = adaptive.allocate([arm] * ROWS, reqs)
            adaptive.record(alloc, alloc.nodes, ROWS * (1 + max(alloc.nodes)))
            for r, d in zip(reqs, alloc.nodes):
                r.length += 1  # every row commits a token; a row that drafted has its drafters fed (``finish``)
                if d > 0:
                    adaptive._fed[r] = r.length
            made.append(alloc.probe)
        return sum(made)
    # a flat forward: probes after 2, 4, 8, 16 steps at one width. Rows behind by 2 and 4 tokens (16 x 0.03 x 4 =
    # 1.9 units) fit within 3x a plain step; behind by 8 or more they do not - where no read is priced, all are made
    assert probes_made(0.0) == 4 and probes_made(0.03) == 2


def test_one_request_with_none_joining_probes_past_the_bound_that_protects_other_streams():
    # the bound is for the requests that wait for the step; alone, the request's own gap is its own choice, priced by
    # the allocator. On a CPU without AVX-512 a 4-node probe of one request cost ~3x a plain step, so a bound of 2
    # allowed one probe of the one-request level and no other: it decoded plain where tree 8 gained 1.19x
    # (BENCHMARKS.md, "Off its tuning plan again")
    def probed(joining):
        adaptive = AdaptiveSpeculation(lambda n: float(n), max_width=48, price_drafting=True, probe_stall=2.0)
        arm, reqs = dear_level(adaptive, 1)  # drafting learnt dear: the allocation stays plain
        adaptive.probe_budget.balance[0] = 1e9  # load_level(1): only the stall bounds its probes
        widths = []
        for _ in range(40):
            alloc = adaptive.allocate([arm], reqs, joining)
            adaptive.record(alloc, alloc.nodes, 1 + max(alloc.nodes))
            widths += [max(alloc.nodes)] if alloc.probe else []
        return widths
    alone, joined = probed(joining=0), probed(joining=1)
    assert max(alone) >= 4  # 4 nodes: a forward of 5 tokens, 5x the plain one - made: no other stream waits
    assert joined and max(joined) == 1  # a request joining waits for the step: 2 tokens (2x) fit, 3 do not
