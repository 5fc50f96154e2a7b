"""`evals.report.names` under its old name, kept for one release: `import evals.names` is that module."""

import sys

from evals.report import names

sys.modules[__name__] = names
