"""The command line: every settings field is a flag (`--name`, booleans as `--name/--no-name`), grouped by section,
with its field's help text; Hugging Face Trainer's names are taken or refused (hf_names.py); `--config FILE.yaml`
sets flags from a file, the command line overriding it (run_file.py). `parse_args` returns the TrainConfig and which
flags were given, or stops with every problem found, each naming the flag and its fix (no usage dump).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
import typing

from model_utils.config import run_file
from model_utils.config.hf_names import HF_NAMES, Alias, Always, Refused, step_count
from model_utils.config.settings import PARSERS, SECTIONS, TrainConfig, flag_fields
from model_utils.core.problems import Problem, exit_on_problems

HELP = "python src/train_deepspeed.py --help"


def _base_type(annotation):
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if args else annotation


class TrainerArgumentParser(argparse.ArgumentParser):
    """argparse that answers bad input as the trainer does: each problem a Problem, never the usage dump. A flag is
    its whole name (no abbreviations: `--learning_rat` is a misspelling, not --learning_rate). `options` holds every
    flag's action by option string; `problems` what the Hugging Face names' actions refused."""

    def __init__(self, **kw):
        super().__init__(exit_on_error=False, allow_abbrev=False, **kw)
        self.options: dict[str, argparse.Action] = {}
        self.problems: list[Problem] = []

    def error(self, message):  # argparse's own complaints: raised, made a Problem
        raise argparse.ArgumentError(None, message)

    def action_of(self, option: str) -> argparse.Action | None:
        """The action of an option string: its flag's, by the whole name."""
        return self.options.get(option)

    def add(self, container, *names, **kw) -> argparse.Action:
        action = container.add_argument(*names, **kw)
        self.options.update(dict.fromkeys(action.option_strings, action))
        return action


def _add_flags(parser: TrainerArgumentParser, container, section_class) -> None:
    hints = typing.get_type_hints(section_class)
    for f in flag_fields(section_class):
        kind = _base_type(hints[f.name])
        kw = {"default": f.default, "help": f.metadata["help"].replace("%", "%%")}  # argparse formats help
        names = [f"--{f.name}", *f.metadata.get("aliases", ())]
        if kind is bool:
            parser.add(container, *names, action=argparse.BooleanOptionalAction, dest=f.name, **kw)
        else:
            kind = PARSERS[f.metadata["parse"]] if "parse" in f.metadata else kind
            parser.add(container, *names, type=kind, choices=f.metadata.get("choices"), dest=f.name, metavar=(
                None if f.metadata.get("choices") else f.name.upper()), **kw)


# ---------------------------------------------------------------------------------- Hugging Face Trainer's names
def truth(text: str) -> bool | None:
    """A true/false value as Hugging Face's argument parser reads it (yes, true, t, y, 1 / no, false, f, n, 0)."""
    word = str(text).lower()
    return True if word in ("yes", "true", "t", "y", "1") else False if word in ("no", "false", "f", "n", "0") else None


class _TrainerName(argparse.Action):
    """A Trainer name that sets no flag: it takes its values (NARGS) and answers with a Problem where it must."""

    NARGS = "?"

    def __init__(self, option_strings, dest, entry: Always | Refused, **kw):
        super().__init__(option_strings, argparse.SUPPRESS, nargs=self.NARGS, default=argparse.SUPPRESS,
                         help=argparse.SUPPRESS, **kw)
        self.entry = entry


class _RefusedName(_TrainerName):
    """A Trainer name that means something else here: its values are taken, a Problem names the flag to use."""

    NARGS = "*"

    def __call__(self, parser, namespace, values, option_string=None):
        parser.problems.append(Problem(option_string, " ".join(values) if values else True,
                                       f"is Hugging Face Trainer's; here {self.entry.differs}", self.entry.fix))


class _AlwaysName(_TrainerName):
    """A Trainer name for what this trainer always does: taken alone or true, refused when false."""

    def __call__(self, parser, namespace, values, option_string=None):
        if values is not None and truth(values) is not True:
            parser.problems.append(Problem(option_string, values, f"cannot be turned off: {self.entry.what}",
                                           self.entry.instead))


