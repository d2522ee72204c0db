"""Configs: TOML files read with tomllib into frozen attrs classes, one class per section.

A config names the models, the storage of the target, the pipeline to compose and the sizes of
its channels. Section classes live beside what they configure (FlashConfig in the flash
backend, TreeExpandConfig in lever.tree.config, the policies' in lever.policy); `Config` has one typed
field per section, named as the [section], so adding a section is adding a field. Every key is
checked: an unknown or mistyped key or a bad value is one LeverError naming the file, section
and key. `--set section.key=value` overrides are parsed as TOML values and checked the same
way. Paths in a config ([model] target and draft, [profile] path, [predictor] artifact) are
resolved once here, against the config's folder, so nothing downstream resolves them again;
a model that names no file there may be one of $LEVER_MODELS by name, as `-m NAME` takes it.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

import attrs

from lever.backends.flash import FlashConfig
from lever.errors import LeverError, read_text
from lever.hub.catalogue import lookup
from lever.hub.pull import find_model
from lever.hub.store import models_dir
from lever.model.sampling import DRAWS, LIMITS, LogitBias, Range, SamplingParams
from lever.policy.memory import MemoryConfig
from lever.policy.placement import PlacementConfig, QnnConfig
from lever.policy.predictor import PredictorConfig
from lever.policy.profile import ProfileConfig
from lever.tree.config import TreeExpandConfig

# Generation's bounds, shared with lever.api and every command's flags (lever.cli.common): the
# sampling fields' from lever.model.sampling, the lengths here. A context past 2^20 rows is no
# model Lever runs (and its KV cache would not fit a phone); n_predict past 2^31 is no answer.
MAX_CTX = 1 << 20
CTX = Range(1, MAX_CTX, integer=True)
N_PREDICT = Range(0, 2**31 - 1, integer=True)
GENERATE_LIMITS = {"n_predict": N_PREDICT, **LIMITS}
MAX_THREADS = 1024  # more compute threads than any phone or workstation has cores: a typo
THREADS = Range(0, MAX_THREADS, integer=True)


def _check_limits(section: str, values, limits: dict[str, Range]) -> None:
    for name, limit in limits.items():
        problem = limit.problem(getattr(values, name))
        if problem is not None:
            raise LeverError(f"[{section}] {name}: {problem}")


@attrs.frozen
class ModelConfig:
    """The models of a pipeline."""

    target: str = ""  # GGUF of the target model (streamed from flash); relative to the config file
    draft: str = ""  # GGUF of the draft model (resident); empty for autoregressive pipelines
    n_ctx: int = 4096  # context length (KV cache rows), capped by the model's trained context
    chat_template: str = ""  # a Jinja2 chat template, for a target whose GGUF has none (or to replace its own)
    reasoning: str = "auto"  # the template's enable_thinking (llama-server's --reasoning): on, off, or auto (on
    # when the template has a thinking mode); a request's chat_template_kwargs may say otherwise

    def __attrs_post_init__(self):
        _check_limits("model", self, {"n_ctx": CTX})
        if self.reasoning not in ("on", "off", "auto"):
            raise LeverError(f"[model] reasoning: must be on, off or auto, got {self.reasoning!r}")


@attrs.frozen
class PipelineConfig:
    """Which composition of stages runs."""

    kind: str = "flash-ar"
    """flash-ar: autoregressive, target streamed from flash; resident-ar: the same with every
    layer in DRAM; speculative: a draft model proposes trees ([tree_expand] policy: gain-cost
    is Lever, chain is Chain-SD, kary a fixed tree) that the streamed target verifies."""
    baseline: str = ""
    """Another kind to run after it on the same prompt (usually flash-ar): the summary then
    gives the speedup over it, measured in the same run, and checks greedy tokens are equal."""
    parallel: int = 1
    """Generations at once (`lever serve --parallel`): each keeps its own caches of n_ctx rows,
    and their trees are verified in shared passes of the target, each streamed layer read once
    for all of them (lever.pipelines.batcher). The memory plan holds every one's caches."""

    def __attrs_post_init__(self):
        if not isinstance(self.parallel, int) or isinstance(self.parallel, bool) or not 1 <= self.parallel <= 256:
            raise LeverError(f"[pipeline] parallel: generations at once, 1 to 256, got {self.parallel!r}")
        for key, kind in (("kind", self.kind), ("baseline", self.baseline)):
            if kind not in PIPELINE_KINDS and (key == "kind" or kind):
                raise LeverError(f"[pipeline] {key}: unknown pipeline {kind!r} (known: {', '.join(PIPELINE_KINDS)})")


