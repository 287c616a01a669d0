"""The trainers on the second device (``second_device.py``): ``metasd train features|steering|block|treeflash|
hidden_state`` with ``--device`` set to it. A short run of each (the tiny setups of the trainers' own tests) keeps
every network, verifier piece, optimizer state and batch there (an op mixing a device tensor with a CPU one fails,
as on CUDA) and writes what the same run on the CPU writes, to float rounding (the device computes on CPU storage;
only attention takes another path). A state saved on one device resumes on the other."""
from __future__ import annotations

import argparse
import copy
import json

import pytest
import torch
import yaml
from safetensors.torch import load_file

from second_device import enable, on_device as on_dev
from tiny import tiny_qwen, tiny_tokenizer

pytestmark = pytest.mark.second_device

DEV: torch.device = None  # set by _enable: not at import, so collecting this file leaves torch as it is
ATOL, RTOL = 2e-5, 1e-4  # fp32 weights after a few AdamW steps: the CPU's and the device's agree to rounding
QUIET = dict(log=lambda *a: None)


@pytest.fixture(autouse=True, scope="module")
def _enable():
    global DEV
    DEV = enable()



def assert_close_files(a, b, exact=()):
    """Two safetensors files hold the same keys, dtypes and (to rounding) values; ``exact`` keys bit for bit."""
    ta, tb = load_file(str(a)), load_file(str(b))
    assert ta.keys() == tb.keys()
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and ta[k].shape == tb[k].shape, k
        if k in exact or not ta[k].is_floating_point():
            assert torch.equal(ta[k], tb[k]), k
        else:
            torch.testing.assert_close(tb[k].float(), ta[k].float(), atol=ATOL, rtol=RTOL, msg=k)


def assert_close_metrics(a: dict, b: dict, atol=1e-4):
    assert a.keys() == b.keys()
    for k, v in a.items():
        if isinstance(v, float):
            assert b[k] == pytest.approx(v, abs=atol, rel=1e-4), k
        elif not isinstance(v, (dict, list)):
            assert b[k] == v, k


@torch.no_grad()
def _examples(model, n=16, prompt_len=6, new=24):
    from metasd.training.data import Example

    g = torch.Generator().manual_seed(0)
    ids = torch.cat([torch.zeros(n, 1, dtype=torch.long), torch.randint(6, 64, (n, prompt_len - 1), generator=g)], 1)
    for _ in range(new):
        ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return [Example(s.tolist(), [False] * prompt_len + [True] * new) for s in ids]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A 4-layer tiny verifier saved as a model directory, a 2-layer drafter, and a CPU feature set (4 shards)."""
    from metasd.training.features import extract_features

    path = tmp_path_factory.mktemp("train_dev")
    verifier = tiny_qwen(seed=0, layers=4, logit_scale=4.0)
    for name, model in (("verifier", verifier), ("drafter", tiny_qwen(seed=1, layers=2))):
        model.save_pretrained(path / name)
        tiny_tokenizer().save_pretrained(path / name)
    extract_features(verifier, _examples(verifier), path / "feat", layers=[1, 2, 3, 4], topk=8, shard_size=4, **QUIET)
    return path


def _main(*argv) -> None:
    from metasd.cli import main

    assert main([str(a) for a in argv]) == 0


def _yaml(path, cfg: dict):
    path.write_text(yaml.safe_dump(cfg))
    return path


# ------------------------------------------------------------------------------------------------ features

def test_features_command_runs_the_verifier_on_the_device(root, tmp_path, monkeypatch):
    """``metasd train features --device``: the verifier runs there, the shards hold host tensors, and they are
    the CPU run's (ids and top-k ids exactly; bf16 states and log-probabilities to rounding)."""
    import metasd.models
    from metasd.training.features import FeatureSet

    # the verifier is loaded as the command loads it (onto --device), but with the in-memory tiny tokenizer: the
    # word-level one saved beside the model encodes our words as unknowns once reloaded, leaving no response tokens
    load, placed = metasd.models.load_model, []

    def load_model(*a, **kw):
        model = load(*a, **kw)[0]
        placed.append(model.device)
        return model, tiny_tokenizer()

    monkeypatch.setattr(metasd.models, "load_model", load_model)

    words = lambda a, n: " ".join(f"w{10 + (a + 7 * j) % 50}" for j in range(n))  # noqa: E731
    convs = [{"conversations": [{"from": "human", "value": words(i, 5)}, {"from": "gpt", "value": words(3 * i, 20)}]}
             for i in range(5)]
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text(json.dumps(convs))
    sets = {}
    for name, device in (("cpu", "cpu"), ("dev", DEV)):
        _main("train", "features", tmp_path / name, "--verifier", root / "verifier", "--device", device, "--dtype", "fp32",
              "--sharegpt", sharegpt, "--exclude", "none", "--sequences", 5, "--layers", "1,4", "--topk", 4,
              "--shard-size", 2)
        sets[name] = FeatureSet(tmp_path / name)
    assert placed == [torch.device("cpu"), DEV]
    cpu, dev = sets["cpu"], sets["dev"]
    assert len(cpu.shards) == len(dev.shards) == 3 and cpu.manifest == dev.manifest
    for i in range(3):
        a, b = cpu.load_shard(i), dev.load_shard(i)
        assert a.keys() == b.keys()
        for k in a:
            assert b[k].device.type == "cpu" and b[k].dtype == a[k].dtype and b[k].shape == a[k].shape, k
            if a[k].is_floating_point():
                torch.testing.assert_close(b[k].float(), a[k].float(), atol=2e-2 if k.startswith("hidden") else 1e-5,
                                           rtol=1e-2, msg=k)
            else:
                assert torch.equal(a[k], b[k]), k


