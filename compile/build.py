"""`python -m compile.build ...` from a checkout: the build lives in nxdi_voxtral/build.py."""
import sys

from nxdi_voxtral.build import main

if __name__ == "__main__":
    sys.exit(main())