@attrs.frozen
class PipelineKind:
    """What a [pipeline] kind decides, in one place."""

    name: str
    all_resident: bool  # every target layer in DRAM, whatever [flash] dram_budget says
    speculates: bool  # trees grow ([tree_expand]) and one pass verifies each; else one token per pass


PIPELINE_KINDS = {k.name: k for k in (PipelineKind("flash-ar", all_resident=False, speculates=False),
                                      PipelineKind("resident-ar", all_resident=True, speculates=False),
                                      PipelineKind("speculative", all_resident=False, speculates=True))}


@attrs.frozen
class ChannelsConfig:
    """Capacities of the bounded channels between stages (small integers, never unbounded)."""

    # Prefetch -> PrunedVerify: streamed layers waiting to be computed; 0: as many as the staging
    # window holds ([flash] window_layers), so the window, not this channel, says how far reads run
    # ahead (a fixed 2 held a 12-layer window to 3 layers ahead of compute: drafting stalled the reads)
    layers: int = 0
    tokens: int = 1  # TreeExpand -> PrunedVerify and Accept -> TreeExpand: one cycle in flight

    def __attrs_post_init__(self):
        for f in attrs.fields(type(self)):
            v = getattr(self, f.name)
            if not (0 if f.name == "layers" else 1) <= v <= 64:
                lo = "0 (the window)" if f.name == "layers" else "1"
                raise LeverError(f"[channels] {f.name}: capacity must be between {lo} and 64, got {v}")

    def layers_for(self, window_layers: int) -> int:
        """The layers channel's capacity under a staging window of `window_layers` buffers."""
        return self.layers or window_layers


def _knob(default, help: str, *, arg: str = "", flag: str = "", call: Range | None = None):
    """A [generate] field that is a generation knob. `arg`: its name in a call (lever.api, the
    server; OpenAI's where it has one; default the key), `flag`: the commands' flag (default the
    key with dashes), `call`: a call's bounds where stricter than the config's."""
    return attrs.field(default=default, metadata={"knob": {"help": help, "arg": arg, "flag": flag, "call": call}})


@attrs.frozen
class GenerateConfig:
    """What to generate and how tokens are chosen. Every field but `prompt` is a knob: the API's
    and the server's arguments and the commands' flags are derived from these (KNOBS)."""

    n_predict: int = _knob(128, "tokens to generate at most", arg="max_tokens", flag="n",
                           call=Range(1, N_PREDICT.hi, integer=True))  # a call asks for a token at least
    temperature: float = _knob(0.0, "sampling temperature (0: greedy)", flag="temp")
    # the cuts llama.cpp's sampler chain makes by default, in its order: top-k, top-p, min-p, then temperature
    top_k: int = _knob(40, "keep the k likeliest tokens (0: off)")
    top_p: float = _knob(0.95, "nucleus: the likeliest tokens up to this mass (1: off)")
    min_p: float = _knob(0.05, "drop tokens under min_p x the likeliest's probability (0: off)")
    repeat_penalty: float = _knob(1.0, "llama.cpp's repeat penalty: the last repeat_last_n tokens pushed down (1: off)")
    repeat_last_n: int = _knob(64, "tokens the penalties look back on")
    presence_penalty: float = _knob(0.0, "taken from the logit of each token among the last repeat_last_n (0: off)")
    frequency_penalty: float = _knob(0.0, "taken from a token's logit per time it is among the last repeat_last_n "
                                          "(0: off)")
    seed: int = _knob(-1, "sampling seed (-1: a fresh one each run)")
    # token id -> bias added to its logit, before the penalties: [[id, bias], ...] or {"id" = bias}; -inf or
    # false: never (a call may also name a token by its text: lever.api.call)
    logit_bias: LogitBias = attrs.field(factory=LogitBias, converter=LogitBias.of)
    ignore_eos: bool = False  # the end tokens never chosen (a -inf bias): the text runs to n_predict
    # how a sampled token is drawn (lever.model.sampling.DRAWS): "llama.cpp", its draws from the seed, the
    # text autoregressive decoding's (and llama.cpp's) with that seed whatever the trees; or "rejection"
    draws: str = "llama.cpp"
    prompt: str = ""  # the prompt when none is given on the command line

    def __attrs_post_init__(self):
        _check_limits("generate", self, GENERATE_LIMITS)
        if self.draws not in DRAWS:
            raise LeverError(f"[generate] draws: must be {' or '.join(DRAWS)}, got {self.draws!r}")

    def params(self, eos_ids: frozenset[int] = frozenset()) -> SamplingParams:
        """The sampling knobs, as lever.model.sampling takes them; with `ignore_eos`, `eos_ids`
        (the model's end tokens) banned by the logit bias, as llama-server bans them."""
        params = SamplingParams(**{f.name: getattr(self, f.name) for f in attrs.fields(SamplingParams)})
        if self.ignore_eos and eos_ids:
            return attrs.evolve(params, logit_bias=params.logit_bias.banning(eos_ids))
        return params