# ------------------------------------------------------------------------------------------------ steering

def _steering_config(root, out, device, **train):
    from metasd.training.steering import parse_config

    return parse_config({
        "drafter": str(root / "drafter"), "out_dir": str(out),
        "data": {"features": str(root / "feat"), "train_shards": [0, 1, 2], "val_shards": [3], "val_sequences": 4},
        "steering": {"guide_layers": [1, 2, 3], "guide_norm": "standardize", "rank": 4, "layers": 1},
        "finetune": 1,  # the last drafter layer trained too: drafter parameters in the optimizer
        "train": {"steps": 2, "batch_size": 2, "lr": 1e-2, "drafter_lr": 1e-3, "k": 3, "dtype": "fp32",
                  "device": str(device), **train},
        "log": {"mlflow": False, "val_every": 1, "log_every": 1, "checkpoint_every": 1},
    })


def test_steering_trainer_on_the_device(root, tmp_path):
    from metasd.training.steering import train_steering

    drafter = tiny_qwen(seed=1, layers=2)
    cpu = train_steering(_steering_config(root, tmp_path / "cpu", "cpu"), model=copy.deepcopy(drafter), **QUIET)
    dev = train_steering(_steering_config(root, tmp_path / "dev", DEV), model=copy.deepcopy(drafter), **QUIET)
    assert dev.device == DEV and dev.step == 2
    assert all(on_dev(p) for p in dev.model.parameters()) and all(on_dev(t) for t in dev.module.state_dict().values())
    moments = [s["exp_avg"] for s in dev.opt.state.values()]
    assert moments and all(on_dev(m) for m in moments)
    a, b = cpu.trainable_state(), dev.trainable_state()
    assert a.keys() == b.keys() and any(k.startswith("drafter.") for k in a)
    for k in a:
        torch.testing.assert_close(b[k].cpu(), a[k], atol=ATOL, rtol=RTOL, msg=k)
    assert len(cpu.history) == len(dev.history) == 3  # before training, after each step
    for h_cpu, h_dev in zip(cpu.history, dev.history):
        assert_close_metrics({k: v for k, v in h_cpu.items() if k != "wall_s"}, {k: v for k, v in h_dev.items() if k != "wall_s"})
    assert_close_files(tmp_path / "cpu" / "steering.safetensors", tmp_path / "dev" / "steering.safetensors")


def test_steering_command_line_sets_the_device(root, tmp_path, monkeypatch):
    from metasd.training import steering_cli

    seen = {}
    monkeypatch.setattr(steering_cli, "train_steering", lambda cfg, fresh=False: seen.setdefault("cfg", cfg))
    path = _yaml(tmp_path / "steer.yaml", _steering_config(root, tmp_path / "x", "cpu").model_dump())
    parser = argparse.ArgumentParser()
    steering_cli.add_train_steering_parser(parser.add_subparsers())
    args = parser.parse_args(["steering", str(path), "--device", str(DEV)])
    assert args.func(args) == 0 and seen["cfg"].train.device == str(DEV)


