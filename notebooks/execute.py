"""Run the notebooks top to bottom over a demo's artifacts and write them back with their outputs, figures
included (the committed notebooks are a run of this; the test suite runs it on the tiny zoo without writing).

    BLOCKPILOT_HOME=~/.cache/blockpilot BLOCKPILOT_DEMO_SIZE=mini python notebooks/execute.py [NOTEBOOK ...]
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

FOLDER = Path(__file__).resolve().parent
# Calls that draw a figure into a cell's outputs: matplotlib's and pandas' plotting, and the notebooks' `show`.
DRAWING_CALLS = {"show", "plot", "bar", "imshow", "subplots", "figure", "hist", "heatmap"}


def draws(source: str) -> bool:
    """Whether a cell, run, draws: a drawing call outside any function it only defines."""
    try:
        tree = ast.parse(source)
    except SyntaxError:  # IPython magics: not ours
        return False
    defined = {id(node) for top in ast.walk(tree) if isinstance(top, ast.FunctionDef) for node in ast.walk(top)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and id(node) not in defined:
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in DRAWING_CALLS:
                return True
    return False


def execute(notebook: Path, write: bool = False):
    """The executed notebook (nbformat), run with the inline backend so that each figure lands in its cell's
    outputs; written back in place when `write`."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(notebook, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(FOLDER.parent)}}).execute()
    if write:
        nbformat.write(nb, notebook)
    return nb


def cells_missing_figures(nb) -> list[int]:
    """Indices of the code cells that draw but hold no image in their outputs."""
    return [
        index
        for index, cell in enumerate(nb.cells)
        if cell.cell_type == "code"
        and draws(cell.source)
        and not any("image/png" in output.get("data", {}) for output in cell.outputs)
    ]


def main() -> int:
    notebooks = [Path(arg) for arg in sys.argv[1:]] or sorted(FOLDER.glob("*.ipynb"))
    for notebook in notebooks:
        nb = execute(notebook, write=True)
        missing = cells_missing_figures(nb)
        print(f"{notebook.name}: {'figures in every drawing cell' if not missing else f'no figure in cells {missing}'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
