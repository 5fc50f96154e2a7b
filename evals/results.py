"""`evals.report.results` under its old name, kept for one release: `python -m evals.results` runs it and
`import evals.results` is that module."""

import sys

from evals.report import results

if __name__ == "__main__":
    sys.exit(results.main())
sys.modules[__name__] = results
