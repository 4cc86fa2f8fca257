"""A chain as data: one typed, frozen spec from config to manifest. YAML becomes a ChainSpec once (`ChainSpec.parse`,
every type and choice checked against the dataclasses' own annotations); the builder turns a spec into levels; the
planner returns a new spec (`with_knobs`); the published manifest serialises it (`as_config`). Nothing mutates one."""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal

from decode.engine.errors import DecodeError
from infra import schema


class SpecError(DecodeError, ValueError):
    """A chain config that does not fit the schema; one line naming the key."""


@dataclass(frozen=True)
class Draft:
    """How the last level drafts: a chain of `length` tokens, or an EAGLE-2 tree (depth, top_k, total_tokens)."""

    mode: Literal["chain", "tree"] = "chain"
    length: int | None = None
    depth: int | None = None
    top_k: int | None = None
    total_tokens: int | None = None

    def missing(self) -> list[str]:
        """The keys this mode needs and leaves unset."""
        needed = ("length",) if self.mode == "chain" else ("depth", "top_k", "total_tokens")
        return [key for key in needed if getattr(self, key) is None]

    def as_config(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @classmethod
    def of(cls, draft: Draft | dict | None) -> Draft:
        return draft if isinstance(draft, Draft) else parse(cls, draft or {}, "draft")


KIND_KEYS = {"model": ("model", "dtype", "layers", "vocab", "lm_head"),
             "eagle": ("path", "features", "method", "weights"), "ngram": ("max_ngram", "min_ngram")}


@dataclass(frozen=True)
class LevelSpec:
    """One level. model: `model` (target | w4 | a spec or folder), dtype, layers (early-exit copy), vocab: head
    (restricted to the head's draft vocabulary), lm_head: int8. eagle: path (eagle | a folder | untrained),
    features (nearest | target; default: what the head was trained on), method (eagle | eagle3, vLLM's names;
    default: the saved head's, eagle for `untrained`), weights: int8 (fc, layer and LM head rows on int8 rows where
    the head runs natively). ngram: max_ngram, min_ngram.
    mu: tokens a middle level gathers before handing up; draft: the last level's."""

    kind: Literal["model", "eagle", "ngram"] = "model"
    name: str | None = None
    mu: int = 1
    draft: Draft | None = None
    model: str = "target"
    dtype: str | None = None
    layers: int | None = None
    vocab: Literal["head"] | None = None
    lm_head: Literal["int8"] | None = None
    path: str = "eagle"
    features: Literal["nearest", "target"] | None = None
    method: Literal["eagle", "eagle3"] | None = None
    weights: Literal["int8"] | None = None
    max_ngram: int = 3
    min_ngram: int = 1

    @property
    def cost_row(self) -> str | None:
        """The row of decode.costs' costs.json that times this level as it runs (the model, then the LM head it
        computes: "w4 int8 head"), or None where costs.json has none (an early-exit copy, another dtype, a model other
        than the target and the W4 copy)."""
        if self.kind != "model" or self.model not in ("target", "w4") or self.layers or self.dtype:
            return None
        return " ".join([self.model] + ["int8 head"] * (self.lm_head == "int8") + ["V=head"] * (self.vocab == "head"))

    def as_config(self) -> dict[str, Any]:
        """The keys that apply to this kind of level, set ones only (what the manifest records)."""
        keys = ("kind", "name", "mu", "draft") + KIND_KEYS[self.kind]
        values = {key: getattr(self, key) for key in keys}
        return {k: v.as_config() if isinstance(v, Draft) else v for k, v in values.items() if v is not None}


@dataclass(frozen=True)
class ChainSpec:
    """Level 1 is the target, the last level drafts (its draft complete), names unique."""

    levels: tuple[LevelSpec, ...] = field(default_factory=tuple)

    @classmethod
    def parse(cls, raw: list[dict] | tuple, draft_defaults: dict | None = None, where: str = "chain") -> ChainSpec:
        """A spec from config: levels checked against the schema, names filled in (L1, L2, ...), the drafter's
        missing draft keys taken from `draft_defaults` (by mode: decode.draft_defaults)."""
        if not raw:
            raise SpecError("empty chain: list at least the target and one drafter")
        levels = [parse(LevelSpec, level, f"{where} level {i + 1}") for i, level in enumerate(raw)]
        levels = [dataclasses.replace(level, name=level.name or f"L{i + 1}") for i, level in enumerate(levels)]
        last = levels[-1]
        draft = Draft.of(last.draft)
        defaults = parse(Draft, {"mode": draft.mode, **(draft_defaults or {}).get(draft.mode, {})}, "draft_defaults")
        filled = dataclasses.replace(defaults, **{k: v for k, v in dataclasses.asdict(draft).items() if v is not None})
        levels[-1] = dataclasses.replace(last, draft=filled)
        spec = cls(tuple(levels))
        spec.check()
        return spec

    def check(self) -> None:
        first = self.levels[0]
        if first.kind != "model" or first.model != "target" or first.layers:
            raise SpecError(f"level 1 must be the target ({{kind: model, model: target}}), got {first.as_config()}")
        names = [level.name for level in self.levels]
        if len(set(names)) != len(names):
            raise SpecError(f"level names must be unique, got {names}")

    @property
    def drafter(self) -> LevelSpec:
        return self.levels[-1]

    def knobs(self) -> dict[str, Any]:
        """What the planner sets: every middle level's mu and the drafter's draft."""
        return {"mu": {level.name: level.mu for level in self.levels[1:-1]}, "draft": self.drafter.draft.as_config()}

    def with_knobs(self, knobs: dict[str, Any]) -> ChainSpec:
        """A new spec with these mus (by level name) and this draft."""
        middle = [dataclasses.replace(level, mu=int(knobs["mu"].get(level.name, level.mu)))
                  for level in self.levels[1:-1]]
        drafter = dataclasses.replace(self.drafter, draft=Draft.of(knobs["draft"]))
        return ChainSpec((self.levels[0], *middle, drafter))

    def as_config(self) -> list[dict[str, Any]]:
        return [level.as_config() for level in self.levels]


def _identity(level: LevelSpec) -> LevelSpec:
    """What a level loads and how it runs, without the knobs the planner sets (mu, draft)."""
    return dataclasses.replace(level, mu=1, draft=None)


def stacks(chains: Iterable[ChainSpec]) -> dict[str, list[dict[str, Any]]]:
    """Every chain the levels of `chains` allow, as level lists by name ("target<-w4<-head"), the configured chains'
    own stacks left out: the target, any subset of the model levels as middle levels (in the order they first
    appear), and any other level as the drafter. A drafter keeps its configured draft only where it drafted;
    ChainSpec.parse fills in the rest. Stacks whose level names would repeat are skipped."""
    chains = list(chains)
    pool: dict[LevelSpec, LevelSpec] = {}
    for chain in chains:
        for level in chain.levels[1:]:
            pool.setdefault(_identity(level), level)
    taken = {tuple(_identity(level) for level in chain.levels) for chain in chains}
    middles = [level for level in pool.values() if level.kind == "model"]
    found: dict[str, list[dict[str, Any]]] = {}
    for drafter in pool.values():
        others = [level for level in middles if level is not drafter]
        for size in range(len(others) + 1):
            for chosen in itertools.combinations(others, size):
                levels = (chains[0].levels[0], *chosen, drafter)
                names = [level.name for level in levels]
                if tuple(_identity(level) for level in levels) in taken or len(set(names)) < len(names):
                    continue
                raw = [{k: v for k, v in level.as_config().items() if k != "draft"} for level in levels[:-1]]
                found["<-".join(names)] = raw + [drafter.as_config()]
    return found


def parse(cls: type, raw: Any, where: str) -> Any:
    """An instance of dataclass `cls` from a mapping, every value checked against its field's annotation, every
    count at least 1 (infra.schema); unknown keys refused. SpecError names the key."""
    return schema.parse(cls, raw, where, SpecError, least=1)
