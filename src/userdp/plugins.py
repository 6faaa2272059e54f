"""Plugins: code that registers names — a training algorithm, an accountant, a per-unit strategy,
a noise mechanism, a sampler (:mod:`userdp.registry`) — before a command reads its configuration,
so that ``userdp train`` accepts them with no edit to userdp.

Three ways to load one, all before the config's choices or the command line's are checked:

* ``--plugin MODULE_OR_FILE`` on any ``userdp`` command: a dotted module importable from
  ``sys.path``, or the path of a ``.py`` file;
* ``plugins: [module, ...]`` at the top of a training config: module names only. A run directory
  stores its config and ``--resume`` reads it back, so a config never names a file to execute;
  the module must already be importable (installed, or on ``PYTHONPATH``);
* the entry-point group ``userdp.plugins`` of an installed package (loaded at every CLI start).

A plugin's code runs inside the training process with every right the process has, and the
guarantee rests on it as on userdp's own code: the run's ``privacy.json`` names the plugins that
were loaded, and the report repeats them.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

from userdp.errors import UserError

#: the entry-point group an installed package declares its userdp plugins in
ENTRY_POINT_GROUP = "userdp.plugins"

_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_LOADED: dict[str, ModuleType] = {}


def loaded() -> list[str]:
    """The plugins loaded in this process, in order (what a run records)."""
    return list(_LOADED)


def load(spec: str, *, source: str, allow_path: bool = True) -> ModuleType:
    """Import the plugin ``spec`` once (a module name, or with ``allow_path`` a ``.py`` file).

    Raises:
        UserError: one line naming ``source`` and the plugin: not found, not a module name, or
            its code failed (its own one-line error passes through)."""
    if spec in _LOADED:
        return _LOADED[spec]
    is_path = spec.endswith(".py") or "/" in spec or "\\" in spec
    if is_path and not allow_path:
        raise UserError(
            f"{source}: {spec!r}: a config names plugins as importable modules, not files "
            "(a run directory's config is read back; give a file with --plugin)"
        )
    if not is_path and not _MODULE_NAME.match(spec):
        raise UserError(f"{source}: {spec!r} is not a module name (e.g. mypackage.userdp_plugin) or a .py file")
    try:
        module = _from_file(Path(spec)) if is_path else importlib.import_module(spec)
    except UserError as exc:
        raise UserError(f"{source}: plugin {spec!r}: {exc}") from None
    except ModuleNotFoundError as exc:
        if not is_path and exc.name and (spec == exc.name or spec.startswith(f"{exc.name}.")):
            raise UserError(
                f"{source}: no module named {spec!r} (install it, or put its folder on PYTHONPATH)"
            ) from None
        raise UserError(f"{source}: plugin {spec!r} failed to load (ModuleNotFoundError: {exc})") from None
    except (SystemExit, KeyboardInterrupt, GeneratorExit) as exc:
        # a plugin must not end the command (and so set its exit status) while it loads
        raise UserError(f"{source}: plugin {spec!r} {_ended(exc)} while it loaded; nothing was run") from None
    except Exception as exc:  # noqa: BLE001 - a plugin's failure, reported in one line
        raise UserError(f"{source}: plugin {spec!r} failed to load ({type(exc).__name__}: {exc})") from None
    _LOADED[spec] = module
    return module


def _from_file(path: Path) -> ModuleType:
    if not path.is_file():
        raise UserError(f"{path} is not a file")
    name = f"userdp_plugin_{re.sub(r'[^A-Za-z0-9_]', '_', path.stem)}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UserError(f"{path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look a class's module up here
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _ended(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return f"called sys.exit({exc.code!r})"
    return f"raised {type(exc).__name__}"


def load_entry_points() -> list[str]:
    """Load every installed package's ``userdp.plugins`` entry points; returns their names.

    Raises:
        UserError: one line naming the entry point whose code failed."""
    names = []
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        key = f"{ep.name} ({ep.value})"
        if key in _LOADED:
            continue
        try:
            obj = ep.load()
        except UserError as exc:
            raise UserError(f"entry point {ENTRY_POINT_GROUP}:{ep.name}: {exc}") from None
        except (SystemExit, KeyboardInterrupt, GeneratorExit) as exc:
            raise UserError(
                f"entry point {ENTRY_POINT_GROUP}:{ep.name} = {ep.value} {_ended(exc)} while it loaded; nothing was run"
            ) from None
        except Exception as exc:  # noqa: BLE001
            raise UserError(
                f"entry point {ENTRY_POINT_GROUP}:{ep.name} = {ep.value} failed to load ({type(exc).__name__}: {exc})"
            ) from None
        _LOADED[key] = obj if isinstance(obj, ModuleType) else sys.modules.get(ep.module, obj)
        names.append(key)
    return names


def from_argv(argv: list[str]) -> list[str]:
    """The values of every ``--plugin X`` / ``--plugin=X`` in ``argv`` (read before argparse, so
    that the choices argparse checks include the names the plugins register)."""
    out = []
    for i, a in enumerate(argv):
        if a == "--":
            break
        if a == "--plugin" and i + 1 < len(argv):
            out.append(argv[i + 1])
        elif a.startswith("--plugin="):
            out.append(a.split("=", 1)[1])
    return out
