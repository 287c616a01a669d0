import torch

from metasd.core.execution.hooks import _canonical, contiguous_lm_head_input
from tiny import tiny_qwen


def test_canonical_fixes_stale_stride_of_size_one_dimension():
    h = torch.randn(1, 2, 8)
    view = h[:, -1:, :]
    assert view.is_contiguous() and view.stride() == (16, 8, 1)  # "contiguous", yet a stale batch stride
    fixed = _canonical(view)
    assert fixed.stride() == (8, 8, 1) and torch.equal(fixed, view)
    fresh = torch.randn(1, 1, 8)
    assert _canonical(fresh) is fresh  # no copy when strides are already canonical


def test_lm_head_receives_canonical_input_with_logits_to_keep():
    model = contiguous_lm_head_input(tiny_qwen(seed=0))
    contiguous_lm_head_input(model)  # idempotent: one hook only
    seen = []
    model.get_output_embeddings().register_forward_hook(lambda m, args, out: seen.append(args[0].stride()))
    with torch.no_grad():
        out = model(torch.tensor([[1, 2, 3]]), logits_to_keep=1)
        ref = tiny_qwen(seed=0)(torch.tensor([[1, 2, 3]])).logits[:, -1:]
    assert seen == [(32, 32, 1)]
    assert torch.allclose(out.logits, ref, atol=1e-6)
    assert len(model.get_output_embeddings()._forward_pre_hooks) == 1
    from metasd.core.execution.hooks import remove_lm_head_hook
    remove_lm_head_hook(model)
    assert len(model.get_output_embeddings()._forward_pre_hooks) == 0


def test_draft_vocab_round_trip(tmp_path):
    from metasd.models.draft_vocab import DraftVocab

    counts = torch.tensor([5.0, 0.0, 9.0, 1.0, 7.0, 0.0])
    vocab = DraftVocab.from_counts(counts, 3, always=(5,))
    assert vocab.token_ids.tolist() == [5, 2, 4]
    assert vocab.to_full(torch.tensor([[0, 2]])).tolist() == [[5, 4]]
    assert vocab.to_reduced(torch.tensor([4, 0, 5])).tolist() == [2, -1, 0]
    w = torch.arange(12.0).reshape(6, 2)
    assert vocab.head_weight(w).tolist() == [[10, 11], [4, 5], [8, 9]]
    assert abs(vocab.coverage(counts) - 16 / 22) < 1e-9
    vocab.save(tmp_path / "v.safetensors")
    assert DraftVocab.load(tmp_path / "v.safetensors").token_ids.tolist() == [5, 2, 4]