@attrs.frozen
class Knob:
    """One generation knob, as every surface names and bounds it."""

    key: str  # its [generate] key, and GenerateConfig's field
    arg: str  # its name in a call (lever.api, lever serve)
    flag: str  # the commands' flag: --flag, or -n for one letter
    limit: Range  # what [generate] accepts
    call: Range  # what a call accepts
    help: str

    @property
    def option(self) -> str:
        return f"-{self.flag}" if len(self.flag) == 1 else f"--{self.flag}"


def _knobs() -> dict[str, Knob]:
    out = {}
    for f in attrs.fields(GenerateConfig):
        meta = f.metadata.get("knob")
        if meta is not None:
            limit = GENERATE_LIMITS[f.name]
            k = Knob(f.name, meta["arg"] or f.name, meta["flag"] or f.name.replace("_", "-"), limit,
                     meta["call"] or limit, meta["help"])
            out[k.key] = k
    return out


KNOBS: dict[str, Knob] = _knobs()  # by [generate] key, in GenerateConfig's order


MAX_EMULATED_MS = 1000.0  # a slower emulated unit is a mistake, and a run that would never end


@attrs.frozen
class RuntimeConfig:
    """Threads of this machine."""

    threads: int = 0  # compute threads (0: all cores)
    ahead_cores: int = 0  # cores drafting ahead keeps beside a verification pass (0: they take turns on all cores)
    # Emulates a compute-bound verification unit (an NPU busy with a big tree): each target layer
    # of a pass takes at least this many ms per token, waiting out the rest (0: the CPU as it is).
    emulate_layer_ms_per_token: float = 0.0
    # A what-if: trees are priced as if flash read this many bytes/s (a phone's UFS 4.0: 4.2e9),
    # and the online corrections leave the read alone; the reads themselves stay this machine's,
    # so a cycle's predicted time is the what-if's and its tokens are real (0: price what is measured).
    what_if_read_bytes_per_s: float = 0.0

    def __attrs_post_init__(self):
        _check_limits("runtime", self, {"threads": THREADS, "ahead_cores": THREADS})
        if not 0 <= self.what_if_read_bytes_per_s <= 1e12:  # not finite: refused where TOML is read
            raise LeverError(f"[runtime] what_if_read_bytes_per_s: must be in [0, 1e12], "
                             f"got {self.what_if_read_bytes_per_s}")
        if not 0 <= self.emulate_layer_ms_per_token <= MAX_EMULATED_MS:
            raise LeverError(f"[runtime] emulate_layer_ms_per_token: must be in [0, {MAX_EMULATED_MS}], "
                             f"got {self.emulate_layer_ms_per_token}")


@attrs.frozen
class Config:
    """A whole config: where it was read from, and one field per [section]."""

    path: Path | None = None
    model: ModelConfig = ModelConfig()
    pipeline: PipelineConfig = PipelineConfig()
    tree_expand: TreeExpandConfig = TreeExpandConfig()
    flash: FlashConfig = FlashConfig()
    channels: ChannelsConfig = ChannelsConfig()
    generate: GenerateConfig = GenerateConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    memory: MemoryConfig = MemoryConfig()
    profile: ProfileConfig = ProfileConfig()
    predictor: PredictorConfig = PredictorConfig()
    placement: PlacementConfig = PlacementConfig()
    qnn: QnnConfig = QnnConfig()

    @property
    def where(self) -> str:
        """How errors name this config."""
        return str(self.path) if self.path is not None else "config"


SECTIONS: dict[str, type] = {name: hint for name, hint in typing.get_type_hints(Config).items() if name != "path"}


def resolve_path(value: str, base: Path | None) -> str:
    """A path from a config: ~ and $VARS expanded, a relative one taken from the config's folder
    (`base`, the config file), or from the working directory (None: a --set or no file)."""
    p = Path(os.path.expandvars(os.path.expanduser(value)))
    if not p.is_absolute():
        p = (base.parent if base is not None else Path.cwd()) / p
    return str(p)


# Keys holding paths, resolved at load: (section, key). The models' may also name a model of
# $LEVER_MODELS as `-m NAME` does (`lever list`'s name or path), where no such file is here.
PATH_KEYS = (("model", "target"), ("model", "draft"), ("profile", "path"), ("predictor", "artifact"))
MODEL_KEYS = (("model", "target"), ("model", "draft"))


def _pulled(value: str) -> str | None:
    """The model of $LEVER_MODELS a config's [model] key names, as `-m NAME` finds it; a catalogue
    name not pulled yet is the file `lever pull` would make, so its error names that file."""
    if (found := find_model(value)) is not None:
        return str(found)
    entries = lookup(value)
    return str(models_dir() / entries[0].filename) if len(entries) == 1 else None


