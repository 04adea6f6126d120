"""How a setting is declared once, and everything derived from that declaration.

A section of settings is a dataclass whose fields are made with ``setting(default, help, rule=...)``: the
type (the annotation), the default, a one-line help and the rule its values must follow. From that alone
come an entry point's ``--flags`` (``add_flags``), the checks of every value before anything is built
(``check``, ``read_section``), the listing of every key (``describe_keys``, train.py ``--help-keys``) and the
docs' tables (``markdown_rows``). diffusion/config.py declares a run's sections with it; a model family
declares its objective the same way (models/flux.py, models/autoencoder.py).

Messages name a key through ``errors.spell``: ``--lr -1`` for the flag tools, ``lr=-1`` for train.py. The
module imports only the standard library, so entry points read it before the installed stack is checked.
"""

from __future__ import annotations

import argparse
import difflib
import math
import re
import typing
from dataclasses import MISSING, dataclass, field, fields, replace

from diffusion.errors import UsageError, spell


class Rule:
    """What a setting's values must be. ``complaint`` says what is wrong with a value (None: allowed),
    ``allowed`` says in a few words what is (docs, --help), ``bad_values`` gives values it refuses (as a user
    would type them) for the test that walks every setting."""

    def complaint(self, value) -> str | None:
        raise NotImplementedError

    def allowed(self) -> str:
        raise NotImplementedError

    def bad_values(self) -> list[str]:
        raise NotImplementedError


@dataclass(frozen=True)
class OneOf(Rule):
    choices: tuple

    def complaint(self, value):
        return None if value in self.choices else f"is not one of {', '.join(map(str, self.choices))}"

    def allowed(self):
        return "one of " + ", ".join(map(str, self.choices))

    def bad_values(self):
        return ["nonesuch"]


def _number(value) -> str | None:
    """A bound as people write it: 0, 1, 4294967296, 0.5."""
    if value is None:
        return None
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


@dataclass(frozen=True)
class Range(Rule):
    """Bounds of a number: ``gt``/``ge`` below, ``lt``/``le`` above. ``unit`` names what it counts."""

    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    integer: bool = False
    unit: str = ""

    def complaint(self, value):
        ok = (
            (self.gt is None or value > self.gt)
            and (self.ge is None or value >= self.ge)
            and (self.lt is None or value < self.lt)
            and (self.le is None or value <= self.le)
        )
        return None if ok and math.isfinite(value) else f"must be {self.allowed()}"

    def allowed(self):
        low, high = (self.gt, "(") if self.gt is not None else (self.ge, "[")
        top, close = (self.lt, ")") if self.lt is not None else (self.le, "]")
        of = f" of {self.unit}" if self.unit else ""
        low, top = _number(low), _number(top)
        if low is not None and top is not None:
            return f"in {high}{low}, {top}{close}{of}"
        if self.gt == 0:
            return f"a positive {'number' if of or not self.integer else 'integer'}{of}"
        if low is not None:
            return f"{'>' if self.gt is not None else '>='} {low}{of}"
        return f"{'<' if self.lt is not None else '<='} {top}{of}"

    def bad_values(self):
        out = []
        if self.gt is not None or self.ge is not None:
            out.append(self.gt if self.gt is not None else self.ge - 1)
        if self.lt is not None or self.le is not None:
            out.append(self.lt if self.lt is not None else self.le + 1)
        return [_number(v) for v in out]


# A Composer time string: a number and a unit (ba batches, ep epochs, sp samples, tok tokens, dur the run's share).
_TIME = re.compile(r"\s*(\d+(?:\.\d*)?(?:[eE]\+?\d+)?)\s*(ba|ep|sp|tok|dur)\s*")
_UNIT_NAMES = {"ba": "batches", "ep": "epochs", "sp": "samples", "tok": "tokens", "dur": "of the run"}


# The word an interval that may be off takes for "off" (eval_interval=never): what its default reads as.
NEVER = "never"