class _DeepSpeedName(argparse.Action):
    """--deepspeed FILE is --ds_config FILE (Trainer's); bare --deepspeed is DeepSpeed's launcher convention
    (`deepspeed train.py --deepspeed --deepspeed_config FILE`) and changes nothing: DeepSpeed is always used."""

    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, "ds_config", nargs="?", default=argparse.SUPPRESS, metavar="FILE", **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        if values is None:
            return
        if values.lstrip().startswith("{"):
            parser.problems.append(Problem(option_string, values, "is a JSON text; this trainer reads the DeepSpeed "
                                           "config from a file", "write it to a file and pass --ds_config FILE"))
        else:
            setattr(namespace, self.dest, values)


def _add_hf_names(parser: TrainerArgumentParser) -> None:
    for name, entry in HF_NAMES.items():
        option = f"--{name}"
        if name == "deepspeed":
            parser.add(parser, option, action=_DeepSpeedName, help="The DeepSpeed config file, as --ds_config "
                       "(Hugging Face Trainer's name). Bare, as DeepSpeed's launcher passes it, it changes nothing.")
        elif isinstance(entry, Alias):
            ours = parser.options[f"--{entry.flag}"]
            parser.add(parser, option, dest=ours.dest, type=step_count if entry.steps_or_ratio else ours.type,
                       choices=ours.choices, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        else:
            parser.add(parser, option, action=_AlwaysName if isinstance(entry, Always) else _RefusedName, entry=entry)


# ----------------------------------------------------------------------------------------------------- the parser
SECTION_TITLES = {"model": "model", "data": "data", "batch": "batch", "optim": "optimisation (overrides of the "
                  "DeepSpeed config)", "checkpoint": "checkpoints, resume and export", "logging": "evaluation and "
                  "logging", "speed": "speed options (GPU; docs/PERFORMANCE.md)",
                  "preference": "preference tuning (docs/PREFERENCE.md)",
                  "vision": "vision-language models (docs/VISION.md)",
                  "curriculum": "curriculum stages (docs/YOUR-MODEL.md)"}


def build_parser() -> TrainerArgumentParser:
    parser = TrainerArgumentParser(
        prog="train_deepspeed.py",
        description="Train a causal language model with DeepSpeed. Settings that DeepSpeed owns live in ds_config.json.",
        epilog="Hugging Face Trainer's flag names are taken where they mean the same (--model_name_or_path, "
               "--deepspeed FILE, --num_train_epochs, ...) and otherwise refused with the flag to use "
               "(--per_device_train_batch_size: --micro_batch_size): docs/CONFIGURATION.md.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add(parser, "--config", metavar="FILE", help="A YAML file of flags by name (`max_steps: 300`, one a line), "
               "the command line overriding them; every run writes its own as CHECKPOINT_DIR/config.yaml. Example "
               "runs: configs/runs/.")
    for name, section in SECTIONS.items():
        _add_flags(parser, parser.add_argument_group(SECTION_TITLES[name]), section)
    _add_flags(parser, parser, TrainConfig)  # the seed and the modes
    # DeepSpeed's launcher appends --local_rank, which the environment also holds (deepspeed.add_config_arguments).
    parser.add(parser, "--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    _add_hf_names(parser)
    return parser


LAUNCHER_ONLY_FLAGS = ("local_rank", "config")


# ---------------------------------------------------------------------------------------- problems, as users see them
def closest(name: str, known, prefix: str = "--", listed: str = f"{HELP} lists every flag") -> str:
    """'did you mean --a or --b?' for the known names nearest to `name` (difflib), else where they are listed."""
    matches = [f"{prefix}{m}" for m in difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.6)]
    if not matches:
        return listed
    return f"did you mean {', '.join(matches[:-1]) + ' or ' if len(matches) > 1 else ''}{matches[-1]}? ({listed})"


def _given_value(tokens: list[str], option: str) -> str:
    for i, token in enumerate(tokens):
        if token.startswith(option + "="):
            return token.partition("=")[2]
        if token == option:
            following = tokens[i + 1] if i + 1 < len(tokens) else ""
            return "(nothing)" if not following or following.startswith("--") else following
    return ""


def _argparse_problem(error: argparse.ArgumentError, tokens: list[str]) -> Problem:
    if error.argument_name is None:
        return Problem("command line", " ".join(tokens)[:100], error.message, f"{HELP} lists every flag")
    option = error.argument_name.split("/")[0]
    return Problem(option, _given_value(tokens, option), error.message, f"{HELP} says what {option} takes")


def _values_taken(action: argparse.Action | None) -> float:
    """How many bare tokens after the flag argparse gives it (an unknown flag: one, its likely value)."""
    if isinstance(action, argparse.BooleanOptionalAction):
        return 0
    return float("inf") if action is not None and action.nargs == "*" else 1


def _leftover_problems(extras: list[str], tokens: list[str], parser: TrainerArgumentParser) -> list[Problem]:
    """What argparse left: unknown flags, with the closest names, and values no flag took (`--gradient_checkpointing
    True`), each named with the flag before it. The command line is walked as argparse reads it (no positionals)."""
    if not extras:
        return []
    unknown = {token.partition("=")[0] for token in extras if token.startswith("-")}
    names = [option[2:] for option, action in parser.options.items() if action.dest != "local_rank"]
    problems, owner, room = [], None, 0
    for i, token in enumerate(tokens):
        option, has_value, value = token.partition("=")
        action = parser.action_of(option)
        if option in unknown or action is not None:
            owner, room = option, 0 if has_value else _values_taken(action)
            if action is None:
                following = tokens[i + 1] if i + 1 < len(tokens) and not has_value else ""
                value = value if has_value else "" if following.startswith("-") else following
                problems.append(Problem(option, value or True, "is not a flag of this trainer",
                                        closest(option.lstrip("-"), names)))
        elif room:
            room -= 1
        elif owner is None:
            problems.append(Problem(token, token, "is not a flag (flags start with --)", f"{HELP} lists every flag"))
        elif isinstance(parser.action_of(owner), argparse.BooleanOptionalAction):
            problems.append(Problem(owner, token, "is a switch and takes no value",
                                    f"write {owner} alone to turn it on, --no-{owner.lstrip('-')} to turn it off"))
        else:
            problems.append(Problem(owner, token, f"takes one value, and '{token}' is one more",
                                    "quote a value that holds spaces; a list is one value with commas (q_proj,v_proj)"))
    return problems


def _parse(parser: TrainerArgumentParser, tokens: list[str]) -> tuple[dict, list[Problem]]:
    parser.problems = []
    try:
        namespace, extras = parser.parse_known_args(tokens)
    except argparse.ArgumentError as error:
        return {}, [*parser.problems, _argparse_problem(error, tokens)]
    return vars(namespace), parser.problems + _leftover_problems(extras, tokens, parser)


# -------------------------------------------------------------------------------------------------- a config file
KINDS = {int: "a whole number", float: "a number", step_count: "a whole number of steps"}
YAML_WORDS = {True: ("on", "true", "yes"), False: ("off", "false", "no")}  # YAML 1.1 reads each as a boolean


def _file_tokens(path: str, key: str, value, action: argparse.Action) -> tuple[list[str], Problem | None]:
    """`key: value` of a config file as the command line's tokens, or the Problem with its type."""
    setting = f"{path}: {key}"
    if isinstance(action, argparse.BooleanOptionalAction):
        if not isinstance(value, bool):
            return [], Problem(setting, value, "is a switch: true or false", f"write {key}: true or {key}: false")
        return [f"--{key}" if value else f"--no-{key}"], None
    if value is None:
        if action.default is None:
            return [], None
        return [], Problem(setting, None, "has no value", f"give it one, or leave {key} out for its default "
                                                          f"({action.default})")
    if isinstance(value, (list, dict)) and getattr(action.type, "__name__", "") in ("mapping", "stage_list"):
        import json  # a structured setting (model_args, stages): passed on as the JSON its flag takes

        return [f"--{key}={json.dumps(value)}"], None
    if isinstance(value, (list, dict)):
        return [], Problem(setting, value, "takes one value", "write one value (a list as one text with commas: "
                                                              "q_proj,v_proj)")
    if isinstance(value, bool):
        if action.choices:  # YAML reads on/off and yes/no as true/false: the choice so written
            words = [c for c in action.choices if c in YAML_WORDS[value]]
            if words:
                return [f"--{key}={words[0]}"], None
        elif action.type in (None, str) and not isinstance(action, _TrainerName):
            return [], Problem(setting, value, f"is true/false, and {key} takes text", f"quote it: {key}: "
                                                                                       f"\"{str(value).lower()}\"")
    return [f"--{key}={value}"], None


def file_values(path: str, parser: TrainerArgumentParser) -> tuple[dict, list[Problem]]:
    """The flags a config file sets, by destination, and its problems, each naming the file and the key."""
    mapping, problems = run_file.read(path)
    values = {}
    keys = {option[2:]: action for option, action in parser.options.items()
            if not option.startswith("--no-") and action.dest not in ("local_rank", "config")}
    for key, value in mapping.items():
        setting = f"{path}: {key}"
        action = keys.get(key)
        if action is None:
            problems.append(Problem(setting, value, "is not a setting", closest(
                key, keys, prefix="", listed=f"a key is a flag's name without --; {HELP} lists every flag")))
            continue
        tokens, problem = _file_tokens(path, key, value, action)
        if problem is not None or not tokens:  # a problem, or null for a flag whose default is none
            problems += [problem] if problem else []
            continue
        parsed, found = _parse(parser, tokens)
        own_fix = isinstance(action, _TrainerName)  # a Trainer name's answer; else the value's type
        problems += [dataclasses.replace(p, setting=setting, fix=p.fix if own_fix else _type_fix(key, action))
                     for p in found]
        if not found and action.dest in parsed:
            values[action.dest] = parsed[action.dest]
    return values, problems


def _type_fix(key: str, action: argparse.Action) -> str:
    if action.choices:
        return f"write {key}: one of {', '.join(map(str, action.choices))}"
    kind = KINDS.get(action.type, "a value as --" + key + " takes it")
    example = f", e.g. {key}: {action.default}" if action.default is not None else ""
    return f"give {key} {kind}{example} ({HELP} describes --{key})"


def config_file_of(argv: list[str]) -> str | None:
    """The --config named on the command line (the last one, as argparse takes it)."""
    found = argparse.ArgumentParser(add_help=False, exit_on_error=False, allow_abbrev=False)
    found.add_argument("--config")
    try:
        return found.parse_known_args(argv)[0].config
    except argparse.ArgumentError:
        return None  # `--config` without a file: the full parse names it


# ------------------------------------------------------------------------------------------------------ parse_args
# Settings of which a run takes one: the one the command line gives replaces the file's other (a file's --num_epochs
# and a command line's --max_steps would otherwise be refused together, and the command line cannot unset a flag).
EITHER_OR = (("max_steps", "num_epochs"), ("dataset", "dummy_data"))


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """The configuration of a command line (and of the --config file it names); stops with exit status 2 and every
    problem found (exit_on_problems) where a flag or key is unknown, refused or of the wrong type."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    problems, from_file = [], {}
    config = config_file_of(argv)
    if config:
        from_file, problems = file_values(config, parser)
        parser.set_defaults(**from_file)  # the command line overrides the file
    values, found = _parse(parser, argv)
    exit_on_problems(problems + found)
    for name in LAUNCHER_ONLY_FLAGS:
        values.pop(name, None)
    defaults = TrainConfig().flags()
    defaults.update(defaults.pop("speed"))
    on_command_line = {k for k, v in values.items() if v != from_file.get(k, defaults.get(k))}
    for pair in EITHER_OR:
        for given, other in (pair, pair[::-1]):
            if given in on_command_line and other in from_file and other not in on_command_line:
                values[other] = defaults[other]
    explicit = frozenset(k for k, v in values.items() if v != defaults.get(k))
    return TrainConfig.from_flags(explicit=explicit, **values)