def _check_type(where: str, value: Any, hint: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        for arm in typing.get_args(hint):
            if arm is type(None) and value is None:
                return None
            try:
                return _check_type(where, value, arm)
            except LeverError:
                pass
        raise LeverError(f"{where}: {value!r} is not a {hint}")
    if origin is tuple:  # tuple[int, ...]: a TOML array of that type
        if not isinstance(value, list):
            raise LeverError(f"{where}: expected an array, got {type(value).__name__} {value!r}")
        return tuple(_check_type(f"{where}[{i}]", v, typing.get_args(hint)[0]) for i, v in enumerate(value))
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, float) and not math.isfinite(value):
        raise LeverError(f"{where}: must be a finite number, got {value!r}")
    if hint in (int, float, str, bool) and (type(value) is not hint):
        raise LeverError(f"{where}: expected {hint.__name__}, got {type(value).__name__} {value!r}")
    return value


def build_section(name: str, values: dict[str, Any], where: str) -> Any:
    cls = SECTIONS[name]
    hints = typing.get_type_hints(cls)
    known = {f.name for f in attrs.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        if key not in known:
            raise LeverError(f"{where}: [{name}] unknown key {key!r} (known: {', '.join(sorted(known))})")
        kwargs[key] = _check_type(f"{where}: [{name}] {key}", value, hints[key])
    try:
        return cls(**kwargs)
    except LeverError as e:
        raise LeverError(f"{where}: {e}") from None


BARE = re.compile(r"[^\"'\[\]{}]*")  # text with no quotes or brackets: a string as typed


def _parse_override(item: str) -> tuple[str, str, Any]:
    """`--set section.key=value`: exactly one TOML value (a bare word is a string)."""
    if any(ord(ch) < 32 and ch != "\t" for ch in item):
        raise LeverError(f"--set {item!r}: one line, no control characters (a newline would start another key)")
    if "=" not in item or "." not in item.split("=", 1)[0]:
        raise LeverError(f"--set {item!r}: expected section.key=value")
    lhs, rhs = item.split("=", 1)
    section, key = (part.strip() for part in lhs.strip().split(".", 1))
    try:
        parsed = tomllib.loads(f"v = {rhs}")
    except tomllib.TOMLDecodeError as e:
        if not BARE.fullmatch(rhs.strip()) or not rhs.strip():
            raise LeverError(f"--set {item!r}: not a TOML value ({e})") from None
        return section, key, rhs.strip()  # a bare word is a string
    if list(parsed) != ["v"]:
        raise LeverError(f"--set {item!r}: more than one value")
    return section, key, parsed["v"]


def check_overrides(overrides: list[str] = ()) -> list[tuple[str, str, Any]]:
    """Each `--set section.key=value` as (section, key, value), checked on its own as the config
    would check it (commands run this before any work; load_config runs it again)."""
    out = []
    for item in overrides:
        section, key, value = _parse_override(item)
        if section not in SECTIONS:
            raise LeverError(f"--set {item!r}: unknown section [{section}] (known: {', '.join(sorted(SECTIONS))})")
        build_section(section, {key: value}, f"--set {item!r}")  # its own error names --set, not the file
        out.append((section, key, value))
    return out


def load_config(path: str | os.PathLike | None, overrides: list[str] = ()) -> Config:
    data: dict[str, Any] = {}
    where = "defaults"
    if path is not None:
        path = Path(path)
        where = str(path)
        try:
            data = tomllib.loads(read_text(path, "config file"))
        except tomllib.TOMLDecodeError as e:
            raise LeverError(f"{path}: not valid TOML: {e}") from None
    overridden = set()
    for section, key, value in check_overrides(overrides):
        data.setdefault(section, {})[key] = value
        overridden.add((section, key))
    for name, values in data.items():
        if name not in SECTIONS:
            raise LeverError(f"{where}: unknown section [{name}] (known: {', '.join(sorted(SECTIONS))})")
        if not isinstance(values, dict):
            raise LeverError(f"{where}: {name} must be a [section] table")
    base = Path(path) if path is not None else None
    sections = {name: build_section(name, data.get(name, {}), where) for name in SECTIONS}
    for name, key in PATH_KEYS:
        value = getattr(sections[name], key)
        if value:  # a file's paths from its folder; a command line's from where it was typed
            where_from = None if (name, key) in overridden else base
            path = resolve_path(value, where_from)
            if (name, key) in MODEL_KEYS and not os.path.exists(path):
                path = _pulled(value) or path
            sections[name] = attrs.evolve(sections[name], **{key: path})
    return Config(base, **sections)
