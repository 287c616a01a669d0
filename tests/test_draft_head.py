"""The draft head (``head_vocab``): a drafter's LM head restricted to the first N ids plus EOS."""
import pytest
import torch

from metasd.drafters import PretrainedDrafter, PretrainedTreeDrafter
from metasd.drafters.pretrained import DraftHead
from metasd.core.engine import Engine
from metasd.models.quantize import quantize_model
from metasd.core.execution.verifier import Verifier
from tiny import VOCAB, plain_greedy, tiny_qwen

PROMPT = [0, 7, 12, 9, 33, 12, 9, 41, 5]
BIG = 208  # a vocabulary well above the draft heads' sizes (a multiple of 16 for int4)


def test_draft_head_logits_are_the_full_heads_on_its_rows_and_minus_inf_elsewhere():
    model = tiny_qwen(seed=1, vocab=BIG)
    head = DraftHead(model.lm_head, 20, extra=[150, 5])
    h = torch.randn(3, 32)  # [rows, d]
    full, reduced = model.lm_head(h), head(h)  # [3, V]
    assert head.token_ids.tolist() == list(range(31)) + [150]  # 20 + EOS, padded with ids 20.. to 32 rows
    ids = head.token_ids
    assert torch.allclose(reduced[:, ids], full[:, ids], atol=1e-6)
    off = torch.ones(BIG, dtype=torch.bool)
    off[ids] = False
    assert torch.isinf(reduced[:, off]).all() and (reduced[:, off] < 0).all()


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_draft_head_of_a_quantized_head_is_quantized_the_same_way(mode):
    model = tiny_qwen(seed=1, vocab=BIG)
    quantize_model(model, mode, name="tiny")
    head = DraftHead(model.lm_head, 20, extra=[207])  # 21 ids: padded to 32 rows, as the int4 kernel needs
    assert getattr(head.head, "mode", None) == mode and len(head.token_ids) == 32 and 207 in head.token_ids
    h = torch.randn(2, 32)
    assert torch.allclose(head(h)[:, :20], model.lm_head(h)[:, :20], atol=1e-2)


@pytest.mark.parametrize("n", [1, VOCAB, VOCAB + 5])
def test_head_vocab_out_of_range_names_the_drafter_and_the_vocabulary(n):
    # below 2: refused by the parameter model, as in a pool file; at or past the vocabulary: by the loaded model
    message = "arm: parameter 'head_vocab' must be >= 2" if n < 2 else rf"arm: head_vocab must be in \[2, {VOCAB}\)"
    with pytest.raises(ValueError, match=message):
        PretrainedDrafter(tiny_qwen(seed=1), head_vocab=n, name="arm")


@pytest.mark.parametrize("make", [
    lambda m: PretrainedDrafter(m, k=4, head_vocab=30),
    lambda m: PretrainedTreeDrafter(m, mode="dynamic", nodes=8, depth=4, width=3, head_vocab=30),
], ids=["chain", "tree"])
def test_drafts_come_from_the_draft_vocabulary_and_output_is_the_verifiers(make):
    verifier = tiny_qwen(seed=0, vocab=BIG, logit_scale=4.0)
    drafter = make(tiny_qwen(seed=0, vocab=BIG, logit_scale=2.0))  # the verifier's weights, softer: often accepted
    drafted: list[int] = []
    propose = drafter.propose

    def recording(ctx):
        draft = propose(ctx)
        drafted.extend(draft.tokens.tolist())
        return draft

    drafter.propose = recording
    result = Engine(Verifier(verifier), drafter, check_tokenizers=False).generate(PROMPT, max_new_tokens=40)
    assert result.token_ids == plain_greedy(verifier, PROMPT, 40)
    assert drafted and max(drafted) < 32  # the first 30 ids padded to 32 rows
    assert max(result.token_ids) >= 32  # the verifier did need tokens the drafter could not propose
    assert result.stats.accepted > 0
