"""Run the notebooks top to bottom over a demo's artifacts and write them back with their outputs, figures
included (the committed notebooks are a run of this; the test suite runs it on the tiny zoo without writing).

    BLOCKPILOT_HOME=~/.cache/blockpilot BLOCKPILOT_DEMO_SIZE=mini python notebooks/execute.py [NOTEBOOK ...]
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

FOLDER = Path(__file__).resolve().parent
# A cell that draws: matplotlib or pandas plotting, or an image displayed.
DRAWS = re.compile(r"plt\.|\.plot\(|subplots\(|imshow\(|display\(Image")


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
        and DRAWS.search(cell.source)
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
