"""Run the Triton kernels in Triton's CPU interpreter where no GPU is present.

``triton.jit`` reads TRITON_INTERPRET when a kernel is decorated; flashattn_triton imports its
kernel module lazily (at the first Triton call), so setting the variable here, before any test
runs, is early enough. CI's nox session sets it too. On a GPU machine nothing is changed.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def set_options():
    """``set_options(**changes)`` for one test; the previous options come back afterwards."""
    from flashattn_triton import options

    saved = options.get_options()
    yield options.set_options
    options.set_options(saved)


@pytest.fixture(scope="module")
def ext():
    """The C++ launch path's extension, compiled for real (skipped without a C++ compiler or
    ninja, except where FLASHATTN_TRITON_TEST_REQUIRE_CPP=1, as CI sets it: there a missing
    tool fails the tests); tests drive it with launch-free plans where no GPU is present."""
    from flashattn_triton import cpp_launch

    if shutil.which("ninja") is None or not (shutil.which("c++") or shutil.which("g++")):
        if os.environ.get("FLASHATTN_TRITON_TEST_REQUIRE_CPP") == "1":
            pytest.fail("FLASHATTN_TRITON_TEST_REQUIRE_CPP=1 but no C++ compiler or ninja")
        pytest.skip("no C++ compiler or ninja")
    return cpp_launch.compile_extension()