@dataclass(frozen=True)
class Duration(Rule):
    """A Composer time string in one of ``units``; ``zero``: whether a zero length is allowed; ``never``: whether
    the word never is allowed too, read as the key's None (an interval that is off: eval_interval=never)."""

    units: tuple = ("ba", "ep", "sp")
    zero: bool = False
    never: bool = False

    def complaint(self, value):
        if self.never and value == NEVER:
            return None
        m = _TIME.fullmatch(str(value))
        ok = bool(m) and m.group(2) in self.units
        if ok:
            number = float(m.group(1))
            ok = (number > 0 or self.zero) and (number <= 1 if m.group(2) == "dur" else number == int(number))
        return None if ok else f"is not {self.allowed()}"

    def allowed(self):
        units = ", ".join(f"{u} ({_UNIT_NAMES[u]})" for u in self.units)
        whole = "a fraction in (0, 1]" if self.units == ("dur",) else "a whole number"
        example = "0ba" if self.zero else f"100{self.units[0]}"
        text = f"a training time: {'zero or ' if self.zero else ''}{whole} followed by {units}, e.g. {example}"
        return f"{text}; or {NEVER}" if self.never else text

    def bad_values(self):
        wrong_unit = next(u for u in _UNIT_NAMES if u not in self.units)
        return ["ten", f"1{wrong_unit}"] + ([] if self.zero else [f"0{self.units[0]}"])


@dataclass(frozen=True)
class NotEmpty(Rule):
    """A name, a path or a location: anything but the empty string (the rule of every plain text setting)."""

    def complaint(self, value):
        return None if str(value).strip() else "must not be empty"

    def allowed(self):
        return "text, not empty"

    def bad_values(self):
        return [""]


@dataclass(frozen=True)
class Either(Rule):
    """A number by ``number``'s rule, or one of ``words`` (device_train_microbatch_size: 8 or auto)."""

    number: Range
    words: tuple

    def complaint(self, value):
        if isinstance(value, str) and value in self.words:
            return None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if self.number.integer and value != int(value):
                return f"must be {self.allowed()}"
            return None if self.number.complaint(value) is None else f"must be {self.allowed()}"
        return f"must be {self.allowed()}"

    def allowed(self):
        return f"{self.number.allowed()} or {' or '.join(repr(w) for w in self.words)}"

    def bad_values(self):
        return self.number.bad_values() + ["lots"]

    def parse(self, text: str):
        if text in self.words:
            return text
        try:
            return int(text) if self.number.integer else float(text)
        except ValueError:
            return text  # complaint names it


@dataclass(frozen=True)
class Each(Rule):
    """Every item of a list or tuple follows ``rule``; ``length``: how many items there must be (0: any)."""

    rule: Rule
    length: int = 0

    def complaint(self, value):
        if self.length and len(value) != self.length:
            return f"must have {self.length} values, each {self.rule.allowed()}"
        for item in value:
            wrong = self.rule.complaint(item)
            if wrong:
                return f"item {item!r} {wrong}"
        return None

    def allowed(self):
        return f"{self.length or 'any number of'} values, each {self.rule.allowed()}"

    def bad_values(self):
        return [",".join([bad] * max(self.length, 1)) for bad in self.rule.bad_values()]


@dataclass(frozen=True)
class Check(Rule):
    """A rule whose check lives with the code that reads the value: ``check(value)`` returns what is wrong
    (None: allowed), e.g. the filter syntax of data/filters.py."""

    check: typing.Callable
    text: str
    bad: tuple

    def complaint(self, value):
        return self.check(value)

    def allowed(self):
        return self.text

    def bad_values(self):
        return list(self.bad)


def setting(
    default,
    help: str,
    rule: Rule | None = None,
    *,
    flag: str | None = None,
    shown: str | None = None,
    recipe_only: bool = False,
):
    """A dataclass field declaring one setting: its default, one-line help, the rule its values follow, the
    flag's name where it differs from the key (a repeatable flag: --filter for filters), how the default
    reads in the docs when the value itself does not say it (``shown``: "the model's native"), and whether it
    is a recipe key only (a structure no flag spells, such as phases)."""
    meta = {"help": help, "rule": rule, "flag": flag, "shown": shown, "recipe_only": recipe_only}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def same_as(section: type, key: str):
    """``section``'s declaration of ``key`` (default, help, rule), for another section that declares the same
    setting: one family's objective taking a key of the shared rectified-flow objective, say."""
    declared = section.__dataclass_fields__[key]
    if declared.default_factory is not MISSING:
        return field(default_factory=declared.default_factory, metadata=declared.metadata)
    return field(default=declared.default, metadata=declared.metadata)


