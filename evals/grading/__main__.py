"""`python -m evals.grading <run dir> [<run dir> ...]`: re-grade stored outputs (`evals.grading.regrade`)."""

from evals.grading.regrade import main

main()