# ------------------------------------------------------------------------------------------------ block

def test_block_trainer_on_the_device(root, tmp_path, capsys):
    base = dict(features=str(root / "feat"), verifier=str(root / "verifier"), k=3, vocab_size=16, steps=3,
                batch_size=32, lr=2e-2, warmup=1, bf16=False, log_every=1, eval_every=1, save_every=2, mlflow=False,
                val_shards="3", threads=1)
    for name, device in (("cpu", "cpu"), ("dev", DEV)):
        _main("train", "block", _yaml(tmp_path / f"{name}.yaml", {**base, "out": str(tmp_path / name)}), "--device", device)
    out = capsys.readouterr().out
    assert "training on cpu, fp32" in out and f"training on {DEV}, fp32" in out
    assert_close_files(tmp_path / "cpu" / "heads.safetensors", tmp_path / "dev" / "heads.safetensors")
    mc, md = (json.loads((tmp_path / n / "metrics.json").read_text()) for n in ("cpu", "dev"))
    assert_close_metrics({k: v for k, v in mc.items() if k != "wall_s"}, {k: v for k, v in md.items() if k != "wall_s"})
    # the state is written from host copies: it loads on a machine without the device, no map_location needed
    meta = json.loads((tmp_path / "dev" / "train_state" / "trainer.json").read_text())
    opt = torch.load(tmp_path / "dev" / "train_state" / meta["files"]["optimizer"], weights_only=True)
    assert all(t.device.type == "cpu" for s in opt["state"].values() for t in s.values())


# ------------------------------------------------------------------------------------------------ TreeFlash

def _treeflash_yaml(root, path, out):
    return _yaml(path, {
        "features": str(root / "feat"), "verifier": str(root / "verifier"), "out": str(out), "train_shards": "0-2",
        "val_shards": "3", "vocab_size": 48, "target": "soft",
        "model": {"hidden_size": 16, "num_layers": 1, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 32,
                  "ar_intermediate_size": 16, "block_size": 5, "context_window": 16, "output_norm": "own",
                  "context_layers": [1, 2], "output_skip_layer": 2},
        "stage1": {"steps": 2, "lr": 5e-3, "warmup": 1, "sequences_per_step": 2, "anchors_per_sequence": 4},
        "stage2": {"steps": 1, "lr": 5e-3, "warmup": 1, "sequences_per_step": 2, "anchors_per_sequence": 4},
        "defaults": {"mode": "treeflash", "m": 3, "k": 3, "tree_size": 12}, "log_every": 1, "eval_every": 1,
        "save_every": 1, "val_anchors": 12, "val_tree_anchors": 3, "bf16": False, "mlflow": False, "threads": 1,
        "save_dtype": "fp32"})


def test_treeflash_trainer_on_the_device(root, tmp_path, capsys):
    for name, device in (("cpu", "cpu"), ("dev", DEV)):
        _main("train", "treeflash", _treeflash_yaml(root, tmp_path / f"{name}.yaml", tmp_path / name), "--device", device)
    out = capsys.readouterr().out
    assert "training on cpu, fp32" in out and f"training on {DEV}, fp32" in out
    assert_close_files(tmp_path / "cpu" / "model.safetensors", tmp_path / "dev" / "model.safetensors")
    mc, md = (json.loads((tmp_path / n / "metrics.json").read_text()) for n in ("cpu", "dev"))
    assert "tau_treeflash_tf" in mc  # the final validation drafted trees (draft_from_block on the device)
    assert_close_metrics(mc, md)


# ------------------------------------------------------------------------------------------------ hidden state

def _hidden_state_yaml(root, path, out, **over):
    return _yaml(path, {
        "features": str(root / "feat"), "verifier": str(root / "verifier"), "out": str(out), "train_shards": "0-2",
        "val_shards": "3", "vocab_size": 48, "max_len": 24, "unroll": 2,
        "model": {"num_heads": 4, "num_kv_heads": 2, "intermediate_size": 32, "inject_intermediate_size": 16},
        "optim": {"steps": 2, "lr": 3e-3, "warmup": 1, "sequences_per_step": 2}, "defaults": {"mode": "chain", "depth": 3},
        "log_every": 1, "eval_every": 1, "save_every": 1, "val_sequences": 4, "bf16": False, "mlflow": False,
        "threads": 1, "save_dtype": "fp32", **over})


