"""`evals.report.table` under its old name, kept for one release: `python -m evals.table` runs it and
`import evals.table` is that module."""

import sys

from evals.report import table

if __name__ == "__main__":
    sys.exit(table.main())
sys.modules[__name__] = table
