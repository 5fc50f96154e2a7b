"""What the benchmark scripts share: a method's policy from its config, with fields set on the command line."""

from __future__ import annotations

import pytest

from evals.bench.common import method_policy
from longflow.errors import UserError


def test_a_method_with_fields_after_colons():
    """`name:field=value`, values read as YAML, the config's other fields kept; the budget as for the bare name."""
    policy = method_policy("vanilla:one_launch=true:use_kernel=triton", 64)
    assert policy.one_launch is True and policy.use_kernel == "triton" and policy.variant == "paper"
    assert policy.budget is None  # the full cache takes no budget, with fields or without
    plain = method_policy("vanilla", 64)
    assert plain.one_launch is False and plain.use_kernel == "auto"
    longflow = method_policy("longflow:variant=lf_repo", 64)
    assert longflow.budget == 64 and longflow.variant == "lf_repo"


@pytest.mark.parametrize("method,message", [
    ("vanilla:one_launch", "not a field=value pair"),
    ("vanilla:=true", "not a field=value pair"),
    ("vanilla:no_such_field=1", "no_such_field"),
])
def test_a_bad_field_is_a_user_error(method, message):
    with pytest.raises(UserError, match=message):
        method_policy(method, 64)