@dataclass(frozen=True)
class Key:
    """One declared setting, as entry points, checks and docs read it."""

    name: str
    section: str
    kind: type  # int, float, str, bool, list, dict, tuple or object (int | str)
    optional: bool
    default: object
    help: str
    rule: Rule | None
    flag: str
    shown: str | None
    recipe_only: bool = False

    def default_text(self) -> str:
        if self.shown:
            return self.shown
        if self.default is None or self.default in ([], {}):
            return "none"
        if self.kind is bool:
            return "on" if self.default else "off"
        return str(self.default) if not isinstance(self.default, tuple) else " ".join(map(str, self.default))

    def allowed(self) -> str:
        base = {int: "an integer", float: "a number", bool: "true or false", dict: "KEY=VALUE pairs"}
        text = self.rule.allowed() if self.rule else base.get(self.kind, "text")
        return text

    def flag_help(self) -> str:
        """The help line of the flag: what it does, what is allowed where that says more than the type, and the
        default."""
        plain = self.kind in (bool, list, dict) and self.rule is None
        rule = "" if plain or isinstance(self.rule, (NotEmpty, OneOf)) else f" [{self.allowed()}]"
        return f"{self.help}{rule} (default {self.default_text()})".replace("%", "%%")

    def metavar(self) -> str:
        if isinstance(self.rule, OneOf):
            return "{" + ",".join(map(str, self.rule.choices)) + "}"
        if isinstance(self.rule, Duration):
            return "TIME"
        return {int: "N", float: "X", object: "N|auto"}.get(self.kind, "TEXT")


def _kind(annotation) -> tuple[type, bool]:
    """(base type, optional) of a field's annotation, given as a string under ``from __future__ import
    annotations``: 'Optional[int]', 'list[str]', 'tuple[float, float]', 'Any'."""
    text = str(annotation).replace(" ", "")
    optional = text.startswith("Optional[") or text.endswith("|None") or text == "Any"
    inner = text.removeprefix("Optional[").removesuffix("]") if text.startswith("Optional[") else text
    inner = inner.removesuffix("|None")
    for name, kind in (("list", list), ("dict", dict), ("tuple", tuple), ("bool", bool), ("int", int)):
        if inner.startswith(name):
            return kind, optional
    return {"float": float, "str": str}.get(inner, object), optional


def keys_of(*sections: type) -> list[Key]:
    """Every setting of the sections, in declaration order; the section is named by its class in lower case."""
    out = []
    for section in sections:
        own = section.__dict__.get("__annotations__", {})
        for f in fields(section):
            if f.name not in own:
                continue  # inherited: listed with its own section
            kind, optional = _kind(f.type)
            default = f.default if f.default is not MISSING else f.default_factory()
            rule = f.metadata.get("rule")
            if rule is None and kind is str:
                rule = NotEmpty()
            out.append(
                Key(
                    f.name,
                    section.__name__.lower(),
                    kind,
                    optional,
                    default,
                    f.metadata.get("help", ""),
                    rule,
                    f.metadata.get("flag") or f.name,
                    f.metadata.get("shown"),
                    f.metadata.get("recipe_only", False),
                )
            )
    return out


def _shown(value) -> str:
    return repr(value) if isinstance(value, str) else str(value)


_TYPE_NAMES = {
    int: "an integer",
    float: "a number",
    bool: "true or false",
    str: "text",
    list: "a list",
    tuple: "numbers separated by commas",
    dict: "a mapping",
}


def _convert(kind: type, value):
    """``value`` as ``kind``; ValueError when it is not one."""
    if isinstance(value, bool) and kind is not bool:
        raise ValueError
    if kind is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() not in ("true", "false"):
            raise ValueError
        return str(value).lower() == "true"
    if kind is int:
        number = float(value)
        if number != int(number):
            raise ValueError
        return int(number)
    if kind is float:
        return float(value)
    if kind is tuple and isinstance(value, str):  # KEY=VALUE's text (--objective text_layers=1,2,3): numbers
        value = [int(number) if float(number).is_integer() else float(number) for number in value.split(",")]
    if kind in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ValueError
        return kind(value)
    if kind in (str, dict) and not isinstance(value, kind):
        raise ValueError
    return value


