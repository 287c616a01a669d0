"""Checkpoint weights packed as 4-bit groups (metasd.models.packed_weights): the round trip's error bound and shapes,
what stays unpacked, and packed drafter checkpoints that load through a pool and keep greedy identity."""
import json

import pytest
import torch
from safetensors.torch import save_file

from metasd.cli import main
from metasd.config import load_pool
from metasd.models.packed_weights import (INT4_SUFFIX, SCALES_SUFFIX, group_for, is_packed, load_weights, pack_checkpoint,
                                   pack_file, pack_int4, unpack_int4)
from test_conformance import ENTRIES, PROMPT, _pool, root  # noqa: F401  (root: the tiny models' fixture)
from tiny import plain_greedy, tiny_tokenizer


def test_round_trip_keeps_shapes_and_bounds_the_error():
    torch.manual_seed(0)
    tensors = {"matrix": torch.randn(64, 96), "heads": torch.randn(3, 40, 64), "norm": torch.randn(96),
               "ids": torch.arange(10), "small": torch.randn(4, 32)}
    packed = pack_int4(tensors, group_size=32, min_numel=256)
    assert {"matrix" + INT4_SUFFIX, "heads" + INT4_SUFFIX} <= set(packed)
    assert torch.equal(packed["norm"], tensors["norm"]) and torch.equal(packed["ids"], tensors["ids"])
    assert torch.equal(packed["small"], tensors["small"])  # under min_numel: stored as it was
    out = unpack_int4(packed)
    assert set(out) == set(tensors)
    for name in ("matrix", "heads"):
        w, back = tensors[name], out[name]
        assert back.shape == w.shape
        groups = w.reshape(-1, w.shape[-1] // 32, 32)
        step = (groups.amax(-1) - groups.amin(-1)) / 15  # one quantization step per group
        err = (back - w).abs().reshape(groups.shape)
        # half a step from rounding, plus the bf16 rounding of the stored scale and zero
        assert bool((err <= 0.5 * step[..., None] + 0.02 * groups.abs().amax(-1, keepdim=True)).all()), name
        assert not torch.equal(back, w)  # it is a lossy format: the test above compares something


def test_group_halves_until_it_divides_the_input():
    assert group_for(torch.zeros(8, 96), 128, min_numel=0) == 32
    assert group_for(torch.zeros(8, 256), 128, min_numel=0) == 128
    assert group_for(torch.zeros(8, 24), 128, min_numel=0) is None  # no group of >= 16 divides 24
    packed = pack_int4({"w": torch.randn(16, 96)}, 128, min_numel=0)
    assert packed["w" + SCALES_SUFFIX].shape == (3, 16, 2)  # three groups of 32


def test_pack_file_shrinks_keeps_metadata_and_refuses_twice(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"w": torch.randn(256, 256).to(torch.bfloat16), "b": torch.randn(256)}, str(path), metadata={"format": "x/1"})
    before, after = pack_file(path)
    assert after < 0.35 * before and is_packed(path)
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        assert f.metadata()["format"] == "x/1"
    assert load_weights(path)["w"].shape == (256, 256)
    with pytest.raises(ValueError, match="already packed"):
        pack_file(path)


def test_cli_packs_a_folder_and_names_a_folder_without_weights(tmp_path, capsys):
    (tmp_path / "ckpt").mkdir()
    save_file({"w": torch.randn(256, 512)}, str(tmp_path / "ckpt" / "model.safetensors"))
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({"weights_dtype": "float32"}))
    assert main(["pack-weights", str(tmp_path / "ckpt")]) == 0
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["weights_dtype"] == "int4"
    (tmp_path / "empty").mkdir()
    assert main(["pack-weights", str(tmp_path / "empty")]) == 2
    assert "no weights" in capsys.readouterr().err
    (tmp_path / "odd").mkdir()  # a group size that packs nothing must not mark the file packed
    save_file({"w": torch.randn(256, 40)}, str(tmp_path / "odd" / "model.safetensors"))
    for group in ("0", "-1", "7", "48"):
        assert main(["pack-weights", str(tmp_path / "odd"), "--group-size", group]) == 2
        assert "--group-size must be a power of two >= 16" in capsys.readouterr().err
    assert main(["pack-weights", str(tmp_path / "odd"), "--group-size", "32"]) == 2  # 40 columns: no group divides
    assert "no tensor can be packed" in capsys.readouterr().err
    assert not is_packed(tmp_path / "odd" / "model.safetensors")


@pytest.mark.parametrize("kind", ["block", "hidden_state", "treeflash", "steered"])
def test_packed_checkpoint_drafts_and_keeps_greedy_identity(root, kind):  # noqa: F811
    entry = ENTRIES[kind](root)  # the checkpoint types all have one
    folder = root / entry["checkpoint"]
    folder = folder if folder.is_dir() else folder.parent
    plain = load_pool(_pool(root, kind, entry, name="unpacked")).drafter(kind)
    plain_state = {k: v.clone() for m in plain.modules() for k, v in m.state_dict().items()}
    if not is_packed(next(p for p in folder.glob("*.safetensors") if "vocab" not in p.name)):
        pack_checkpoint(folder, group_size=16, min_numel=0)
    engine = load_pool(_pool(root, kind, entry, name="packed"))
    engine.tokenizer = tiny_tokenizer()
    packed_state = {k: v for m in engine.drafter(kind).modules() for k, v in m.state_dict().items()}
    changed = [k for k, v in packed_state.items() if v.is_floating_point() and not torch.equal(v, plain_state[k])]
    assert changed, f"{kind}: the packed checkpoint loaded the same weights: nothing was packed"
    for n in (9, 30):
        result = engine.generate(PROMPT, max_new_tokens=n)
        assert result.token_ids == plain_greedy(engine.verifier.model, PROMPT, n), f"{kind}: differs at {n}"
    assert result.stats.drafted > 0


def test_packing_a_folder_reads_each_file_once_and_checks_from_the_headers(tmp_path, monkeypatch):
    """The check that some tensor of each file can be packed reads the files' headers (shapes and dtypes): each file's
    weights are read once, to pack them (they were read twice, a checkpoint's size in memory each time)."""
    import metasd.models.packed_weights as packed_weights

    reads, load = [], packed_weights.load_file
    monkeypatch.setattr(packed_weights, "load_file", lambda path, *a: reads.append(path) or load(path, *a))
    for name in ("a", "b"):
        save_file({"w": torch.randn(64, 64).to(torch.bfloat16), "ids": torch.arange(8)},
                  str(tmp_path / f"{name}.safetensors"))
    pack_checkpoint(tmp_path, group_size=32, min_numel=256)
    assert sorted(reads) == [str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")]
    assert is_packed(tmp_path / "a.safetensors") and is_packed(tmp_path / "b.safetensors")
