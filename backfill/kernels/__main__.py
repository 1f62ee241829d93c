"""`python -m backfill.kernels`: build the CPU kernels now (the set-up does), print the ISA."""

from __future__ import annotations

import sys

from backfill.kernels import build


def main() -> int:
    module = build(verbose="-v" in sys.argv)
    codes = "as subnormal floats" if module.subnormal_codes() else "converted to floats"
    form = ""
    if module.digit_form():
        form = "; Q4_0/Q4_1/Q4_K/Q8_0 in the digit form" + (", on the AMX tile unit" if module.amx() else "")
    print(f"backfill CPU kernels built; this CPU runs the {module.isa()} kernels (4-bit codes {codes}{form})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
