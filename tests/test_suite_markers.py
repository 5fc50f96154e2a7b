"""`make test-gpu` runs the tests marked `gpu` or `kernels`: a test module that runs Triton kernels on
whatever device there is (compiled on CUDA, interpreted elsewhere) must carry one of the two marks,
or a kernel change would pass `make test` in the interpreter and never be run compiled."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).parent
# How a module says that its kernels run on the GPU when there is one: the interpreter only without
# CUDA, or its tensors on CUDA when there is one.
RUN_ON_THE_GPU = ('setdefault("TRITON_INTERPRET", "1")', '"cuda" if torch.cuda.is_available() else "cpu"')


def module_marks(tree: ast.Module) -> set[str]:
    """The names of the `pytest.mark.X` in a module's `pytestmark` assignment."""
    marks = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            for sub in ast.walk(node.value):
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Attribute) and sub.value.attr == "mark":
                    marks.add(sub.attr)
    return marks


def test_the_marks_are_read_from_pytestmark():
    tree = ast.parse("import pytest\npytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings('x')]\n")
    assert module_marks(tree) == {"gpu", "filterwarnings"}
    assert module_marks(ast.parse("pytestmark = pytest.mark.kernels\n")) == {"kernels"}
    assert module_marks(ast.parse("marks = pytest.mark.kernels\n")) == set()


def test_modules_that_run_kernels_on_the_gpu_are_selected_by_make_test_gpu():
    texts = {path.name: path.read_text() for path in sorted(TESTS.glob("test_*.py")) if path != Path(__file__)}
    kernel_modules = [name for name, text in texts.items() if any(sign in text for sign in RUN_ON_THE_GPU)]
    assert {"test_kernel.py", "test_flash_decode.py", "test_slot_write.py"} <= set(kernel_modules)
    unmarked = [name for name in kernel_modules if not module_marks(ast.parse(texts[name])) & {"gpu", "kernels"}]
    assert not unmarked, (f"{unmarked} run Triton kernels on CUDA when there is a GPU: give each "
                          "`pytestmark = pytest.mark.kernels` so that `make test-gpu` runs it")
