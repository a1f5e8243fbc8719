"""Checkout-only entry shim for `python -m compile.build` (the code is nxdi_voxtral.build; installed: nxdi-voxtral-build)."""