def test_hidden_state_trainer_on_the_device(root, tmp_path, capsys):
    """On the device with bf16: true: the device has no bf16 autocast, so it computes in fp32, as the CPU does with
    bf16: false (the CPU's own bf16 autocast is unchanged: the trainers' tests and saved files cover it)."""
    _main("train", "hidden_state", _hidden_state_yaml(root, tmp_path / "cpu.yaml", tmp_path / "cpu"), "--device", "cpu")
    _main("train", "hidden_state", _hidden_state_yaml(root, tmp_path / "dev.yaml", tmp_path / "dev", bf16=True),
          "--device", DEV)
    out = capsys.readouterr().out
    assert "training on cpu, fp32" in out and f"training on {DEV}, fp32 (no bf16 autocast there)" in out
    assert_close_files(tmp_path / "cpu" / "model.safetensors", tmp_path / "dev" / "model.safetensors")
    mc, md = (json.loads((tmp_path / n / "metrics.json").read_text()) for n in ("cpu", "dev"))
    assert_close_metrics(mc, md)


@pytest.mark.parametrize("first, then", [("cpu", "dev"), ("dev", "cpu")])
def test_a_state_saved_on_one_device_resumes_on_the_other(root, tmp_path, first, then):
    from metasd.training.hidden_state import load_train_hidden_state_config, train_hidden_state

    devices = {"cpu": "cpu", "dev": str(DEV)}
    straight = load_train_hidden_state_config(_hidden_state_yaml(root, tmp_path / "a.yaml", tmp_path / "straight"))
    train_hidden_state(straight, **QUIET)
    parts = straight.model_copy(update={"out": str(tmp_path / "parts"), "device": devices[first]})
    logs = []
    train_hidden_state(parts, until_step=1, log=logs.append)
    assert json.loads((tmp_path / "parts" / "train_state" / "trainer.json").read_text())["step"] == 1
    train_hidden_state(parts.model_copy(update={"device": devices[then]}), log=logs.append)
    assert [devices[first] in line for line in logs if "training on" in line] == [True, False]
    assert [devices[then] in line for line in logs if "training on" in line] == [False, True]
    assert_close_files(tmp_path / "straight" / "model.safetensors", tmp_path / "parts" / "model.safetensors")


# ------------------------------------------------------------------------------------------------ the helpers

def test_bf16_autocast_runs_where_the_device_computes_bf16(monkeypatch):
    from metasd.training import devices

    cpu = torch.device("cpu")
    ctx = devices.bf16_autocast(cpu, enabled=False)  # the CPU: torch's CPU autocast, as the trainers always had
    assert isinstance(ctx, torch.autocast) and ctx.device == "cpu" and not ctx._enabled
    assert devices.bf16_autocast(cpu)._enabled and devices.computes_bf16(cpu)
    assert not devices.computes_bf16(DEV) and not isinstance(devices.bf16_autocast(DEV), torch.autocast)
    assert devices.compute_dtype("auto", DEV) == torch.float32 and devices.compute_dtype("bf16", DEV) == torch.bfloat16
    for supported in (True, False):  # CUDA: bf16 autocast where the GPU computes bf16 natively (Ampere and newer)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True, s=supported: s)
        assert devices.computes_bf16(torch.device("cuda", 0)) is supported
        assert devices.compute_dtype("auto", torch.device("cuda")) == (torch.bfloat16 if supported else torch.float32)


def test_a_config_naming_an_unknown_device_is_refused_naming_the_field(root, tmp_path):
    from metasd.config import ConfigError
    from metasd.training.treeflash import load_train_treeflash_config

    path = _treeflash_yaml(root, tmp_path / "t.yaml", tmp_path / "out")
    assert load_train_treeflash_config(path).device == "auto"
    assert load_train_treeflash_config(path, str(DEV)).device == str(DEV)
    with pytest.raises(ConfigError, match="device"):
        load_train_treeflash_config(path, "nonsense")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            load_train_treeflash_config(path, "cuda")
