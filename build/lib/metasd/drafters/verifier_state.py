"""What drafters that run on the verifier's own states share: built from a trained checkpoint directory
(whose ``config.json`` ``defaults`` are the drafting parameters a pool entry's ``params`` override) and
from the verifier's embeddings and LM head, so a pool entry gives a ``checkpoint`` and no ``model``."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, ClassVar

from torch import nn

from metasd.core.decoding.drafter import Drafter
from metasd.models.packed_weights import load_weights


class VerifierStateDrafter(Drafter):
    """Base of the TreeFlash and hidden-state drafters: ``from_checkpoint`` / ``from_config`` once.

    A subclass sets ``load_checkpoint`` (path -> (network, draft vocabulary, config.json contents)), takes
    ``(network, verifier_model, vocab, ..., name=, checkpoint=)`` in its constructor and quantizes its own
    layers in ``quantize``."""

    verifier_weights = True  # reads the verifier's torch model
    model_field, checkpoint_field = "never", "required"
    load_checkpoint: ClassVar[Callable[[str | Path], tuple[Any, Any, dict]]]

    @classmethod
    def from_checkpoint(cls, path: str | Path, verifier_model, **params) -> "VerifierStateDrafter":
        """The drafter of a checkpoint directory over ``verifier_model``; ``params`` override its defaults."""
        network, vocab, meta = cls.load_checkpoint(path)
        return cls(network, verifier_model, vocab, checkpoint=str(path), **{**meta.get("defaults", {}), **params})

    @classmethod
    def from_config(cls, name: str, params: dict[str, Any], build) -> "VerifierStateDrafter":
        drafter = cls.from_checkpoint(build.checkpoint, build.verifier.model, name=name, **params)
        drafter.quantize(build.quantize)
        return drafter

    def quantize(self, mode: str) -> None:
        """Weight-only quantization (``metasd.models.quantize``) of the drafter's own layers."""
        raise NotImplementedError


def read_checkpoint_config(path: str | Path, config_file: str, fmt: str, what: str) -> dict:
    """``path/config_file`` of a checkpoint directory, checked to be of format ``fmt`` (``what``: for errors)."""
    cfg_path = Path(path) / config_file
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{path} is not a {what} checkpoint: {config_file} is missing")
    meta = json.loads(cfg_path.read_text())
    if meta.get("format") != fmt:
        raise ValueError(f"{cfg_path}: format is {meta.get('format')!r}, expected {fmt!r}")
    return meta


def load_network_weights(net: nn.Module, weights_path: str | Path) -> None:
    """Load a checkpoint's weights (plain or packed, see ``metasd.models.packed_weights``) into ``net`` as fp32,
    refusing a file whose tensors do not match the network the config describes."""
    state = load_weights(weights_path)
    missing, unexpected = net.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    if missing or unexpected:
        raise ValueError(f"{weights_path}: weights do not match the config (missing {missing}, unexpected {unexpected})")


def check_verifier_fit(where: str, cfg, verifier_model, vocab) -> int:
    """Refuse a network trained for another verifier (``cfg.verifier_hidden_size`` / ``verifier_vocab_size``)
    or a draft vocabulary the verifier does not embed; returns the verifier's number of layers."""
    vcfg = verifier_model.config.get_text_config() if hasattr(verifier_model.config, "get_text_config") else verifier_model.config
    n_layers, width = int(vcfg.num_hidden_layers), int(vcfg.hidden_size)
    if width != cfg.verifier_hidden_size:
        raise ValueError(f"{where} was trained for a verifier of width {cfg.verifier_hidden_size}; this verifier has {width}")
    vocab_size = verifier_model.get_input_embeddings().weight.shape[0]
    if vocab.full_size != cfg.verifier_vocab_size or vocab_size < vocab.full_size:
        raise ValueError(f"{where} has a draft vocabulary over {vocab.full_size} tokens (trained for "
                         f"{cfg.verifier_vocab_size}); this verifier embeds {vocab_size}")
    return n_layers
