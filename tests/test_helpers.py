"""The one closeness check every test relies on (helpers.assert_close) fails
where it should, and says where."""
import re

import numpy as np
import pytest

from helpers import assert_close


def test_passes_within_the_tolerance_of_the_largest_entry():
    want = np.array([[1.0, -2.0], [0.0, 1e-6]])
    assert_close("a", want + 1.9e-4, want)                # 1e-4 * max|want| = 2e-4
    assert_close("a", want.astype(np.float32), want)
    assert_close("empty", np.zeros((0, 3)), np.zeros((0, 3)))


@pytest.mark.parametrize("per_element", [False, True])
def test_fails_beyond_it_naming_the_array_and_the_worst_entry(per_element):
    want = np.ones((3, 4)) * np.arange(1, 5)
    got = want.copy()
    got[2, 1] += 1e-3                                     # 5e-4 relative to max|want| = 4
    with pytest.raises(AssertionError) as info:
        assert_close("dw_hh", got, want, per_element=per_element)
    msg = str(info.value)
    assert msg.startswith("dw_hh: 1 of 12 entries off")
    assert "worst at (2, 1)" in msg and "got 2.001" in msg and "want 2;" in msg
    assert re.search(r"largest error 0\.001 \(0\.00025 of max\|want\| 4\)", msg), msg


def test_near_zero_entries_are_held_to_the_largest_entry_s_accuracy():
    want = np.array([100.0, 1e-3])
    assert_close("a", [100.0, 1e-3 + 5e-3], want)          # 5e-3 <= 1e-4 * 100
    with pytest.raises(AssertionError, match="worst at \\(1,\\)"):
        assert_close("a", [100.0, 1e-3 + 5e-3], want, per_element=True)


def test_nan_shape_and_custom_tolerances():
    with pytest.raises(AssertionError, match=r"a: 1 of 2 entries off \(1 NaN\)"):
        assert_close("a", [np.nan, 1.0], [1.0, 1.0])
    with pytest.raises(AssertionError, match=r"a: shape \(2,\), expected \(2, 1\)"):
        assert_close("a", np.ones(2), np.ones((2, 1)))
    assert_close("a", [1.1], [1.0], rtol=0.2)
    with pytest.raises(AssertionError):
        assert_close("a", [1.0 + 1e-9], [1.0], rtol=1e-12, atol=0)
