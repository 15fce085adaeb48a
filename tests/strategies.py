"""Hypothesis strategies shared by the dialects' fuzz tests."""

from __future__ import annotations

from hypothesis import strategies as st


def json_values(int_bound: int = 2**40) -> st.SearchStrategy[object]:
    """Any JSON value. Bodies encoded with orjson need ints within 64 bits (the default); a bound
    beyond that reaches the gateway's big-integer path (bodies encoded with the standard library)."""
    scalars = (
        st.none()
        | st.booleans()
        | st.integers(-int_bound, int_bound)
        | st.floats(allow_nan=False)
        | st.text(max_size=30)
    )
    return st.recursive(
        scalars,
        lambda children: (
            st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
        ),
        max_leaves=20,
    )
