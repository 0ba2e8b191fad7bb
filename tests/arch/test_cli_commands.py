"""CLI command modules share helpers, never each other (issue 51 item 3): ``precast/cli/<command>.py`` imports the
shared modules (``cli/flags.py``, ``cli/common.py``, a command's own flags table ``cli/<command>_flags.py``) or
lower layers, never another command's module; and the export-llm flow is the library's (``precast.llm``): no CLI
module converts, measures or writes the folder around it."""

from __future__ import annotations

from pathlib import Path

from precast.cli import COMMANDS
from tests.arch.test_layers import PACKAGE, imports_of, module_name

CLI = PACKAGE / "cli"
COMMAND_MODULES = {f"precast.cli.{name.replace('-', '_')}" for name in COMMANDS}


def _imports(path: Path) -> set[str]:
    name = module_name(path)
    return {m for m, _ in imports_of(path.read_text(), name, path.name == "__init__.py")}


def test_command_modules_import_no_other_command():
    crossed = []
    for path in sorted(CLI.glob("*.py")):
        me = module_name(path)
        for imported in sorted(_imports(path)):
            # a command's module, or a submodule of one; a command's own flags table (export_llm_flags) is its own
            hit = next((c for c in COMMAND_MODULES if imported == c or imported.startswith(c + ".")), None)
            if hit is not None and hit != me and not me.startswith(hit + "_"):
                crossed.append(f"{me} imports {imported}")
    assert not crossed, "CLI command modules import each other (share through cli/common.py):\n" + "\n".join(
        crossed
    )


def test_the_llm_export_flow_lives_in_the_library():
    """The pipeline and the folder's writing are precast.llm's: the command calls ``precast.llm.exporter``, it
    neither converts, measures nor writes the folder itself."""
    own = {"precast.api", "precast.llm.folder_write", "precast.llm.folder_engines", "precast.llm.accuracy"}
    for path in sorted(CLI.glob("export_llm*.py")):
        assert not _imports(path) & own, (path.name, sorted(_imports(path) & own))
    assert "precast.llm.exporter" in _imports(CLI / "export_llm.py")