def _typed(key: Key, value, where: str):
    """``value`` as the key's type (yaml gives 1e-4 as text, a flag gives text), or a UsageError."""
    if value is None or (value == NEVER and getattr(key.rule, "never", False)):
        if key.optional or key.default is None:
            return None
        raise UsageError(f"{spell(where)} must be set ({key.allowed()})")
    if key.kind is object:  # int | str: the rule parses its text (device_train_microbatch_size 8 or auto)
        return key.rule.parse(value) if isinstance(value, str) and hasattr(key.rule, "parse") else value
    try:
        return _convert(key.kind, value)
    except (TypeError, ValueError, OverflowError):
        raise UsageError(f"{spell(where, _shown(value))} must be {_TYPE_NAMES[key.kind]}") from None


def check_value(key: Key, value, where: str | None = None):
    """The value as its key's type, checked against the key's rule; a UsageError names the key as the entry
    point spells it (``where``: the full key, e.g. objective.shift)."""
    where = where or key.name
    value = _typed(key, value, where)
    if value is not None and key.rule is not None:
        wrong = key.rule.complaint(value)
        if wrong:
            help = f" ({key.help})" if key.help and len(key.help) < 90 else ""
            raise UsageError(f"{spell(where, _shown(value))} {wrong}{help}")
    return value


def check(obj, *sections: type) -> None:
    """Every setting of ``obj`` (an instance of the sections' dataclass) checked and converted in place."""
    for key in keys_of(*sections):
        setattr(obj, key.name, check_value(key, getattr(obj, key.name)))


def first_changed(obj, names) -> str | None:
    """The first of ``names`` whose value in the dataclass ``obj`` is not its declared default (None: none is): a
    technique's keys given without the key that turns it on."""
    defaults = {f.name: f.default for f in fields(obj)}
    return next((name for name in names if getattr(obj, name) != defaults[name]), None)


def nearest(name: str, names) -> str:
    close = difflib.get_close_matches(name, list(names), n=1)
    return f"; did you mean '{close[0]}'?" if close else ""


def section_keys(section: type) -> list[Key]:
    """Every setting of one section class, those it inherits included (a subclass's declaration of a key wins):
    FLUX.2 [dev]'s objective is klein's with three keys declared again."""
    chain = [c for c in reversed(section.__mro__) if "__dataclass_fields__" in c.__dict__]
    return list({k.name: k for k in keys_of(*chain)}.values())


def read_section(section: type, given: dict | None, prefix: str, label: str):
    """An instance of ``section`` from a dict of overrides (a recipe's ``objective:``), every value typed and
    checked; an unknown key is named with the nearest known one."""
    keys = {k.name: k for k in section_keys(section)}
    unknown = sorted(set(given or {}) - keys.keys())
    if unknown:
        what = f"{label} {prefix}" if label else prefix
        raise UsageError(f"unknown {what} key(s) {unknown}{nearest(unknown[0], keys)}; known: {sorted(keys)}")
    values = {name: check_value(keys[name], value, f"{prefix}.{name}") for name, value in (given or {}).items()}
    return section(**values)


# --- flags ------------------------------------------------------------------------------------------------
def _flag_type(key: Key):
    def parse(text: str):
        try:
            return _typed(key, text, key.name)
        except UsageError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = key.kind.__name__
    return parse


def _pairs(flag: str):
    def parse(text: str):
        if "=" not in text or not text.split("=", 1)[0]:
            raise argparse.ArgumentTypeError(f"--{flag} {text!r} is not KEY=VALUE")
        return tuple(text.split("=", 1))

    return parse


