"""matplotlib, the one optional dependency of the report writers (``pip install 'megatron-tsp[plot]'``)."""

from __future__ import annotations

from megatron_tsp.errors import UserError


def pyplot(flag: str):
    """``matplotlib.pyplot`` on the file-only Agg backend, or one line naming ``flag`` and the fix.

    The commands call it before they compute, so a missing matplotlib costs no run."""
    try:
        import matplotlib
    except ImportError:
        raise UserError(f"{flag} draws a PNG with matplotlib, which is not installed: "
                        "pip install 'megatron-tsp[plot]' (or matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
