"""The config file, and where a setting comes from: flag > environment > config file > default.

The file is $CKPTD_CONFIG if set, else $CKPTD_HOME/config.toml (CKPTD_HOME's
default: ~/.local/state/ckptd), else /etc/ckptd/config.toml; none is fine.
Its keys mirror what exists already, spelled the same:

    [env]                          # the CKPTD_* variables (ENV_KEYS)
    CKPTD_COORDINATOR = "coord.example:7070"
    CKPTD_TLS_DIR = "/etc/ckptd/tls"

    [launch]                       # a `ckptd COMMAND`'s long flags, without the dashes
    interval = 600.0
    keep = 5
    [coordinator]
    listen = "0.0.0.0:7070"
    admin = ["root", "ops"]
    metrics = "0.0.0.0:9464"
    [agent]                        # and [daemon]
    log-format = "json"

`apply` is the one place the order is decided: it makes each flag's
argparse default the environment's value (for the flags that have a CKPTD_*
variable, FLAG_ENV), else the file's, else the built-in one, so a flag given
on the command line wins.  A variable of [env] is set for this process and
what it starts (the embedded daemon) only where the environment lacks it.
An unknown key or a value of the wrong kind is a one-line error naming the
file and the key.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from ckptd.errors import CkptdError, Code

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - 3.10
    import tomli as tomllib

SYSTEM_FILE = Path("/etc/ckptd/config.toml")
# the variables a config file may set (CKPTD_HOME locates the file; CKPTD_JOB,
# CKPTD_RANK... are set by ckptd for a job's processes)
ENV_KEYS = (
    "CKPTD_COORDINATOR",
    "CKPTD_TLS_DIR",
    "CKPTD_MANIFEST_KEY",
    "CKPTD_ENCRYPT_KEY",
    "CKPTD_NODE",
    "CKPTD_IDLE_EXIT",
    "CKPTD_METRICS",
    "CKPTD_LOG_FORMAT",
)
# flags whose default is a CKPTD_* variable: (commands, flag's dest) -> variable
# (not --encrypt-key: the flag turns encryption on, CKPTD_ENCRYPT_KEY only names the key for --encrypt)
FLAG_ENV: dict[tuple[tuple[str, ...], str], str] = {
    (("coordinator", "agent"), "tls"): "CKPTD_TLS_DIR",
    (("coordinator", "agent"), "manifest_key"): "CKPTD_MANIFEST_KEY",
    (("agent",), "node"): "CKPTD_NODE",
    (("daemon",), "idle_exit"): "CKPTD_IDLE_EXIT",
    (("coordinator", "agent", "daemon"), "metrics"): "CKPTD_METRICS",
    (("coordinator", "agent", "daemon"), "log_format"): "CKPTD_LOG_FORMAT",
}


def config_path() -> Path | None:
    explicit = os.environ.get("CKPTD_CONFIG")
    if explicit:
        return Path(explicit)
    from ckptd.paths import default_home

    for path in (Path(default_home()) / "config.toml", SYSTEM_FILE):
        if path.is_file():
            return path
    return None


def load(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise CkptdError(Code.INVALID_ARGUMENT, f"cannot read config file {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise CkptdError(Code.INVALID_ARGUMENT, f"config file {path} is not valid TOML: {e}") from None
    return data


def _bad(path: Path, key: str, why: str) -> CkptdError:
    return CkptdError(Code.INVALID_ARGUMENT, f"config file {path}: {key}: {why}")


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _options(sub: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """A command's settable flags by their name in the file (the long flag without its dashes)."""
    out = {}
    for action in sub._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if longs and not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            out[longs[0][2:]] = action
    return out


def _value(path: Path, key: str, action: argparse.Action, value: Any) -> Any:
    """value as the flag would have parsed it, or a one-line error."""
    if isinstance(action, argparse._StoreTrueAction):
        if not isinstance(value, bool):
            raise _bad(path, key, f"wants true or false, not {value!r}")
        return value
    if isinstance(action, argparse._AppendAction):
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise _bad(path, key, f"wants a list of strings, not {value!r}")
        return value
    if action.type in (int, float):
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or (action.type is int and value != int(value))
        ):
            raise _bad(path, key, f"wants {'an integer' if action.type is int else 'a number'}, not {value!r}")
        value = action.type(value)
    elif not isinstance(value, str):
        raise _bad(path, key, f"wants a string, not {value!r}")
    if action.choices is not None and value not in action.choices:
        raise _bad(path, key, f"wants one of {', '.join(map(str, action.choices))}, not {value!r}")
    return value


def _from_env(var: str, action: argparse.Action) -> Any:
    raw = os.environ[var]
    if action.type is not None and callable(action.type):
        try:
            return action.type(raw)
        except ValueError:
            flag = action.option_strings[-1]
            raise CkptdError(Code.INVALID_ARGUMENT, f"{var}={raw!r} is not a valid {flag} value") from None
    if action.choices is not None and raw not in action.choices:
        raise CkptdError(Code.INVALID_ARGUMENT, f"{var}={raw!r}: use one of {', '.join(map(str, action.choices))}")
    return raw


def apply(parser: argparse.ArgumentParser, commands: bool = True) -> Path | None:
    """Read the config file and make it (and the environment) the parser's
    defaults, before parse_args.  commands=False (ckptctl): [env] only."""
    path = config_path()
    data = load(path)
    subs = _commands(parser) if commands else {}
    if path is not None:
        for section, table in data.items():
            if section != "env" and section not in subs:
                known = ", ".join(["env", *subs]) if commands else "env"
                if commands or section not in ("launch", "coordinator", "agent", "daemon", "certs"):
                    raise _bad(path, f"[{section}]", f"unknown section (known: {known})")
                continue  # ckptd's sections: ckptd checks them
            if not isinstance(table, dict):
                raise _bad(path, section, "wants a table ([" + section + "])")
        env = data.get("env", {})
        for key, value in env.items():
            if key not in ENV_KEYS:
                raise _bad(path, f"[env] {key}", f"unknown variable (known: {', '.join(ENV_KEYS)})")
            if isinstance(value, bool) or not isinstance(value, (str, int, float)):
                raise _bad(path, f"[env] {key}", f"wants a string, not {value!r}")
            os.environ.setdefault(key, str(value))  # the environment wins
    where = path or SYSTEM_FILE
    for name, sub in subs.items():
        options = _options(sub)
        for key, value in data.get(name, {}).items():
            if key not in options:
                raise _bad(where, f"[{name}] {key}", f"unknown key (`ckptd {name} --help` lists the flags)")
            options[key].default = _value(where, f"[{name}] {key}", options[key], value)
            options[key].required = False  # given by the file (`agent --coordinator`)
        for (cmds, dest), var in FLAG_ENV.items():
            if name in cmds and os.environ.get(var):
                action = next(a for a in options.values() if a.dest == dest)
                action.default = _from_env(var, action)
                action.required = False
    return path
