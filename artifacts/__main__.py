"""`python -m artifacts ...` from a checkout: the release tool lives in nxdi_voxtral/release.py."""
import sys

from nxdi_voxtral.release import main

sys.exit(main())
