"""``python -m lit_dp.options [PAGE]``: regenerate the tables of docs/options.md (or PAGE) from the declarations."""

import sys
from pathlib import Path

from lit_dp.options.docs import rewrite

rewrite(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[2] / "docs" / "options.md")
