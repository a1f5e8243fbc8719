"""Checkout-only entry shim for `python -m artifacts` (the code: nxdi_voxtral.release; installed:
nxdi-voxtral-artifacts)."""
