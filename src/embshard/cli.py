"""What the Hydra entry points share: user errors become one line on stderr and exit 2."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from embshard.errors import EmbshardError, nearest_name

T = TypeVar("T")


def one_line_errors(run: Callable[[Any], T], cfg: Any) -> T:
    """Call `run(cfg)`; an error the user caused prints `error: <first line>` and exits 2."""
    from hydra.errors import InstantiationException

    try:
        return run(cfg)
    except (EmbshardError, MissingMandatoryValue, InstantiationException) as e:
        cause = user_error(e)
        if cause is None:  # Hydra could not build an object for another reason: not the user's setting
            raise
        # one write, not print's two (text, then newline): ranks of a torchrun share stderr, and
        # two writes each let their lines interleave
        sys.stderr.write(f"error: {str(cause).splitlines()[0]}\n")
        sys.stderr.flush()
        sys.exit(2)


def user_error(e: BaseException) -> BaseException | None:
    """`e` when the user caused it; for Hydra's InstantiationException (a planner's or model's
    `__init__` refused a setting, `searchers.neuroshard.floor_margin=2`), the EmbshardError it
    wraps; else None."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, (EmbshardError, MissingMandatoryValue)):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def refuse_unknown_keys(argv: Sequence[str], config_dir: Path, config_name: str, entry: str) -> None:
    """Hydra answers `key=value` for a key the config lacks (`evalute=none`,
    `searchers.neuroshard.checkpont=...`) or an option a group lacks (`hardware=cuda`) with
    several lines, exit status 1 (which here means "no valid plan") and, for a key, the advice
    to add it with '+' (a key nothing reads). Instead: one `error:` line with the nearest key
    or the group's options, exit 2. Called before Hydra parses `argv`; anything it cannot
    judge (sweeps, '+', '~', hydra's own keys) is left to Hydra."""
    plain = []
    for arg in argv:
        key, eq, value = arg.partition("=")
        if not eq or arg.startswith(("-", "+", "~")) or key.startswith("hydra") or "@" in key:
            continue
        plain.append((arg, key, value))
    if not plain:
        return
    from hydra import compose, initialize_config_dir

    def composed(overrides: list[str]) -> DictConfig | None:
        try:
            with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
                return compose(config_name=config_name, overrides=overrides, return_hydra_config=True)
        except Exception:  # noqa: BLE001 - whatever composition says, Hydra says again, in full
            return None

    # planners added under new names (+search@searchers.NAME=...: refuse_additions judged them)
    added = [arg for arg in argv if arg.startswith("+search@searchers.")]
    # the common case first: every override composes, so Hydra knows every key (its configs are
    # struct) and there is nothing to judge; one composition, not two, before Hydra's own
    if composed([arg for arg in argv if not arg.startswith("-")]) is not None:
        return
    cfg = composed(added)
    if cfg is None:
        return
    # a config group of the defaults list (hardware=torch_cpu): its options are the group's files
    groups = [(arg, key, value) for arg, key, value in plain if key in cfg.hydra.runtime.choices]
    for arg, key, value in groups:
        options = sorted(p.stem for p in (config_dir / key).glob("*.yaml"))
        if value not in options and value != "null" and not any(c in value for c in "[],${}"):
            near = nearest_name(value, options)
            hint = f" (did you mean {key}={near}?)" if near else ""
            _exit_2(f"{arg}: {key} has no option {value!r}{hint}; options: {', '.join(options)}")
    if groups:
        cfg = composed([*added, *(arg for arg, _, _ in groups)])
        if cfg is None:
            return
    for arg, key, _ in plain:
        if key in cfg.hydra.runtime.choices:
            continue  # a group, judged above
        node, path = cfg, []
        for part in key.split("."):
            if not isinstance(node, DictConfig):
                break  # a list index or a scalar's attribute: Hydra judges it
            if part not in node:
                where = ".".join(path)
                known = [str(k) for k in node.keys()]
                near = nearest_name(part, known)
                hint = f" (did you mean {'.'.join([*path, near])!r}?)" if near else ""
                scope = f"{where!r} has no key {part!r}" if where else f"{part!r} is not a {entry} key"
                _exit_2(f"{arg}: {scope}{hint}; python {entry} --help lists the keys")
            node = node._get_node(part)
            path.append(part)


def _exit_2(message: str) -> NoReturn:
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    sys.exit(2)


def refuse_additions(argv: Sequence[str], config_dir: Path, config_name: str, entry: str) -> None:
    """Hydra's `+key=value` adds a key: one the entry point never reads (silently ignored), or,
    for a key it has (`+algorithm=X`), a Hydra error several lines long. `~key` (Hydra's delete)
    removes a key it reads: a traceback. Either way: one `error:` line, exit 2."""
    for arg in argv:
        if arg.startswith("~"):
            _exit_2(f"{arg}: {entry}'s keys cannot be removed; give {arg[1:].partition('=')[0]} a value instead; "
                    f"python {entry} --help lists them")
        if not arg.startswith("+"):
            continue
        key, _, value = arg.lstrip("+").partition("=")
        if _adds_a_searcher(key, value, config_dir, entry):
            continue
        conf = OmegaConf.load(config_dir / f"{config_name}.yaml")
        known = [k for k in conf if k not in ("defaults", "hydra")]
        known += [next(iter(d)) for d in conf.defaults if isinstance(d, DictConfig) and "override" not in next(iter(d))]
        top = key.split(".")[0].split("/")[0]
        if top in known:
            fix = f"write {key}={value}"
        else:
            near = nearest_name(top, known)
            fix = f"{top!r} is not a {entry} key" + (f" (did you mean {near!r}?)" if near else "")
        _exit_2(f"{arg}: {entry} takes its own keys without '+': {fix}; python {entry} --help lists them")


def _adds_a_searcher(key: str, value: str, config_dir: Path, entry: str) -> bool:
    """`+search@searchers.NAME=OPTION`: Hydra's way to add a second planner of a kind under a new
    name (two checkpoints side by side: `algorithms=[dreamshard,NAME]
    searchers.NAME.checkpoint=...`). True for that form with a known option and a new name;
    one `error:` line for that form otherwise; False for any other key."""
    group, at, package = key.partition("@")
    if not at or group != "search" or not package.startswith("searchers."):
        return False
    name = package[len("searchers."):]
    options = sorted(p.stem for p in (config_dir / "search").glob("*.yaml"))
    if not name or "." in name:
        _exit_2(f"+{key}={value}: write +search@searchers.<new name>=<planner>; python {entry} --help lists them")
    if name in options:
        _exit_2(f"+{key}={value}: searchers.{name} exists; set its keys instead (searchers.{name}.<key>=...), "
                f"or add the planner under a new name")
    if value not in options:
        near = nearest_name(value, options)
        hint = f" (did you mean {near!r}?)" if near else ""
        _exit_2(f"+{key}={value}: no planner {value!r}{hint}; planners: {', '.join(options)}")
    return True
