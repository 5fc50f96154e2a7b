"""`evals.report.figures` under its old name, kept for one release: `python -m evals.figures` runs it and
`import evals.figures` is that module."""

import sys

from evals.report import figures

if __name__ == "__main__":
    sys.exit(figures.main())
sys.modules[__name__] = figures