def add_flags(
    parser: argparse.ArgumentParser,
    keys: list[Key],
    groups: bool = True,
    required: tuple[str, ...] = (),
    strip: str = "",
) -> None:
    """A flag per key, named and explained by its declaration, in a group per section. A switch for a bool
    that is off by default (--use_ema), --no_KEY for one that is on; a list or a dict takes a repeatable
    flag (--filter EXPR, --tag KEY=VALUE); a tuple its values in a row (--betas 0.9 0.999). ``strip``: a
    prefix the tool leaves out of its flags (evaluate.py's --steps is the quality_steps key)."""
    sections = {}
    for declared in (k for k in keys if not k.recipe_only):
        key = _stripped(declared, strip)
        must = declared.name in required
        if groups and key.section not in sections:
            sections[key.section] = parser.add_argument_group(key.section)
        group = sections.get(key.section, parser)
        help = f"{key.help} (required)" if must else key.flag_help()
        if key.kind is bool:
            name, action = (f"--no_{key.name}", "store_false") if key.default else (f"--{key.name}", "store_true")
            group.add_argument(name, dest=key.name, action=action, default=key.default, help=help)
        elif key.kind is list:
            group.add_argument(
                f"--{key.flag}", dest=key.name, action="append", default=list(key.default), metavar="TEXT", help=help
            )
        elif key.kind is dict:
            group.add_argument(
                f"--{key.flag}",
                dest=key.name,
                action="append",
                type=_pairs(key.flag),
                default=[],
                metavar="KEY=VALUE",
                help=help,
            )
        elif key.kind is tuple:
            group.add_argument(
                f"--{key.flag}",
                dest=key.name,
                nargs=len(key.default),
                type=float,
                default=key.default,
                metavar="X",
                help=help,
            )
        else:
            group.add_argument(
                f"--{key.flag}",
                dest=key.name,
                type=_flag_type(key),
                default=None if must else key.default,
                required=must,
                metavar=key.metavar(),
                help=help,
            )


def _stripped(key: Key, strip: str) -> Key:
    """The key as a tool names it without the prefix ``strip`` (its flag, dest and messages)."""
    if not strip:
        return key
    name = key.name.removeprefix(strip)
    return replace(key, name=name, flag=key.flag.removeprefix(strip))


def from_flags(args: argparse.Namespace | dict, keys: list[Key], strip: str = "") -> dict:
    """The parsed flags of ``keys`` as name -> value (dict keys from their KEY=VALUE pairs), each checked
    against its declaration."""
    args = args if isinstance(args, dict) else vars(args)
    out = {}
    for key in (_stripped(k, strip) for k in keys if not k.recipe_only):
        value = args[key.name]
        out[key.name] = check_value(key, dict(value) if key.kind is dict else value)
    return out


def pick(keys: list[Key], *names: str) -> list[Key]:
    """The declared keys of these names, for a tool that shares some of a run's settings (data.py precompute
    takes model_name, image_size, encoder_dtype... as training does)."""
    by_name = {k.name: k for k in keys}
    return [by_name[n] for n in names]


# --- listings ---------------------------------------------------------------------------------------------
def describe_keys(keys: list[Key], flags: bool) -> str:
    """Every key by section with its type, default and help: train.py --help-keys, benchmark.py --help."""
    lines, section = [], None
    for key in keys:
        if key.section != section:
            section = key.section
            lines += ["", f"{section}:"]
        name = f"--{key.flag}" if flags else key.name
        lines.append(f"  {name}  ({key.allowed()}; default {key.default_text()})")
        lines.append(f"      {key.help}")
    return "\n".join(lines).lstrip("\n")


def markdown_rows(keys: list[Key], flags: bool | None) -> list[list[str]]:
    """Table rows (the flag, the recipe key, or both when ``flags`` is None; default, allowed values, meaning)
    for the docs."""
    rows = []
    for key in keys:
        switch = f"--no_{key.name}" if key.kind is bool and key.default else f"--{key.flag}"
        name = switch if flags else key.name if flags is False or key.recipe_only else f"{key.name}`, `{switch}"
        rows.append([f"`{name}`", key.default_text().replace("|", "\\|"), key.allowed(), key.help])
    return rows


# Rules many sections share (config.py's and the techniques' under diffusion/techniques/)
POSITIVE, POSITIVE_INT, COUNT = Range(gt=0), Range(gt=0, integer=True), Range(ge=0, integer=True)
SHARE = Range(ge=0, lt=1)  # a probability that must leave something
ENCODER_DTYPES = ("fp32", "bf16", "fp16")  # dtypes a frozen part may be read in


def torch_dtype(name: str | None):
    """The torch dtype for an ENCODER_DTYPES name (None: leave the part as built)."""
    import torch  # here: this module is read before the installed stack is checked

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, None: None}[name]
