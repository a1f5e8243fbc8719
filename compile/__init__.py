"""Checkout-only entry shim for `python -m compile.build` (the code: nxdi_voxtral.build; installed:
nxdi-voxtral-build)."""
